"""Continuous batching: rows that end are refilled from the prompt queue, and a row's result does not depend on
which rows share its batch. Tokens, anchors, drafts and accepted counts equal those of each prompt decoded alone;
stored floats (features, teacher) agree to 1e-5 relative; shards list sequences in prompt order."""

from __future__ import annotations

import pytest
import torch

try:  # tests/ may or may not be a package
    from conftest import TINY_MASK
    # the same tiny target, drafter and no-grad fixtures as the rollout tests
    from test_rollout import STOP, OracleEngine, _no_grad, _OracleDrafter, _prompts, drafter, target  # noqa: F401
except ImportError:
    from .conftest import TINY_MASK
    from .test_rollout import STOP, OracleEngine, _no_grad, _OracleDrafter, _prompts, drafter, target  # noqa: F401

from specforge_opd.config import RolloutConfig
from specforge_opd.rollout.engine import SpeculativeEngine, autoregressive_generate
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.rollout.shards import InOrderShards, ShardWriter, read_shards

FLOATS = ("features", "teacher_hidden", "teacher_topk_logprobs", "teacher_draft_logprob")


class RowOracle(OracleEngine):
    """The oracle drafter with its corruption seeded by each row's own tokens, so it does not depend on the batch."""

    def make_drafter(self, target):
        return _RowOracleDrafter(self, SpeculativeEngine.make_drafter(self, target))


class _RowOracleDrafter(_OracleDrafter):
    async def propose(self, req):
        import dataclasses
        import zlib

        d = await self.inner.propose(req)
        out = d.tokens.clone()
        V = d.logits.shape[-1]
        for j, toks in enumerate(req.tokens):
            chain = self.engine._greedy_chain(tuple(toks), self.block_size - 1)
            g = torch.Generator().manual_seed(zlib.crc32(str(list(toks)).encode()))
            noise = torch.rand(len(chain), generator=g) < self.engine.corrupt
            out[j] = torch.where(noise, torch.randint(3, V - 1, (len(chain),), generator=g), torch.tensor(chain))
        return dataclasses.replace(d, tokens=out)


def assert_same_records(got: list[RolloutRecord], ref: list[RolloutRecord], what: str) -> None:
    """Integers equal; floats to 1e-5 relative (the norm of the difference against the reference's)."""
    assert [r.sample_id for r in got] == [r.sample_id for r in ref], what
    for a, b in zip(got, ref):
        for name in ("input_ids", "anchors", "drafts", "accepted", "teacher_topk_ids"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"{what}: {a.sample_id} {name}"
        assert a.finished == b.finished and a.prompt_len == b.prompt_len, f"{what}: {a.sample_id}"
        for name in FLOATS:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), f"{what}: {a.sample_id} {name}"
            if x is not None and y.numel():
                rel = float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12))
                assert rel < 1e-5, f"{what}: {a.sample_id} {name} differs by {rel:.2e} relative"


def _alone(engine, prompts, ids):
    return [engine.generate([p], [s])[0] for p, s in zip(prompts, ids)]


@pytest.mark.parametrize("teacher", ["full", "topk"])
def test_speculative_rows_equal_each_prompt_alone(target, drafter, teacher):
    """Mixed prompt lengths, stop tokens that end rows early, an oracle drafter that accepts several tokens
    (holes, compaction), the engine's own queue order."""
    prompts = _prompts([5, 3, 17, 9, 2, 30, 6, 11])
    ids = [f"p{i}" for i in range(len(prompts))]
    rc = RolloutConfig(max_new_tokens=20, teacher=teacher, teacher_topk=4)
    engine = RowOracle(target, drafter, rc, stop_token_ids=[STOP, 7, 11], mask_token_id=TINY_MASK)
    engine.compact_min_slots = 8  # squeeze often
    ref = _alone(engine, prompts, ids)
    got = engine.generate(prompts, ids, batch_size=3)
    assert engine.stats["admissions"] == len(prompts) - 3
    assert engine.stats["completion_tokens"] == sum(r.completion_tokens for r in ref)
    assert_same_records(got, ref, "batch 3, continuous")
    # the real DFlash drafter too (its context cache is refilled for admitted rows)
    plain = SpeculativeEngine(target, drafter, rc, stop_token_ids=[STOP, 7, 11], mask_token_id=TINY_MASK)
    assert_same_records(plain.generate(prompts, ids, batch_size=2), _alone(plain, prompts, ids), "dflash drafter, batch 2")


