"""Exact offline tau (issue 6): offline replay against the cached greedy trajectory gives the
same blocks, accepted counts and per-prompt tau as live speculative decoding.

Live reference: SpecForge's single-sequence ``DFlashDraftModel.spec_generate`` (through the
adapter's model class), instrumented with a forward hook on the target that records each
verify step's anchor (its first position id) and drafted tokens. ``spec_generate`` runs its
loop while the anchor is < prompt_len + max_new_tokens, i.e. one verify step more than SGLang
when the produced tokens equal max_new_tokens exactly; we count as SGLang (DESIGN.md, tau) and
drop that step from the reference.

Numerical ties (DESIGN.md): a divergence between live and cached tokens is allowed only where
the target's top-2 logit gap is < 1e-4, and the comparison of that prompt stops there.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from specforge_opd.config import load_config
from specforge_opd.eval.evaluate import (
    EvalError,
    TrajectoryCache,
    evaluate,
    offline_replay,
    offline_tau,
)
from specforge_opd.models.drafter import DrafterError, build_drafter, derive_draft_config, save_drafter
from specforge_opd.rollout.records import tau_of

from conftest import TINY_MASK, make_tiny_drafter, make_tiny_target

TIE_GAP = 1e-4


def spec_generate_reference(drafter, target, prompt: list[int], max_new_tokens: int, stop_token_ids: list[int]):
    """Run SpecForge's live loop; return (output ids, anchors, drafts) with SGLang's stopping rule."""
    calls = []

    def hook(mod, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append((int(kwargs["position_ids"][0, 0]), ids[0].tolist()))

    h = target.register_forward_hook(hook, with_kwargs=True)
    try:
        out = drafter.spec_generate(target, torch.tensor([prompt]), max_new_tokens, stop_token_ids, 0.0)[0].tolist()
    finally:
        h.remove()
    P = len(prompt)
    verify = calls[1:]  # calls[0] is the prefill
    anchors = [a for a, _ in verify if a - P + 1 < max_new_tokens]
    drafts = [blk[1:] for a, blk in verify if a - P + 1 < max_new_tokens]
    return out, anchors, drafts


def _compare(live_out, live_anchors, live_drafts, rec, traj):
    """Assert offline == live for one prompt, up to a numerical-tie divergence. Returns True if compared fully."""
    cached = traj.input_ids.tolist()
    div = next((i for i, (x, y) in enumerate(zip(live_out, cached)) if x != y), None)
    if div is None and len(live_out) != len(cached):
        div = min(len(live_out), len(cached))
    if div is not None:
        # live and cached greedy disagree at `div`: allowed only at a target near-tie
        assert float(traj.top2_gap[div - 1]) < TIE_GAP, f"divergence at {div} without a tie"
    anchors = rec.anchors.tolist()
    for m, (a_live, a_off) in enumerate(zip(live_anchors, anchors)):
        if div is not None and a_live + rec.block_size > div:
            return False
        assert a_live == a_off, f"block {m}: anchor {a_off} offline vs {a_live} live"
        r = int(rec.accepted[m])
        # every slot the offline replay computed (-1: not needed for the verdict) equals the live draft
        d = rec.drafts[m].tolist()
        assert all(x >= 0 for x in d[: r + 1][: len(d)][:r]) and d[0] >= 0
        assert [x for x in d if x >= 0] == [y for x, y in zip(d, live_drafts[m]) if x >= 0]
    assert len(anchors) == len(live_anchors)
    assert rec.completion_tokens == len(live_out) - rec.prompt_len
    return True


def _train_tiny_drafter(target, trajs, steps=250, seed=0):
    """A few hundred CE steps on the target's greedy blocks, so acceptance is not all zero."""
    torch.manual_seed(seed)
    d = make_tiny_drafter(target, block_size=4, layers=2)
    d.train()
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    bs = d.block_size
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tr = trajs[int(torch.randint(len(trajs), (1,), generator=g))]
        E, P = tr.input_ids.numel(), tr.prompt_len
        if E - bs <= P:
            continue
        a = int(torch.randint(P, E - bs + 1, (1,), generator=g))
        block = torch.full((1, bs), TINY_MASK)
        block[0, 0] = tr.input_ids[a]
        with torch.no_grad():
            noise = target.model.embed_tokens(block)
        h = d(target_hidden=tr.context(d.target_layer_ids)[:a].unsqueeze(0), noise_embedding=noise,
              position_ids=torch.arange(a + bs).unsqueeze(0), is_causal=False)
        logits = target.lm_head(h[0, 1:])
        loss = torch.nn.functional.cross_entropy(logits, tr.input_ids[a + 1 : a + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run 10-20x faster on one thread when other test runs share the 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_setup():
    target = make_tiny_target()
    for p in target.parameters():
        p.requires_grad_(False)
    # the mask token must be one the target never produces (DESIGN.md, mask token); a zero
    # lm_head row gives logit 0, below the max of 96 zero-mean logits
    target.lm_head.weight[TINY_MASK].zero_()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(6)]
    cache = TrajectoryCache(None, target, "tiny", max_new_tokens=40, stop_token_ids=[1])
    trajs = cache.get(prompts, [1])
    drafter = _train_tiny_drafter(target, trajs)
    return target, prompts, trajs, drafter


def test_offline_matches_live_on_tiny_model(tiny_setup):
    target, prompts, trajs, drafter = tiny_setup
    recs = offline_tau(drafter, target, trajs)
    full = 0
    for p, tr, rec in zip(prompts, trajs, recs):
        rec.validate()
        out, anchors, drafts = spec_generate_reference(drafter, target, p, 40, [1])
        if _compare(out, anchors, drafts, rec, tr):
            full += 1
            live_tau = (len(out) - len(p)) / len(anchors)
            assert tau_of([rec]) == pytest.approx(live_tau, abs=0)
    assert full == len(prompts)  # fp32 tiny model: no ties expected
    # the trained drafter accepts something, so blocks with r>0 were compared
    assert sum(int(r.accepted.sum()) for r in recs) > 0
    assert tau_of(recs) > 1.2


def test_offline_matches_rollout_engine_batched(tiny_setup):
    """Against the project's live engine (batched, left-padded): identical anchors, accepted counts
    and per-prompt tau, with a stop token that ends some sequences early."""
    from specforge_opd.config import RolloutConfig
    from specforge_opd.rollout.engine import SpeculativeEngine

    target, prompts, trajs, drafter = tiny_setup
    stop = int(trajs[0].input_ids[trajs[0].prompt_len + 9])  # a token the greedy runs produce
    for stops, N in (([1], 40), ([stop], 40), ([1], 5)):
        engine = SpeculativeEngine(target, drafter, RolloutConfig(max_new_tokens=N, teacher="full", store_features=False),
                                   stop_token_ids=stops, mask_token_id=TINY_MASK)
        live = engine.generate(prompts[:4]) + engine.generate(prompts[4:])
        off = offline_tau(drafter, target, TrajectoryCache(None, target, "tiny", max_new_tokens=N, stop_token_ids=stops).get(prompts, [1]))
        for lv, of in zip(live, off):
            assert lv.input_ids.tolist() == of.input_ids.tolist()
            assert lv.anchors.tolist() == of.anchors.tolist()
            assert lv.accepted.tolist() == of.accepted.tolist()
            assert lv.finished == of.finished
            assert tau_of([lv]) == tau_of([of])
        assert tau_of(live) == tau_of(off)
        assert sum(r.finished for r in off) >= (1 if stops == [stop] else 0)


def test_offline_matches_live_on_short_budget_and_stop_tokens(tiny_setup):
    """max_new_tokens smaller than the cached run and a stop token that occurs: same truncation as live."""
    target, prompts, _, drafter = tiny_setup
    for N in (1, 2, 7):
        cache = TrajectoryCache(None, target, "tiny", max_new_tokens=N, stop_token_ids=[1])
        trajs = cache.get(prompts[:3], [1])
        for p, tr in zip(prompts[:3], trajs):
            rec = offline_replay(drafter, target, tr)
            out, anchors, drafts = spec_generate_reference(drafter, target, p, N, [1])
            assert _compare(out, anchors, drafts, rec, tr)
            assert rec.completion_tokens <= N
    # a stop token: use a token the greedy run produces as a "stop" id
    tr0 = TrajectoryCache(None, target, "tiny", max_new_tokens=40, stop_token_ids=[1]).get(prompts[:1], [1])[0]
    stop = int(tr0.input_ids[tr0.prompt_len + 5])
    tr = TrajectoryCache(None, target, "tiny", max_new_tokens=40, stop_token_ids=[stop]).get(prompts[:1], [1])[0]
    assert tr.finished and int(tr.input_ids[-1]) == stop
    rec = offline_replay(drafter, target, tr)
    out, anchors, drafts = spec_generate_reference(drafter, target, prompts[0], 40, [stop])
    assert _compare(out, anchors, drafts, rec, tr)


def test_features_are_target_hidden_states_and_cache_roundtrip(tmp_path, tiny_setup):
    target, prompts, _, _ = tiny_setup
    cache = TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=12, stop_token_ids=[1])
    first = cache.get(prompts[:2], [1])
    calls = cache.target_calls
    tr = first[0]
    with torch.no_grad():
        hs = target(tr.input_ids[:-1].unsqueeze(0), output_hidden_states=True).hidden_states
    torch.testing.assert_close(tr.features[1], hs[2][0])  # layer 1 = hidden_states[2]
    # reload: nothing recomputed
    again = TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=12, stop_token_ids=[1])
    second = again.get(prompts[:2], [1])
    assert again.target_calls == 0
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.features[1], b.features[1]) for a, b in zip(first, second))
    # a drafter with other layer ids: one capture per prompt, the file then holds both layers
    third = again.get(prompts[:2], [0, 2])
    assert again.target_calls == 2 and set(third[0].features) == {0, 1, 2}
    fourth = TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=12, stop_token_ids=[1]).get(prompts[:2], [0, 1, 2])
    assert set(fourth[0].features) == {0, 1, 2}
    # another target identity or budget is another key
    assert cache.key(prompts[0]) != TrajectoryCache(tmp_path, target, "other", max_new_tokens=12, stop_token_ids=[1]).key(prompts[0])
    assert cache.key(prompts[0]) != TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=13, stop_token_ids=[1]).key(prompts[0])
    # a torn cache file is recomputed, not trusted
    for f in tmp_path.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:50])
    fifth = TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=12, stop_token_ids=[1])
    assert torch.equal(fifth.get(prompts[:1], [1])[0].input_ids, first[0].input_ids)


