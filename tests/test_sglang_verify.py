"""Verify mode against the stand-in server: equivalence with the in-process rollout, and faults.

Tolerances: features and log-probs 1e-4 absolute (the same fp32 model computes
both sides; only the batch shape of the forward differs); tokens, anchors, drafts
and accepted counts exactly, except where the target's top-2 logit gap is below
1e-4 (DESIGN.md, numerical ties), which the test asserts does not happen here.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import torch

from specforge_opd.config import SGLangConfig
from specforge_opd.sglang.contract import ContractError, server_layer_ids
from specforge_opd.sglang.launcher import Endpoints, ServerError, SGLangServer, server_args
from specforge_opd.sglang.speculate import Drafter, LocalTarget, speculate_sequence
from specforge_opd.testing.standin import StandinBackend, ThreadedStandin, make_app
from specforge_opd.sglang.verify_client import verify_rollout_async, verify_rollout_to_shards

from conftest import make_tiny_drafter, make_tiny_target
from sglang_helpers import OracleDrafter, greedy_reference

BS = 4
LAYERS = [0, 2]
PROMPTS = [("p0", [5, 17, 33, 8]), ("p1", [40, 41, 42]), ("p2", [7, 9, 11, 13, 15, 3])]
STOPS = [1]


def _cfg(**kw) -> SGLangConfig:
    base = dict(request_timeout_s=20.0, max_retries=2, backoff_s=0.05, max_in_flight=8, startup_timeout_s=60.0)
    base.update(kw)
    return SGLangConfig(**base)


def _standin(target, **kw):
    backend = StandinBackend(target, aux_layer_ids=server_layer_ids(LAYERS))
    srv = ThreadedStandin(make_app(backend, **kw))
    srv.backend = backend
    return srv


def _run_http(url, drafter, prompts=PROMPTS, teacher="topk", cfg=None, max_new=12):
    ep = Endpoints([url], version="0.5.23-standin")
    return asyncio.run(
        verify_rollout_async(
            ep, drafter, prompts, sglang_cfg=cfg or _cfg(), max_new_tokens=max_new, stop_token_ids=STOPS,
            teacher=teacher, teacher_topk=5, feature_dim=len(LAYERS) * 64,
        )
    )


def _run_local(target, drafter, prompts=PROMPTS, teacher="topk", max_new=12):
    local = LocalTarget(target, LAYERS, top_k=5)

    async def go():
        return [
            await speculate_sequence(local, drafter, ids, sample_id=sid, max_new_tokens=max_new, stop_token_ids=STOPS, teacher=teacher, store_features=True)
            for sid, ids in prompts
        ]

    return asyncio.run(go())


def test_verify_mode_equals_in_process_rollout():
    target = make_tiny_target()
    with _standin(target) as srv:
        http_recs = _run_http(srv.url, OracleDrafter(target, BS, seed=3))
    local_recs = _run_local(target, OracleDrafter(target, BS, seed=3))
    accepted_seen = set()
    for h, l in zip(http_recs, local_recs):
        assert h.sample_id == l.sample_id
        assert torch.equal(h.input_ids, l.input_ids)
        assert torch.equal(h.anchors, l.anchors)
        assert torch.equal(h.drafts, l.drafts)
        assert torch.equal(h.accepted, l.accepted)
        assert torch.allclose(h.features, l.features, atol=1e-4)
        assert torch.equal(h.teacher_topk_ids, l.teacher_topk_ids)
        assert torch.allclose(h.teacher_topk_logprobs, l.teacher_topk_logprobs, atol=1e-4)
        assert torch.allclose(h.teacher_draft_logprob, l.teacher_draft_logprob, atol=1e-4)
        accepted_seen.update(h.accepted.tolist())
    assert len(accepted_seen) >= 3, accepted_seen  # the oracle drafter exercised several accepted counts


def test_verify_mode_matches_independent_target_computation():
    """Tokens = plain greedy decoding; features = HF hidden_states[k+1] of the final sequence (one row per position);
    teacher log-probs = a separate forward over [seq[:a+1], drafts]; anchors follow a_{m+1} = a_m + r_m + 1."""
    target = make_tiny_target()
    with _standin(target) as srv:
        recs = _run_http(srv.url, OracleDrafter(target, BS, seed=5))
    for rec in recs:
        prompt = rec.input_ids[: rec.prompt_len].tolist()
        ref, gaps = greedy_reference(target, prompt, 12, STOPS)
        assert min(gaps) > 1e-4  # no numerical tie: exact token equality is the right check
        assert rec.input_ids.tolist() == ref
        T = rec.input_ids.numel()
        assert rec.features.shape == (T - 1, len(LAYERS) * 64)
        with torch.inference_mode():
            hs = target(rec.input_ids[None, :-1], output_hidden_states=True).hidden_states
        expect = torch.cat([hs[k + 1][0] for k in LAYERS], -1)
        assert torch.allclose(rec.features, expect, atol=1e-4)
        assert int(rec.anchors[0]) == rec.prompt_len
        for m in range(rec.num_blocks - 1):
            assert int(rec.anchors[m + 1]) == int(rec.anchors[m]) + int(rec.accepted[m]) + 1
        seq = rec.input_ids.tolist()
        for m in range(rec.num_blocks):
            a, r = int(rec.anchors[m]), int(rec.accepted[m])
            d = rec.drafts[m].tolist()
            assert seq[a + 1 : a + 1 + r] == d[:r][: max(0, T - a - 1)]
            with torch.inference_mode():
                lp = torch.log_softmax(target(torch.tensor([seq[: a + 1] + d])).logits[0].float(), -1)
            want = torch.stack([lp[a + k - 1, d[k - 1]] for k in range(1, BS)])
            assert torch.allclose(rec.teacher_draft_logprob[m], want, atol=1e-4)
            assert torch.equal(rec.teacher_topk_ids[m, :, 0], lp[a : a + BS - 1].argmax(-1))


def test_every_accepted_token_gets_one_feature_row_with_prefix_cache():
    """The stand-in reuses cached prefixes (cached_tokens > 0 on later verify steps, as SGLang's radix cache does);
    the client must still hold exactly one row per position 0..T-2, identical to a cache-free run."""
    target = make_tiny_target()
    same_prompt = [("a", [5, 17, 33, 8]), ("b", [5, 17, 33, 8])]  # the second sequence hits the first's cache
    with _standin(target) as srv:
        recs = _run_http(srv.url, OracleDrafter(target, BS, seed=9), prompts=same_prompt)
        assert srv.backend.max_cached > len(same_prompt[0][1])  # verify steps were served partly from the cache
    ref = _run_local(target, OracleDrafter(target, BS, seed=9), prompts=same_prompt)
    for h, l in zip(recs, ref):
        assert h.features.shape[0] == h.input_ids.numel() - 1
        assert torch.allclose(h.features, l.features, atol=1e-4)


def test_real_dflash_drafter_over_http_matches_in_process():
    target = make_tiny_target()
    dm = make_tiny_drafter(target, block_size=BS, layers=1)
    dm.config.dflash_config["target_layer_ids"] = LAYERS
    dm.target_layer_ids = LAYERS
    dm.fc = torch.nn.Linear(len(LAYERS) * 64, 64, bias=False)
    drafter = Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings())
    with _standin(target) as srv:
        h = _run_http(srv.url, drafter, teacher="token", max_new=8)
    l = _run_local(target, drafter, teacher="token", max_new=8)
    for a, b in zip(h, l):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.drafts, b.drafts) and torch.equal(a.accepted, b.accepted)
        assert a.teacher_topk_ids is None and a.teacher_draft_logprob.shape == (a.num_blocks, BS - 1)


def test_malformed_response_names_the_field():
    target = make_tiny_target()
    with _standin(target, malform="input_top_logprobs") as srv:
        with pytest.raises(ContractError, match=r"meta_info.input_top_logprobs.*server version 0.5.23-standin"):
            _run_http(srv.url, OracleDrafter(target, BS), prompts=PROMPTS[:1])
    with _standin(target, malform="hidden_states") as srv:
        with pytest.raises(ContractError, match=r"meta_info.hidden_states"):
            _run_http(srv.url, OracleDrafter(target, BS), prompts=PROMPTS[:1])


def test_timeout_retries_then_fails_clearly():
    target = make_tiny_target()
    cfg = _cfg(request_timeout_s=0.3, max_retries=1)
    with _standin(target, delay_s=1.0) as srv:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="2 attempts failed.*TimeoutError"):
            _run_http(srv.url, OracleDrafter(target, BS), prompts=PROMPTS[:1], cfg=cfg)
        assert time.monotonic() - t0 < 5


def test_launcher_args_for_each_mode():
    cfg = SGLangConfig(max_total_tokens=4096, extra_args=["--mem-fraction-static", "0.8"])
    v = server_args(cfg, model_path="/m", port=1234, mode="verify", target_layer_ids=[1, 9, 17])
    assert v[v.index("--host") + 1] == "127.0.0.1" and v[v.index("--max-total-tokens") + 1] == "4096"
    i = v.index("--return-aux-hidden-state-layer-ids")
    assert v[i + 1 : i + 4] == ["1", "9", "17"]  # unchanged: SGLang adds the +1 (captures before layer k+1)
    assert v[v.index("--speculative-algorithm") + 1] == "DFLASH" and "--speculative-draft-model-path" not in v
    assert "--enable-return-aux-hidden-states" in v and v[-2:] == ["--mem-fraction-static", "0.8"]
    n = server_args(cfg, model_path="/m", port=1234, mode="native", draft_path="/d", block_size=16)
    assert n[n.index("--speculative-algorithm") + 1] == "DFLASH"
    assert n[n.index("--speculative-num-draft-tokens") + 1] == "16"
    assert n[n.index("--speculative-draft-model-path") + 1] == "/d"
    with pytest.raises(ValueError, match="draft.path"):
        server_args(cfg, model_path="/m", port=1, mode="native")


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_target")
    make_tiny_target().save_pretrained(d)
    return d


def test_server_death_restart_keeps_shards_and_resumes(tiny_target_dir, tmp_path):
    """The launched stand-in crashes on its 6th /generate; the launcher restarts it once, the in-flight
    sequences retry (requests are stateless), shards written before stay, and the result equals a clean run."""
    target = make_tiny_target()
    once = tmp_path / "died"
    cfg = _cfg(python=sys.executable, launch_module="specforge_opd.testing.standin", max_retries=3)

    def args(port):
        return server_args(cfg, model_path=str(tiny_target_dir), port=port, mode="verify", target_layer_ids=LAYERS) + [
            "--standin-die-after", "6", "--standin-die-once-file", str(once)]

    written = []

    def write_shard(recs):
        written.append([r.sample_id for r in recs])

    with SGLangServer(cfg, args, log_path=tmp_path / "server.log") as server:
        pid0 = server.proc.pid
        ep = Endpoints.launched([server])
        verify_rollout_to_shards(
            ep, OracleDrafter(target, BS, seed=1), PROMPTS, sglang_cfg=cfg, sequences_per_shard=1, write_shard=write_shard,
            done_ids=["p0"], max_new_tokens=12, stop_token_ids=STOPS, teacher="topk", teacher_topk=5, feature_dim=len(LAYERS) * 64,
        )
        assert once.exists() and server.restarts == 1 and server.proc.pid != pid0
        proc = server.proc
    assert proc.poll() is not None  # stopped on exit
    assert written == [["p1"], ["p2"]]  # p0 was done already: resumed, not redone
    assert "launching" in (tmp_path / "server.log").read_text()


def test_second_death_is_a_clear_error(tiny_target_dir, tmp_path):
    cfg = _cfg(python=sys.executable, launch_module="specforge_opd.testing.standin", max_retries=3)

    def args(port):
        return server_args(cfg, model_path=str(tiny_target_dir), port=port, mode="verify", target_layer_ids=LAYERS) + ["--standin-die-after", "1"]

    target = make_tiny_target()
    with SGLangServer(cfg, args, log_path=tmp_path / "server.log") as server:
        with pytest.raises(ServerError, match="already restarted once"):
            asyncio.run(
                verify_rollout_async(
                    Endpoints.launched([server]), OracleDrafter(target, BS), PROMPTS[:1], sglang_cfg=cfg, max_new_tokens=4,
                    stop_token_ids=STOPS, teacher="token", teacher_topk=1, feature_dim=len(LAYERS) * 64,
                )
            )


def test_verify_mode_equals_engine_B_speculative_engine():
    """The same rollout through HTTP (verify mode) and through ``rollout.SpeculativeEngine`` (in-process,
    KV-cached, batched): tokens, anchors, drafts, accepted counts exactly; features and teacher to 1e-4."""
    rollout = pytest.importorskip("specforge_opd.rollout.engine")
    from specforge_opd.config import RolloutConfig

    target = make_tiny_target()
    dm = make_tiny_drafter(target, block_size=BS, layers=1)
    layers = [int(i) for i in dm.config.dflash_config["target_layer_ids"]]
    rcfg = RolloutConfig(max_new_tokens=10, temperature=0.0, teacher="topk", teacher_topk=5, store_features=True)
    engine = rollout.SpeculativeEngine(target, dm, rcfg, stop_token_ids=STOPS, mask_token_id=96)
    ref = engine.generate([ids for _, ids in PROMPTS], sample_ids=[sid for sid, _ in PROMPTS])
    drafter = Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings())
    backend = StandinBackend(target, aux_layer_ids=server_layer_ids(layers))
    with ThreadedStandin(make_app(backend)) as srv:
        ep = Endpoints([srv.url], version="0.5.23-standin")
        recs = asyncio.run(
            verify_rollout_async(ep, drafter, PROMPTS, sglang_cfg=_cfg(), max_new_tokens=10, stop_token_ids=STOPS,
                                 teacher="topk", teacher_topk=5, feature_dim=len(layers) * 64)
        )
    for h, e in zip(recs, ref):
        assert h.sample_id == e.sample_id
        assert torch.equal(h.input_ids, e.input_ids)
        assert torch.equal(h.anchors, e.anchors) and torch.equal(h.drafts, e.drafts) and torch.equal(h.accepted, e.accepted)
        assert torch.allclose(h.features, e.features.float(), atol=1e-4)
        assert torch.allclose(h.teacher_draft_logprob, e.teacher_draft_logprob.float(), atol=1e-4)
        if e.teacher_topk_ids is not None:
            assert torch.equal(h.teacher_topk_ids, e.teacher_topk_ids)
            assert torch.allclose(h.teacher_topk_logprobs, e.teacher_topk_logprobs.float(), atol=1e-4)


def test_layer_ids_pass_unchanged_and_the_server_adds_the_offset():
    """SGLang's DFLASH capture adds +1 itself (layers_to_capture = [k + 1 for k in layer_ids]): id k returns HF
    hidden_states[k + 1], the output of decoder layer k. The stand-in applies that offset, so a client that
    shifted the ids as well would receive hidden_states[k + 2] and fail the feature checks above."""
    assert server_layer_ids([1, 9, 17]) == [1, 9, 17]
    target = make_tiny_target()
    backend = StandinBackend(target, aux_layer_ids=[0, 2])
    ids = [5, 17, 33, 8]
    out = backend.generate_verify({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                                   "logprob_start_len": 0, "top_logprobs_num": 0, "return_hidden_states": True})
    with torch.inference_mode():
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    got = torch.tensor(out["meta_info"]["hidden_states"][0])
    assert torch.allclose(got, torch.cat([hs[1][0], hs[3][0]], -1), atol=1e-5)
    with pytest.raises(ValueError, match="last layer"):
        server_layer_ids([1, 3], num_target_layers=4)
    with pytest.raises(ValueError, match="non-negative"):
        server_layer_ids([-1])


def test_repeated_layer_ids_are_captured_once_and_repeated_by_the_client():
    """SGLang refuses a repeated id; small targets' drafters have them ([1, 1] here): the server captures each
    layer once and the client repeats its columns, giving the features of the in-process rollout."""
    from specforge_opd.sglang.contract import feature_columns

    assert server_layer_ids([1, 1, 2]) == [1, 2]
    assert feature_columns([1, 1, 2], 2).tolist() == [0, 1, 0, 1, 2, 3] and feature_columns([0, 2], 2) is None
    target = make_tiny_target()
    layers = [2, 2]
    with ThreadedStandin(make_app(StandinBackend(target, aux_layer_ids=server_layer_ids(layers)))) as srv:
        recs = asyncio.run(verify_rollout_async(
            Endpoints([srv.url]), OracleDrafter(target, BS, seed=3), PROMPTS[:2], sglang_cfg=_cfg(), max_new_tokens=8,
            stop_token_ids=STOPS, teacher="token", teacher_topk=1, feature_dim=len(layers) * 64, layer_ids=layers,
        ))
    local = LocalTarget(target, layers, top_k=1)
    for rec, (sid, ids) in zip(recs, PROMPTS[:2]):
        ref = asyncio.run(speculate_sequence(local, OracleDrafter(target, BS, seed=3), ids, sample_id=sid, max_new_tokens=8,
                                             stop_token_ids=STOPS, teacher="token", store_features=True))
        assert rec.features.shape == ref.features.shape == (rec.input_ids.numel() - 1, 128)
        assert torch.allclose(rec.features, ref.features, atol=1e-4)


def test_standin_refuses_aux_capture_as_0_5_23_does(tiny_target_dir, tmp_path):
    """0.5.23 refuses --enable-return-aux-hidden-states unless --speculative-algorithm names EAGLE3, DFLASH or
    DSPARK, and with a draft path; the launcher's verify arguments pass (DFLASH, no draft path)."""
    import argparse

    from specforge_opd.testing.standin import check_flags

    def flags(**kw):
        base = dict(enable_return_aux_hidden_states=True, return_aux_hidden_state_layer_ids=[0, 2], speculative_algorithm=None,
                    speculative_draft_model_path=None)
        base.update(kw)
        return argparse.Namespace(**base)

    with pytest.raises(ValueError, match="needs --speculative-algorithm EAGLE3, DFLASH or DSPARK"):
        check_flags(flags())
    with pytest.raises(ValueError, match="drop --speculative-draft-model-path"):
        check_flags(flags(speculative_algorithm="DFLASH", speculative_draft_model_path="/d"))
    with pytest.raises(ValueError, match="must not repeat a layer"):
        check_flags(flags(speculative_algorithm="DFLASH", return_aux_hidden_state_layer_ids=[1, 1]))
    with pytest.raises(ValueError, match="must be non-negative"):
        check_flags(flags(speculative_algorithm="DFLASH", return_aux_hidden_state_layer_ids=[-1, 2]))
    with pytest.raises(ValueError, match="must not be empty"):
        check_flags(flags(speculative_algorithm="EAGLE3", return_aux_hidden_state_layer_ids=[]))
    assert check_flags(flags(speculative_algorithm="DFLASH")) is False  # reset to none: a verify server
    assert check_flags(flags(enable_return_aux_hidden_states=False, return_aux_hidden_state_layer_ids=None,
                             speculative_algorithm="DFLASH", speculative_draft_model_path="/d")) is True
    cfg = _cfg(python=sys.executable, launch_module="specforge_opd.testing.standin", startup_timeout_s=60.0)

    def without_algorithm(port):  # the arguments the launcher passed before
        a = server_args(cfg, model_path=str(tiny_target_dir), port=port, mode="verify", target_layer_ids=LAYERS)
        i = a.index("--speculative-algorithm")
        return a[:i] + a[i + 2 :]

    with pytest.raises(ServerError, match="exited with code 2"):
        with SGLangServer(cfg, without_algorithm, log_path=tmp_path / "s.log"):
            pass
    assert "needs --speculative-algorithm" in (tmp_path / "s.log").read_text()


def test_launcher_names_sglang_python_when_it_has_no_sglang(tmp_path):
    """The default sglang.python is usually this project's Python, which has no SGLang: a clear error at once."""
    cfg = _cfg(python=sys.executable)  # launch_module stays sglang.launch_server
    with pytest.raises(ServerError, match="sglang.python=.*cannot import 'sglang'"):
        SGLangServer(cfg, lambda port: [], log_path=tmp_path / "s.log").start()


def test_prefill_longer_than_a_chunk_is_named():
    """0.5.23 runs an extend longer than --chunked-prefill-size in chunks and keeps the hidden states of the last chunk
    only: the client names the flag to raise instead of a bare shape mismatch. Extends within the chunk size (the
    verify steps after a cached prefix) are unaffected."""
    target = make_tiny_target()
    backend = StandinBackend(target, aux_layer_ids=server_layer_ids(LAYERS), chunked_prefill_size=5)
    with ThreadedStandin(make_app(backend)) as srv:
        recs = _run_http(srv.url, OracleDrafter(target, BS, seed=1), prompts=PROMPTS[:2], teacher="token", max_new=6)
        assert all(r.features is not None for r in recs)
        with pytest.raises(ContractError, match=r"hidden_states\[0\]`: 1 rows < input 6 .*--chunked-prefill-size"):
            _run_http(srv.url, OracleDrafter(target, BS, seed=1), prompts=PROMPTS[2:], teacher="token", max_new=6)


def test_unsorted_layer_ids_get_the_servers_ascending_columns_back_in_our_order():
    """SGLang's models capture inside their layer loop, so the aux hidden states come back in ascending layer order
    whatever order --return-aux-hidden-state-layer-ids lists: a drafter with unsorted ids gets its own order back."""
    from specforge_opd.sglang.contract import feature_columns

    assert server_layer_ids([2, 0]) == [0, 2] and feature_columns([2, 0], 2).tolist() == [2, 3, 0, 1]
    target = make_tiny_target()
    layers = [2, 0]
    with ThreadedStandin(make_app(StandinBackend(target, aux_layer_ids=server_layer_ids(layers)))) as srv:
        recs = asyncio.run(verify_rollout_async(
            Endpoints([srv.url]), OracleDrafter(target, BS, seed=3), PROMPTS[:2], sglang_cfg=_cfg(), max_new_tokens=8,
            stop_token_ids=STOPS, teacher="token", teacher_topk=1, feature_dim=len(layers) * 64, layer_ids=layers,
        ))
    local = LocalTarget(target, layers, top_k=1)
    for rec, (sid, ids) in zip(recs, PROMPTS[:2]):
        ref = asyncio.run(speculate_sequence(local, OracleDrafter(target, BS, seed=3), ids, sample_id=sid, max_new_tokens=8,
                                             stop_token_ids=STOPS, teacher="token", store_features=True))
        assert torch.allclose(rec.features, ref.features, atol=1e-4)



def test_in_process_and_per_sequence_backends_give_the_same_records():
    """One step, two target backends: the same oracle drafter through ``InProcessTarget`` (three rows batched on one
    KV cache, with holes and compaction) and through ``LocalTarget`` (one sequence per request, a full forward each, as
    the stand-in serves HTTP) gives the same tokens, anchors, drafts and accepted counts, and features and teacher to
    1e-4; a stop token or the budget cuts blocks short the same way. A drift in either backend's bookkeeping fails here."""
    from specforge_opd.rollout.step import InProcessTarget, StepConfig, run_inline, speculate

    target = make_tiny_target()
    for max_new in (12, 7):
        cfg = StepConfig(block_size=BS, max_new_tokens=max_new, stop_token_ids=frozenset(STOPS), teacher="topk", teacher_topk=5)
        inproc = InProcessTarget(target, LAYERS, slack=max_new + 2 * BS, compact_min_slots=8, compact_below=0.9)
        with torch.no_grad():
            batched = run_inline(speculate(inproc, OracleDrafter(target, BS, seed=3), PROMPTS, cfg))
        per_seq = _run_local(target, OracleDrafter(target, BS, seed=3), max_new=max_new)
        assert inproc.compactions > 0
        accepted_seen = set()
        for e, l in zip(batched, per_seq):
            assert e.sample_id == l.sample_id and e.finished == l.finished
            assert torch.equal(e.input_ids, l.input_ids)
            assert torch.equal(e.anchors, l.anchors) and torch.equal(e.drafts, l.drafts) and torch.equal(e.accepted, l.accepted)
            assert e.anchors[-1] + e.accepted[-1] + 1 <= e.input_ids.numel()
            assert torch.allclose(e.features, l.features, atol=1e-4)
            assert torch.equal(e.teacher_topk_ids, l.teacher_topk_ids)
            assert torch.allclose(e.teacher_topk_logprobs, l.teacher_topk_logprobs, atol=1e-4)
            assert torch.allclose(e.teacher_draft_logprob, l.teacher_draft_logprob, atol=1e-4)
            accepted_seen.update(e.accepted.tolist())
        assert len(accepted_seen) >= 3, accepted_seen


def test_sampling_over_http_is_refused_with_the_setting_named():
    """Verify targets state ``greedy_only``: a T > 0 rollout over HTTP fails before any request, in one line."""
    from specforge_opd.rollout.step import StepConfig, speculate
    from specforge_opd.sglang.verify_client import HTTPTarget, check_verify_settings

    target = HTTPTarget(None, 0, top_k=5, feature_dim=128)
    assert target.caps.greedy_only and target.caps.teacher_forms == ("topk", "token")
    cfg = StepConfig(block_size=BS, max_new_tokens=4, stop_token_ids=frozenset(), temperature=0.7)
    msg = r"^rollout\.temperature=0\.7: SGLang verify mode is greedy only \(.*\); set rollout\.temperature=0 or use rollout\.backend=embedded$"
    with pytest.raises(ValueError, match=msg):
        asyncio.run(speculate(target, OracleDrafter(make_tiny_target(), BS), PROMPTS[:1], cfg))
    with pytest.raises(ValueError, match=msg):
        check_verify_settings(0.7, "topk", "rollout")