def test_a_row_ending_on_its_prefill_token_is_refilled_before_the_first_draft(target, drafter, nan_caches_in_prompt_order):
    """The refill before any draft goes into the drafter's pending context, not its (empty) cache."""
    prompts = _prompts([6, 4, 9, 12, 3])
    first = [o[0] for o in autoregressive_generate(target, prompts, 1, [])]
    stop = [first[1]]  # prompt 1 ends on the token its prefill gives
    rc = RolloutConfig(max_new_tokens=12, teacher="full")
    engine = SpeculativeEngine(target, drafter, rc, stop_token_ids=stop, mask_token_id=TINY_MASK)
    ids = [str(i) for i in range(len(prompts))]
    got = engine.generate(prompts, ids, batch_size=2)
    assert got[1].num_blocks == 0 and got[1].completion_tokens == 1
    assert nan_caches_in_prompt_order["before_first_draft"] >= 1
    assert_same_records(got, _alone(engine, prompts, ids), "refill before the first draft")


def test_sampled_rows_do_not_depend_on_the_batch(target, drafter):
    prompts = _prompts([4, 8, 2, 13, 5, 7])
    ids = [f"s{i}" for i in range(len(prompts))]
    rc = RolloutConfig(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3, teacher="token")
    engine = SpeculativeEngine(target, drafter, rc, stop_token_ids=[STOP], mask_token_id=TINY_MASK)
    assert_same_records(engine.generate(prompts, ids, batch_size=4), _alone(engine, prompts, ids), "T=0.9")


def test_plain_decoding_rows_equal_each_prompt_alone(target):
    prompts = _prompts([5, 3, 17, 9, 2, 30, 6, 11, 4])
    stats: dict = {}
    got = autoregressive_generate(target, prompts, 18, [STOP, 7, 11], batch_size=3, stats=stats)
    ref = [autoregressive_generate(target, [p], 18, [STOP, 7, 11])[0] for p in prompts]
    assert got == ref
    assert stats["admissions"] == len(prompts) - 3 and stats["decode_tokens"] == sum(len(o) - 1 for o in ref)
    # sampled, with per-row generators
    got = autoregressive_generate(target, prompts, 10, [STOP], temperature=1.0, seed=4, batch_size=2)
    ref = [autoregressive_generate(target, [p], 10, [STOP], temperature=1.0, seed=4, sample_ids=[str(i)])[0]
           for i, p in enumerate(prompts)]
    assert got == ref


def test_plain_decoding_tokens_do_not_depend_on_the_compaction_threshold(target):
    """The threshold only decides when holes are squeezed out (0: never)."""
    prompts = _prompts([5, 3, 40, 9, 2, 30, 6, 11, 4, 22, 35])
    runs = {}
    for f in (0.0, 0.95):
        st: dict = {}
        runs[f] = (autoregressive_generate(target, prompts, 40, [STOP, 7, 11], batch_size=3, stats=st, compact_below=f),
                   st["compactions"])
    assert runs[0.95][0] == runs[0.0][0]
    assert runs[0.0][1] == 0 and runs[0.95][1] > 0


def test_streamed_records_reach_on_record_and_the_result_is_empty(target, drafter):
    prompts = _prompts([5, 9, 3, 7])
    seen = []
    engine = SpeculativeEngine(target, drafter, RolloutConfig(max_new_tokens=10), stop_token_ids=[STOP], mask_token_id=TINY_MASK)
    assert engine.generate(prompts, ["a", "b", "c", "d"], batch_size=2, on_record=seen.append) == []
    assert sorted(r.sample_id for r in seen) == ["a", "b", "c", "d"]