def test_offline_cost_is_drafter_only(tiny_setup):
    """No target forward during replay (only the embedding and lm_head weights are used)."""
    target, _, trajs, drafter = tiny_setup
    n = []
    h = target.register_forward_hook(lambda *a: n.append(1))
    try:
        offline_tau(drafter, target, trajs[:2])
    finally:
        h.remove()
    assert n == []


def _target_ns(target):
    return types.SimpleNamespace(model=target, identity="tiny", stop_token_ids=[1], tokenizer=None, path="tiny")


def test_evaluate_writes_json_md_and_plots(tmp_path, tiny_setup):
    target, prompts, trajs, trained = tiny_setup
    d_trained = save_drafter(trained, tmp_path / "trained", metadata={"flops": {"drafter_train": 1.5e12}})
    d_random = save_drafter(make_tiny_drafter(target, block_size=4), tmp_path / "random")
    cfg = load_config(None, ["eval.max_new_tokens=40", "eval.speedup=false", f"eval.cache_dir={tmp_path / 'cache'}"])
    sets = {"setA": (prompts[:4], [f"a{i}" for i in range(4)]), "setB": (prompts[4:], ["b0", "b1"])}
    res = evaluate(cfg, {"trained": d_trained, "random": d_random}, tmp_path / "out", target=_target_ns(target), prompt_sets=sets)
    out = tmp_path / "out"
    saved = json.loads((out / "eval.json").read_text())
    want = tau_of(offline_tau(trained, target, trajs[:4]))
    assert saved["drafters"]["trained"]["datasets"]["setA"]["tau"] == pytest.approx(want)
    assert saved["drafters"]["trained"]["flops"]["drafter_train"] == 1.5e12
    s = saved["drafters"]["random"]["datasets"]["setB"]
    assert s["completion_tokens"] == sum(t.input_ids.numel() - t.prompt_len for t in trajs[4:])
    assert sum(s["histogram"]) == s["verify_steps"]
    md = (out / "eval.md").read_text()
    assert "## setA" in md and "| trained |" in md and "| random |" in md
    for png in ("tau_per_dataset.png", "accept_hist.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["method"] == "offline_replay"


def test_evaluate_bad_input(tmp_path, tiny_setup):
    target, prompts, _, _ = tiny_setup
    cfg = load_config(None, ["eval.speedup=false", f"eval.cache_dir={tmp_path / 'cache'}"])
    # a drafter built for another target: refused before any decoding
    other = make_tiny_target(hidden=32)
    wrong = save_drafter(make_tiny_drafter(other), tmp_path / "wrong")
    calls = []
    h = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(DrafterError, match="hidden size"):
            evaluate(cfg, {"w": wrong}, tmp_path / "o", target=_target_ns(target), prompt_sets={"s": (prompts, ["x"] * len(prompts))})
    finally:
        h.remove()
    assert calls == []
    ok = save_drafter(make_tiny_drafter(target), tmp_path / "ok")
    with pytest.raises(EvalError, match="empty"):
        evaluate(cfg, {"ok": ok}, tmp_path / "o", target=_target_ns(target), prompt_sets={"s": ([], [])})
    with pytest.raises(EvalError, match="no drafter"):
        evaluate(cfg, {}, tmp_path / "o", target=_target_ns(target), prompt_sets={"s": (prompts, ["x"] * len(prompts))})
    # unknown dataset: the error lists the known ones; an empty selection is refused
    from specforge_opd.data.prompts import KNOWN_EVAL_SETS

    with pytest.raises(EvalError, match="known: " + ", ".join(KNOWN_EVAL_SETS[:2])):
        evaluate(load_config(None, ["eval.datasets=[mtbnch]"]), {"ok": ok}, tmp_path / "o", target=_target_ns(target))
    from specforge_opd.config import ConfigError

    with pytest.raises(ConfigError, match="eval.num_prompts"):  # the schema refuses zero prompts
        load_config(None, ["eval.datasets=[humaneval]", "eval.num_prompts=0"])
    # offline mode at T > 0 is refused (not exact)
    hot = load_config(None, ["eval.mode=offline", "eval.temperature=0.7", "eval.speedup=false"])

    with pytest.raises(ConfigError, match="temperature 0"):
        evaluate(hot, {"ok": ok}, tmp_path / "o", target=_target_ns(target), prompt_sets={"s": (prompts, ["x"] * len(prompts))})


@pytest.mark.embedded
def test_offline_matches_live_on_embedded_target(embedded_target_dir):
    """SmolLM2 target, a random 1-layer drafter (block 16), two short real prompts: offline replay
    gives the live engine's tokens, anchors, accepted counts and per-prompt tau. A divergence is
    allowed only where the target's top-2 logit gap is < 1e-4 (DESIGN.md), and that prompt's
    comparison stops there."""
    from specforge_opd.config import RolloutConfig, TargetConfig
    from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID
    from specforge_opd.data.chat import render_prompt
    from specforge_opd.data.prompts import eval_prompts
    from specforge_opd.models.target import load_target
    from specforge_opd.rollout.engine import SpeculativeEngine

    bundle = load_target(TargetConfig(path=str(embedded_target_dir), device="cpu"))
    dcfg = derive_draft_config(bundle.model.config, num_hidden_layers=1, block_size=16, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
    drafter = build_drafter(dcfg, seed=0).eval()
    prompts = []
    for rec in eval_prompts("mtbench", limit=2):
        text = render_prompt(bundle.tokenizer, rec.chat_messages(), thinking=False)
        prompts.append(bundle.tokenizer(text, add_special_tokens=False)["input_ids"])
    N = 16
    engine = SpeculativeEngine(bundle.model, drafter, RolloutConfig(max_new_tokens=N, teacher="full", store_features=False),
                               stop_token_ids=bundle.stop_token_ids, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
    live = [engine.generate([p])[0] for p in prompts]
    trajs = TrajectoryCache(None, bundle.model, bundle.identity, max_new_tokens=N, stop_token_ids=bundle.stop_token_ids).get(prompts, drafter.target_layer_ids)
    off = offline_tau(drafter, bundle.model, trajs)
    compared = 0
    for lv, of, tr in zip(live, off, trajs):
        a, b = lv.input_ids.tolist(), of.input_ids.tolist()
        div = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if div is not None:
            assert float(tr.top2_gap[div - 1]) < TIE_GAP, f"divergence at {div} without a numerical tie"
            continue
        assert a == b
        assert lv.anchors.tolist() == of.anchors.tolist()
        assert lv.accepted.tolist() == of.accepted.tolist()
        assert tau_of([lv]) == tau_of([of])
        compared += 1
    assert compared >= 1


def test_cli_bad_input_exits_cleanly(tmp_path, capsys):
    """Unknown dataset and a missing drafter: exit code 2 and one clear line, before loading the target."""
    from specforge_opd.cli import _parse_drafters, main

    assert main(["eval", "--drafter", str(tmp_path), "eval.datasets=[nope]", "--out", str(tmp_path / "o")]) == 2
    assert "unknown dataset(s) ['nope']; known: mtbench" in capsys.readouterr().err
    assert main(["eval", "eval.datasets=[mtbench]", "--out", str(tmp_path / "o")]) == 2
    assert "no drafter" in capsys.readouterr().err
    assert _parse_drafters(["a=/x/y", "/p/q"]) == {"a": __import__("pathlib").Path("/x/y"), "q": __import__("pathlib").Path("/p/q")}
    with pytest.raises(Exception, match="twice"):
        _parse_drafters(["/a/d", "/b/d"])


def test_evaluate_live_sampling_over_seeds_and_speedup(tmp_path, tiny_setup):
    """T > 0: live decoding per seed, mean and spread reported; speedup fields measured in the same run."""
    target, prompts, _, trained = tiny_setup
    d = save_drafter(trained, tmp_path / "trained")
    cfg = load_config(None, ["eval.temperature=0.8", "eval.seeds=[0,1,2]", "eval.max_new_tokens=12", "eval.batch_size=2",
                             "eval.speedup=true", "eval.speedup_num_prompts=2", f"eval.cache_dir={tmp_path / 'c'}"])
    res = evaluate(cfg, {"t": d}, tmp_path / "out", target=_target_ns(target), prompt_sets={"s": (prompts[:4], list("abcd"))})
    assert res["method"] == "live"
    s = res["drafters"]["t"]["datasets"]["s"]
    taus = [x["tau"] for x in s["seeds"]]
    assert [x["seed"] for x in s["seeds"]] == [0, 1, 2]
    assert s["tau"] == pytest.approx(sum(taus) / 3)
    assert s["tau_min"] == min(taus) and s["tau_max"] == max(taus) and s["tau_std"] >= 0
    sp = s["speedup"]
    assert sp["num_prompts"] == 2 and sp["ar_s_per_token"] > 0 and sp["spec_s_per_token"] > 0
    assert sp["speedup"] == pytest.approx(sp["ar_s_per_token"] / sp["spec_s_per_token"])
    assert "±" in (tmp_path / "out" / "eval.md").read_text()


def test_evaluate_has_a_prompt_lookup_row(tmp_path, tiny_setup):
    """Every offline table gets the ngram row, scored by the same pooled tau on the same trajectories."""
    from specforge_opd.eval.ngram import NGRAM_NAME, ngram_offline_tau

    target, prompts, trajs, trained = tiny_setup
    d = save_drafter(trained, tmp_path / "trained")
    cfg = load_config(None, ["eval.max_new_tokens=40", "eval.speedup=false", f"eval.cache_dir={tmp_path / 'cache'}"])
    sets = {"setA": (prompts[:4], [f"a{i}" for i in range(4)])}
    res = evaluate(cfg, {"trained": d}, tmp_path / "out", target=_target_ns(target), prompt_sets=sets)
    row = res["drafters"][NGRAM_NAME]
    assert row["block_size"] == trained.block_size
    assert row["datasets"]["setA"]["tau"] == pytest.approx(tau_of(ngram_offline_tau(trajs[:4], trained.block_size)))
    assert f"| {NGRAM_NAME} |" in (tmp_path / "out" / "eval.md").read_text()
    off = load_config(None, ["eval.max_new_tokens=40", "eval.speedup=false", "eval.ngram=false", f"eval.cache_dir={tmp_path / 'cache'}"])
    assert NGRAM_NAME not in evaluate(off, {"trained": d}, tmp_path / "out2", target=_target_ns(target), prompt_sets=sets)["drafters"]


def test_cache_entry_of_another_target_dtype_is_refused(tmp_path, tiny_setup):
    """The cache records the target's dtype; an entry of another dtype under the same key is an error, not data."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target, prompts, _, _ = tiny_setup
    cache = TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=8, stop_token_ids=[1])
    cache.get(prompts[:1], [1])
    (f,) = list(tmp_path.glob("*.safetensors"))
    with safe_open(str(f), framework="pt") as h:
        meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
    assert meta["target_dtype"] == "float32"
    save_file(tensors, str(f), metadata=dict(meta, target_dtype="bfloat16"))
    with pytest.raises(EvalError, match="bfloat16"):
        TrajectoryCache(tmp_path, target, "tiny", max_new_tokens=8, stop_token_ids=[1]).get(prompts[:1], [1])


def test_cli_refuses_to_replace_an_evaluation_of_other_drafters(tmp_path, capsys, monkeypatch):
    """A second ``eval`` into the same output.dir with other drafters stops before the target loads
    and leaves the first eval.json as it was; the same drafters, or --overwrite, go ahead."""
    from specforge_opd.cli import main
    import specforge_opd.eval.evaluate as ev

    out = tmp_path / "o"
    out.mkdir()
    first = {"drafters": {"sft": {"path": "runs/x/sft/final"}, "opd": {"path": "runs/x/opd/final"},
                          "prompt lookup (n<=3)": {"path": None}}}
    (out / "eval.json").write_text(json.dumps(first))
    ran = []
    monkeypatch.setattr(ev, "evaluate", lambda cfg, drafters, o: ran.append(dict(drafters)) or (o / "eval.md").write_text("t"))

    assert main(["eval", "--drafter", "runs/x/sft/final", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds eval.json with drafters this run would drop (sft=runs/x/sft/final, opd=runs/x/opd/final)" in err
    assert "--overwrite" in err and json.loads((out / "eval.json").read_text()) == first and not ran
    monkeypatch.chdir(tmp_path)  # the same directory spelled another way is the same drafter
    sft_abs = str(tmp_path / "runs/x/sft/final")
    assert main(["eval", "--drafter", f"sft={sft_abs}/", "--drafter", "opd=runs/x/opd/final", "--drafter", "x=runs/x/other",
                 "--out", str(out)]) == 0  # the recorded drafters kept, one added
    assert main(["eval", "--drafter", "runs/x/sft/final", "--out", str(out), "--overwrite"]) == 0
    assert [sorted(d) for d in ran] == [["opd", "sft", "x"], ["final"]]
    for broken in ('{"drafters": null}', '[1, 2]', 'not json'):  # unreadable records protect nothing
        (out / "eval.json").write_text(broken)
        assert main(["eval", "--drafter", "runs/x/sft/final", "--out", str(out)]) == 0


def test_a_missing_or_unknown_drafter_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    """``evaluate`` checks every drafter location first: neither a wrong path nor an unknown
    published name waits for the target to load."""
    import specforge_opd.models.target as target_mod
    from specforge_opd.eval.evaluate import evaluate
    from specforge_opd.models.drafter import DrafterError

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the drafters were checked")

    monkeypatch.setattr(target_mod, "load_target", no_target)
    cfg = load_config(None, ["eval.datasets=[mtbench]"])
    with pytest.raises(DrafterError, match=r"drafter opd: .*nope does not exist; give an exported drafter directory"):
        evaluate(cfg, {"opd": tmp_path / "nope"}, tmp_path / "o")
    with pytest.raises(DrafterError, match="no-such-drafter"):
        evaluate(cfg, {"x": "published:no-such-drafter"}, tmp_path / "o")