def test_in_order_shards_list_sequences_in_prompt_order(tmp_path, target, drafter):
    prompts = _prompts([3, 4, 5, 6, 7])
    engine = SpeculativeEngine(target, drafter, RolloutConfig(max_new_tokens=6), stop_token_ids=[STOP], mask_token_id=TINY_MASK)
    recs = {r.sample_id: r for r in engine.generate(prompts, ["a", "b", "c", "d", "e"])}
    meta = {"target_identity": "t", "drafter_identity": "d", "drafter_step": 0, "block_size": 4,
            "target_layer_ids": [int(i) for i in drafter.config.dflash_config["target_layer_ids"]], "mask_token_id": TINY_MASK,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "teacher": "token", "anchors": "real",
            "features": True, "thinking": False, "target_dtype": "float32"}
    written = []
    shards = InOrderShards(ShardWriter(tmp_path, meta), ["a", "b", "c", "d", "e"], 2, skipped=lambda: ["c"],
                           on_write=lambda rs: written.append([r.sample_id for r in rs]))
    for sid in ["d", "b", "e"]:  # b cannot go before a has arrived
        shards.add(recs[sid])
    assert written == []
    shards.add(recs["a"])  # a, b, (c skipped), d, e are in order now
    assert written == [["a", "b"], ["d", "e"]]
    shards.close()
    assert [r.sample_id for r in read_shards(tmp_path)] == ["a", "b", "d", "e"]


def test_a_target_without_admit_refuses_a_continuous_batch(target, drafter):
    from specforge_opd.rollout.step import StepConfig, TargetCaps, run_inline, speculate

    class Stateless:
        caps = TargetCaps(name="a stateless target", greedy_only=True, teacher_forms=(), features=False)

    with pytest.raises(ValueError, match="cannot refill finished rows"):
        run_inline(speculate(Stateless(), None, [("a", [3]), ("b", [4])], StepConfig(4, 4, frozenset()), batch_size=1))


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_target_rollout_rows_equal_each_prompt_alone(embedded_target_dir):
    """The published drafter on real prompts, a continuous batch of 2 over 5 prompts, against each prompt alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge_opd.data.chat import render_prompt
    from specforge_opd.models.drafter import drafter_mask_token_id, load_drafter

    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(embedded_target_dir)
    drafter_model = load_drafter("published:smollm2-135m-instruct-dflash-b8", target_config=model.config)
    texts = ["Write a haiku about the sea.", "What is 17 * 23? Explain.", "def fib(n):\n    # return the n-th Fibonacci number",
             "Name three uses of copper.", "Translate 'good morning' into French and Spanish, then explain the difference in formality."]
    prompts = [tok(render_prompt(tok, [{"role": "user", "content": t}], thinking=False), add_special_tokens=False)["input_ids"]
               for t in texts]
    stops = [tok.eos_token_id]
    rc = RolloutConfig(max_new_tokens=32, teacher="full")
    engine = SpeculativeEngine(model, drafter_model, rc, stop_token_ids=stops, mask_token_id=drafter_mask_token_id(drafter_model))
    ids = [f"q{i}" for i in range(len(prompts))]
    got = engine.generate(prompts, ids, batch_size=2)
    assert engine.stats["admissions"] == len(prompts) - 2
    assert_same_records(got, _alone(engine, prompts, ids), "embedded target, batch 2")
    outs = autoregressive_generate(model, prompts, 32, stops, batch_size=2)
    assert outs == [autoregressive_generate(model, [p], 32, stops)[0] for p in prompts]


def _hf_features(model, seq, layer_ids):
    from specforge_opd.models.adapter import extract_context_feature

    out = model(torch.tensor([seq]), output_hidden_states=True)
    return extract_context_feature(out.hidden_states, layer_ids)[0], out.logits[0]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_capture_through_the_runner_equals_the_hf_forward(target):
    """Requested layers only, batched with left padding and chunked: equal to HF's all-layer forward (fp32)."""
    from specforge_opd.rollout.decode import TargetRunner, capture

    seqs = _prompts([7, 19, 3, 12])
    layer_ids = [0, 2, 3]  # the last layer's feature is the final-norm output, as HF's hidden_states[-1]
    outs = capture(TargetRunner.of(target), seqs, layer_ids, chunk=5, hidden=True)
    for seq, (f, h) in zip(seqs, outs):
        ref, logits = _hf_features(target, seq, layer_ids)
        assert f.shape == ref.shape and _rel(f, ref) < 1e-5
        assert _rel(target.lm_head(h), logits) < 1e-5


def test_sft_feature_files_equal_the_hf_forward(tmp_path, target):
    from specforge_opd.rollout.responses import ResponseRecord
    from specforge_opd.stages.sft_features import feature_path, run_features

    try:
        from sft_helpers import tiny_cfg
    except ImportError:
        from .sft_helpers import tiny_cfg
    seqs = _prompts([9, 14, 6, 11, 20])
    recs = [ResponseRecord(f"r{i}", s[:4], s[4:], True) for i, s in enumerate(seqs)]
    cfg = tiny_cfg(tmp_path / "run", **{"sft.batch_size": 2, "target.prefill_chunk": 8})
    stats = run_features(tmp_path / "f", recs, lambda: target, [1, 3], cfg)
    assert stats["samples"] == 5
    for j, (rec, seq) in enumerate(zip(recs, seqs)):
        sample = torch.load(feature_path(tmp_path / "f", j), weights_only=True)
        assert sample["input_ids"].tolist() == seq and sample["loss_mask"].tolist() == [0] * 4 + [1] * (len(seq) - 4)
        ref, _ = _hf_features(target, seq, [1, 3])
        assert _rel(sample["hidden_states"][0], ref) < 1e-5


def test_trajectory_cache_capture_equals_the_hf_forward(tmp_path, target):
    from specforge_opd.eval.evaluate import TrajectoryCache

    seq = torch.tensor(_prompts([15])[0])
    cache = TrajectoryCache.__new__(TrajectoryCache)
    cache.model, cache.target_calls = target, 0
    feats, gap = cache._capture(seq, [1, 2])
    out = target(seq[:-1].unsqueeze(0), output_hidden_states=True)
    for i in (1, 2):
        assert _rel(feats[i], out.hidden_states[i + 1][0]) < 1e-5
    top2 = out.logits[0].topk(2, dim=-1).values
    assert torch.allclose(gap, top2[:, 0] - top2[:, 1], atol=1e-4)


def test_rows_of_mixed_lengths_are_not_compacted_every_step(target, monkeypatch):
    """A batch whose longest row fills the cache has nothing to squeeze, however low its valid fraction: the
    fraction-based rule copied the whole cache on every step of such a batch (decode at batch 32 ran at 58%
    of its speed)."""
    from specforge_opd.rollout import inprocess

    calls = []
    real = inprocess.InProcessTarget._compact
    monkeypatch.setattr(inprocess.InProcessTarget, "_compact", lambda self, *a: (calls.append(1), real(self, *a))[1])
    prompts = _prompts([2, 2, 3, 70])  # valid fraction about 0.28, the longest row fills every slot
    outs = autoregressive_generate(target, prompts, 20, [])
    assert calls == [] and all(len(o) == 20 for o in outs)


@pytest.fixture
def nan_caches_in_prompt_order(monkeypatch):
    """Fresh cache memory filled with NaN (what ``torch.empty`` may hold), prompts taken in the given order (so a
    later prompt can be longer than the cache), and counters of the paths that order reaches."""
    from specforge_opd.rollout import decode, inprocess
    from specforge_opd.rollout import engine as engine_module

    real_init, real_pad, real_admit = decode.KVCache.__init__, decode.KVCache.pad_front, inprocess.InProcessTarget.admit
    seen = {"grown": 0, "before_first_draft": 0}

    def init(self, *a, **k):
        real_init(self, *a, **k)
        for buf in self.keys + self.values:
            buf.fill_(float("nan"))

    def pad(self, n):
        seen["grown"] += n > 0
        return real_pad(self, n)

    async def admit(self, rows, prompts):
        seen["before_first_draft"] += bool(self.slot_caches) and self.pending[1].shape[1] == self.valid.shape[1]
        return await real_admit(self, rows, prompts)

    monkeypatch.setattr(decode.KVCache, "__init__", init)
    monkeypatch.setattr(decode.KVCache, "pad_front", pad)
    monkeypatch.setattr(inprocess.InProcessTarget, "admit", admit)
    monkeypatch.setattr(engine_module, "queue_order", lambda lengths, batch_size, window_batches=4: list(range(len(lengths))))
    return seen


def test_admissions_that_grow_the_cache_or_come_before_the_first_draft_stay_exact(target, drafter, nan_caches_in_prompt_order):
    """A short first batch, a row that ends on its prefill token, then a prompt longer than the cache: hole slots
    are added in front (they must be zeros: NaN in a masked slot still poisons every row) and the first refill
    goes into the drafter's pending context."""
    seen = nan_caches_in_prompt_order
    prompts = _prompts([3, 5, 20, 4, 34, 2, 9])
    first = [o[0] for o in autoregressive_generate(target, prompts[:1], 1, [])]
    rc = RolloutConfig(max_new_tokens=10, teacher="full")
    engine = SpeculativeEngine(target, drafter, rc, stop_token_ids=[first[0], STOP], mask_token_id=TINY_MASK)
    ids = [f"g{i}" for i in range(len(prompts))]
    got = engine.generate(prompts, ids, batch_size=2)
    assert seen["grown"] >= 1 and seen["before_first_draft"] >= 1
    assert_same_records(got, _alone(engine, prompts, ids), "grown cache, refill before the first draft")
    plain = autoregressive_generate(target, prompts, 12, [STOP], batch_size=2)
    assert plain == [autoregressive_generate(target, [p], 12, [STOP])[0] for p in prompts]


def test_in_order_shards_keep_repeated_ids_and_bound_what_waits(tmp_path):
    """Hub rows without ids share ids across sources: every record is written once. One long early row cannot
    hold back more than max_waiting records: they are written ahead of it, sorted."""
    from specforge_opd.rollout.records import RolloutRecord

    def rec(sid):
        return RolloutRecord(sample_id=sid, input_ids=torch.tensor([5, 6, 7]), prompt_len=2, anchors=torch.tensor([2]),
                             drafts=torch.tensor([[9, 9, 9]]), accepted=torch.tensor([0]), features=None, finished=True,
                             drafter_step=0)

    class Collect:
        def __init__(self):
            self.shards = []

        def write(self, recs):
            self.shards.append([r.sample_id for r in recs])

    w = Collect()
    shards = InOrderShards(w, ["x", "dup", "dup", "y"], 2)
    for sid in ["dup", "dup", "y", "x"]:
        shards.add(rec(sid))
    shards.close()
    assert w.shards == [["x", "dup"], ["dup", "y"]]
    # a long first row: the rest are written ahead of it once more than 3 wait, and nothing twice
    w = Collect()
    order = [f"s{i}" for i in range(9)]
    shards = InOrderShards(w, order, 2, max_waiting=3)
    for sid in order[1:] + order[:1]:
        shards.add(rec(sid))
    shards.close()
    flat = [s for shard in w.shards for s in shard]
    assert sorted(flat) == sorted(order) and shards.overflows >= 1 and flat[:4] == ["s1", "s2", "s3", "s4"]
