"""The matched-FLOPs SFT baseline (compare.run_matched_sft) and published-drafter paths."""

from __future__ import annotations

import math

import pytest
import yaml

from specforge_opd.eval.flops import FlopsLedger, sft_flops
from specforge_opd.models.drafter import save_drafter
from specforge_opd.rollout.responses import ResponseRecord
from specforge_opd.stages import compare, sft

from conftest import make_tiny_drafter
from sft_helpers import make_target_dir


def _write_configs(tmp_path, start: str, target: str):
    sft_yaml = tmp_path / "sft.yaml"
    sft_yaml.write_text(yaml.safe_dump({
        "target": {"path": target, "max_context": 64},
        # the SFT recipe's own drafter is 1 layer, block 8: a baseline continues the 2-layer, block-4 start
        "draft": {"num_hidden_layers": 1, "block_size": 8, "mask_token_id": 96},
        "data": {"train_sources": ["sharegpt"], "num_prompts": 100, "slices": [0], "num_slices": 4},
        "sft": {"max_new_tokens": 8, "val_prompts": 16},
        "training": {"num_anchors": 4},
        "output": {"dir": str(tmp_path / "sft_run")},
    }))
    opd_yaml = tmp_path / "opd.yaml"
    opd_yaml.write_text(yaml.safe_dump({
        "target": {"path": target, "max_context": 64},
        "draft": {"path": start, "num_hidden_layers": 2, "block_size": 4, "mask_token_id": 96},
        "data": {"train_sources": ["sharegpt"], "num_prompts": 12, "slices": [1, 2], "num_slices": 4, "seed": 7},
        "rollout": {"max_new_tokens": 24},
        "output": {"dir": str(tmp_path / "opd_run")},
    }))
    return sft_yaml, opd_yaml


@pytest.mark.parametrize("baseline", ["opd_pool", "sft_data"])
def test_matched_baseline_starts_where_opd_started_and_spends_its_flops(tmp_path, monkeypatch, baseline):
    """(b) continues SFT from the OPD config's draft.path (not the SFT stage's export), on the OPD prompt pool
    by default, for ceil(OPD drafter FLOPs / FLOPs of one SFT step on the responses it trains on) steps."""
    bundle = make_target_dir(tmp_path / "target")
    start = save_drafter(make_tiny_drafter(bundle.model), tmp_path / "published_start",
                         metadata={"stage": "sft", "target": bundle.path})
    sft_yaml, opd_yaml = _write_configs(tmp_path, str(start), bundle.path)
    opd_flops = 3.3e9
    save_drafter(make_tiny_drafter(bundle.model, seed=2), tmp_path / "opd_run" / "final",
                 metadata={"opd_flops": FlopsLedger(drafter_train=3.0e9, teacher_lm_head=0.3e9).to_dict()})
    responses = [ResponseRecord(id=f"r{i}", prompt_ids=list(range(3, 13)), response_ids=list(range(20, 40)),
                                finished=True) for i in range(5)]
    seen = {}

    def fake_run_sft(cfg, *, budget_for=None, **kw):
        seen["cfg"] = cfg
        seen["steps"] = budget_for(responses)["max_steps"]
        return tmp_path / "matched" / "final"

    monkeypatch.setattr(sft, "run_sft", fake_run_sft)
    out = compare.run_matched_sft(str(sft_yaml), str(opd_yaml), out=tmp_path / "matched", baseline=baseline)
    assert out == tmp_path / "matched" / "final"
    cfg = seen["cfg"]
    assert cfg.sft.init_drafter == str(start) and cfg.sft.val_prompts == 0
    assert_start_shape(cfg, start)
    assert cfg.output.dir == str(tmp_path / "matched")
    if baseline == "opd_pool":
        assert cfg.data.slices == [1, 2] and cfg.data.num_prompts == 12 and cfg.data.seed == 7
        assert cfg.sft.max_new_tokens == 24 and cfg.sft.reuse_from is None
    else:
        assert cfg.data.slices == [0] and cfg.sft.reuse_from == str(tmp_path / "sft_run")
    from specforge_opd.models.drafter import load_draft_config

    per_step = sft_flops(cfg, load_draft_config(start), bundle.model.config, responses, steps=1,
                         captured_here=False).drafter_train
    assert seen["steps"] == math.ceil(opd_flops / per_step) and seen["steps"] > 1


def test_matched_baseline_refuses_unknown_baseline_and_missing_start(tmp_path):
    bundle = make_target_dir(tmp_path / "target")
    sft_yaml, opd_yaml = _write_configs(tmp_path, str(tmp_path / "x"), bundle.path)
    with pytest.raises(ValueError, match="baseline='loss'"):
        compare.run_matched_sft(str(sft_yaml), str(opd_yaml), baseline="loss")
    opd_yaml.write_text(opd_yaml.read_text().replace(f"path: {tmp_path / 'x'}", "path: null"))
    with pytest.raises(ValueError, match="draft.path is not set"):
        compare.run_matched_sft(str(sft_yaml), str(opd_yaml))


def test_published_paths_resolve_and_unknown_names_say_what_exists(tmp_path, monkeypatch):
    from specforge_opd.config import ConfigError, load_config
    from specforge_opd.models import published
    from specforge_opd.models.drafter import DrafterError, drafter_path

    bundle = make_target_dir(tmp_path / "target")
    monkeypatch.setattr(published, "PUBLISHED_DIR", tmp_path / "pub")
    save_drafter(make_tiny_drafter(bundle.model), tmp_path / "pub" / "tiny-b4", metadata={"stage": "sft"})
    cfg = load_config(None, ["draft.path=published:tiny-b4"])
    assert cfg.resolve_path(cfg.draft.path) == tmp_path / "pub" / "tiny-b4"
    assert drafter_path("published:tiny-b4") == tmp_path / "pub" / "tiny-b4"
    assert published.available() == ["tiny-b4"]
    with pytest.raises(ConfigError, match="no such published drafter; available: published:tiny-b4"):
        cfg.resolve_path("published:nope")
    with pytest.raises(DrafterError, match="no such published drafter"):
        drafter_path("published:nope")


def test_trained_positions_counts_anchors_per_sample():
    from specforge_opd.stages.publish import trained_positions

    # supervised 5 -> 4 anchors, 200 -> capped at 128; block 8; two whole epochs, then half of one
    assert trained_positions(4, [5, 200], 128, 8) == 2 * (4 + 128) * 8
    assert trained_positions(5, [5, 200], 128, 8) == 2 * (4 + 128) * 8 + round(132 * 8 / 2)


def test_bootstrap_intervals_are_paired_and_pooled():
    import numpy as np

    from specforge_opd.eval.stats import bootstrap_mean_tau, interval

    a = {"x": ([10, 30, 20], [10, 10, 10]), "y": ([8, 8], [4, 4])}  # pooled: x 2.0, y 2.0 -> mean 2.0
    b = {"x": ([11, 33, 22], [10, 10, 10]), "y": ([8.8, 8.8], [4, 4])}  # 1.1x a on every prompt
    reps = bootstrap_mean_tau({"a": a, "b": b}, replicates=500, seed=1)
    lo, hi = interval(reps["a"])
    assert lo < 2.0 < hi and lo > 1.0
    ratio = reps["b"] / reps["a"]
    np.testing.assert_allclose(ratio, 1.1)  # paired: the same prompts in each replicate, so the ratio is exact
    # pooled, not a mean of per-prompt taus: one long prompt weighs more
    one = bootstrap_mean_tau({"a": {"x": ([2, 90], [2, 10])}}, replicates=2000, seed=0)["a"]
    assert abs(np.median(one) - 92 / 12) < 2.5
    with pytest.raises(ValueError, match="different prompts"):
        bootstrap_mean_tau({"a": a, "b": {"x": ([1], [1]), "y": ([1, 1], [1, 1])}})


def test_publish_stores_bf16_exact_weights_in_bf16_and_they_load_unchanged(tmp_path):
    import torch
    from safetensors.torch import load_file

    from specforge_opd.models.drafter import load_drafter
    from specforge_opd.stages.publish import _store_bf16_if_exact

    from conftest import make_tiny_target

    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())
    d = save_drafter(drafter, tmp_path / "d")
    assert _store_bf16_if_exact(d / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(d / "model.safetensors")).values())
    back = load_drafter(d, target_config=target.config).state_dict()
    for k, v in drafter.state_dict().items():
        assert torch.equal(back[k], v), k
    # weights that bf16 would round stay fp32
    d2 = save_drafter(make_tiny_drafter(target, seed=3), tmp_path / "d2")
    assert not _store_bf16_if_exact(d2 / "model.safetensors")


def _fake_sft_run(tmp_path, monkeypatch, responses):
    """run_sft stand-in: records its config and budget, writes an export with a 3-point validation curve."""
    seen = {}

    def fake_run_sft(cfg, *, budget_for=None, val_prompts=None, prompts=None, **kw):
        seen.update(cfg=cfg, budget=budget_for(responses), val=val_prompts, prompts=prompts)
        final = tmp_path / "fair" / "final"
        steps = seen["budget"]["max_steps"]
        curve = [{"step": s, "tau": t, "export": str(tmp_path / "fair" / f"step_{s}"), "drafter_flops": float(s)}
                 for s, t in ((1, 1.1), (2, 1.3), (steps, 1.2))]
        final.mkdir(parents=True, exist_ok=True)
        (final / "specforge_opd.json").write_text(
            __import__("json").dumps({"validation": {"curve": curve, "selected_step": 2}}))
        return final

    monkeypatch.setattr(sft, "run_sft", fake_run_sft)
    return seen


@pytest.mark.parametrize("source", ["opd_pool", "fresh"])
def test_fair_baseline_continues_with_the_start_recipe(tmp_path, monkeypatch, source):
    """The fair baseline repeats the start's own recipe (a published drafter's training_record.json), trains on
    the OPD pool or fresh slices, validates on the OPD run's held-out prompts at as many points as OPD refreshed,
    and reports the drafter at the matched FLOPs and the best validation point."""
    import json

    from specforge_opd.stages import baselines

    bundle = make_target_dir(tmp_path / "target")
    start = save_drafter(make_tiny_drafter(bundle.model), tmp_path / "published_start",
                         metadata={"stage": "sft", "target": bundle.path})
    (start / "training_record.json").write_text(json.dumps({
        "training_dtype": "fp32",
        "config": yaml.safe_dump({"training": {"learning_rate": 1.0e-3, "lr_scheduler": "constant", "num_anchors": 6},
                                  "sft": {"specforge_overrides": {"training.loss_decay_gamma": 4.0}}})}))
    sft_yaml, opd_yaml = _write_configs(tmp_path, str(start), bundle.path)
    opd_yaml.write_text(opd_yaml.read_text() + "opd: {val_prompts: 5}\n")
    curve = [{"step": s, "tau": 1.0} for s in range(4)]  # the start and 3 refreshes
    save_drafter(make_tiny_drafter(bundle.model, seed=2), tmp_path / "opd_run" / "final",
                 metadata={"opd_run_flops": FlopsLedger(drafter_train=6.0e9).to_dict(),
                           "opd_flops": FlopsLedger(drafter_train=2.0e9).to_dict(), "validation": {"curve": curve}})
    responses = [ResponseRecord(id=f"r{i}", prompt_ids=list(range(3, 13)), response_ids=list(range(20, 40)),
                                finished=True) for i in range(5)]
    seen = _fake_sft_run(tmp_path, monkeypatch, responses)
    res = baselines.run_fair_sft(str(sft_yaml), str(opd_yaml), source=source, out=tmp_path / "fair")
    cfg = seen["cfg"]
    # the start's recipe, not the SFT config's (whose defaults are cosine, 3e-4-ish, 4 anchors)
    assert cfg.training.learning_rate == 1.0e-3 and cfg.training.lr_scheduler == "constant"
    assert cfg.training.num_anchors == 6 and cfg.training.mixed_precision == "fp32"
    assert cfg.sft.specforge_overrides == {"training.loss_decay_gamma": 4.0}
    assert cfg.sft.init_drafter == str(start) and cfg.sft.select == "best_val" and cfg.sft.plateau_patience == 0
    assert_start_shape(cfg, start)
    assert cfg.sft.max_new_tokens == 24
    if source == "opd_pool":
        assert cfg.data.slices == [1, 2] and cfg.data.num_prompts == 12
    else:  # SFT trains slice 0 and OPD slices 1-2: slice 3 is fresh
        assert cfg.data.slices == [3] and cfg.data.num_prompts == 12
    # the whole OPD run's FLOPs (opd_run_flops, not the selected refresh's), in 3 validation segments
    per_step = sft_flops(cfg, load_draft_config_of(start), bundle.model.config, responses, steps=1,
                         captured_here=False).drafter_train
    steps = math.ceil(6.0e9 / per_step)
    assert seen["budget"] == {"max_steps": steps, "val_interval": math.ceil(steps / 3)}
    # trained on the OPD run's own pool and validated on its held-out prompts (the 5 after its 12), both chosen
    # as the OPD stage chooses them: with the target's tokenizer dropping long prompts before the shuffle
    from transformers import AutoTokenizer

    from specforge_opd.config import load_config
    from specforge_opd.data.prompts import training_pool

    opd_cfg = load_config(str(opd_yaml))
    tok = AutoTokenizer.from_pretrained(bundle.path)
    data = opd_cfg.data if source == "opd_pool" else opd_cfg.data.model_copy(update={"slices": [3]})
    pool = training_pool(data.model_copy(update={"num_prompts": 17}), tokenizer=tok)
    val_pool = training_pool(opd_cfg.data.model_copy(update={"num_prompts": 17}), tokenizer=tok)
    assert [p.id for p in seen["val"]] == [p.id for p in val_pool[12:]]
    assert [p.id for p in seen["prompts"]] == [p.id for p in pool[:12]]
    # the SFT step keeps every prompt the OPD rollout took (its own limit counts the rendered prompt)
    assert cfg.data.max_prompt_tokens >= opd_cfg.target.max_context - opd_cfg.rollout.max_new_tokens
    assert cfg.sft.val_prompts == 5
    assert res["matched"] == tmp_path / "fair" / f"step_{steps}" and res["best_val"] == tmp_path / "fair" / "final"
    assert res["selected_step"] == 2 and res["recipe"]["source"].endswith("training_record.json")


def assert_start_shape(cfg, start):
    """The baseline's config describes the start drafter (2 layers, block 4), not its SFT YAML (1 layer, block 8)."""
    from specforge_opd.models.drafter import drafter_shape, load_draft_config

    shape = drafter_shape(load_draft_config(start))
    assert shape["num_hidden_layers"] == 2 and shape["block_size"] == 4
    assert {k: getattr(cfg.draft, k) for k in shape} == shape


def load_draft_config_of(path):
    from specforge_opd.models.drafter import load_draft_config

    return load_draft_config(path)


def test_start_recipe_sources_and_refusals(tmp_path, monkeypatch):
    """An SFT export records its recipe; a drafter without any record is refused with the fix named; a bf16 recipe
    trains fp32 on a CPU without native bf16, saying so; fresh slices must exist."""
    from specforge_opd import precision
    from specforge_opd.config import load_config
    from specforge_opd.stages import baselines

    bundle = make_target_dir(tmp_path / "target")
    rec = {"training": {"learning_rate": 2e-3, "num_anchors": 8}, "mixed_precision": "bf16", "specforge_overrides": {}}
    d = save_drafter(make_tiny_drafter(bundle.model), tmp_path / "sft_export", metadata={"recipe": rec})
    got = baselines.start_recipe(d)
    assert got["training"] == rec["training"] and got["mixed_precision"] == "bf16"
    bare = save_drafter(make_tiny_drafter(bundle.model), tmp_path / "bare", metadata={})
    with pytest.raises(baselines.BaselineError, match="no training recipe.*--recipe config"):
        baselines.start_recipe(bare)
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: (False, "AVX2 only"))
    ov, note = baselines.recipe_overrides(got, "cpu")
    assert "training.mixed_precision=fp32" in ov and "AVX2 only" in note
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: (True, "amx_bf16"))
    ov, note = baselines.recipe_overrides(got, "cpu")
    assert "training.mixed_precision=bf16" in ov and note is None
    cfg = load_config(None, ov)
    assert cfg.training.learning_rate == 2e-3 and cfg.training.num_anchors == 8
    a = load_config(None, ["data.num_slices=3", "data.slices=[0]"])
    b = load_config(None, ["data.num_slices=3", "data.slices=[1,2]"])
    with pytest.raises(baselines.BaselineError, match="every data slice"):
        baselines.fresh_slices(a, b)
    with pytest.raises(baselines.BaselineError, match="num_slices differs"):
        baselines.fresh_slices(a, load_config(None, ["data.num_slices=4", "data.slices=[1]"]))


def test_main_job_compares_against_the_fair_baseline(tmp_path, monkeypatch):
    """The main job's comparison (scripts/demo.sh) trains the fair baseline (the start's recipe) by default and
    reports its matched-FLOPs and best-validation drafters beside the start and OPD."""
    import json

    from specforge_opd.eval import evaluate as ev
    from specforge_opd.stages import baselines

    bundle = make_target_dir(tmp_path / "target")
    start = save_drafter(make_tiny_drafter(bundle.model), tmp_path / "start", metadata={"stage": "sft"})
    sft_yaml, opd_yaml = _write_configs(tmp_path, str(start), bundle.path)
    seen = {}

    def fake_fair(sft_config, opd_config, **kw):
        seen["fair"] = kw
        return {"matched": tmp_path / "m", "best_val": tmp_path / "b", "steps": 9, "selected_step": 3, "curve": [],
                "source": kw["source"], "recipe": {"source": "rec"}, "recipe_note": None}

    def fake_evaluate(cfg, drafters, out):
        seen["drafters"] = dict(drafters)
        Path(out).mkdir(parents=True, exist_ok=True)
        ds = {"mtbench": {"tau": 1.2, "num_prompts": 2}}
        return {"method": "offline", "eval": {"num_prompts": 2, "max_new_tokens": 8},
                "drafters": {n: {"datasets": ds, "block_size": 4} for n in drafters}}

    from pathlib import Path

    monkeypatch.setattr(baselines, "run_fair_sft", fake_fair)
    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    summary = tmp_path / "summary.json"
    assert compare.main(["--sft-config", str(sft_yaml), "--opd-config", str(opd_yaml), "--out", str(tmp_path / "cmp"),
                         "--summary", str(summary)]) == 0
    assert seen["fair"]["source"] == "opd_pool" and seen["fair"]["recipe"] == "start"
    assert list(seen["drafters"]) == ["SFT", "SFT + matched-FLOPs SFT", "SFT + best-val SFT", "SFT + OPD"]
    assert seen["drafters"]["SFT + matched-FLOPs SFT"] == tmp_path / "m"
    rec = json.loads(summary.read_text())["baseline_recipe"]
    assert rec["recipe"] == "start" and rec["steps"] == 9 and rec["selected_step"] == 3
    assert seen["fair"]["overrides"] == []
    # --baseline-lr opd: the baseline's peak rate is the OPD config's, after any override of the user's
    assert compare.main(["--sft-config", str(sft_yaml), "--opd-config", str(opd_yaml), "--out", str(tmp_path / "cmp"),
                         "--summary", str(summary), "--baseline-lr", "opd", "eval.num_prompts=2"]) == 0
    opd_lr = compare.load_config(opd_yaml).training.learning_rate
    assert seen["fair"]["overrides"] == ["eval.num_prompts=2", f"training.learning_rate={opd_lr}"]
    assert json.loads(summary.read_text())["baseline_recipe"]["learning_rate"] == "opd"


def test_fair_baseline_matches_a_recorded_opd_budget_without_its_run(tmp_path, monkeypatch):
    """With ``opd_flops`` (an OPD run recorded in a result, its directory gone) the baseline spends those FLOPs
    at ``val_points`` validation points and reads no OPD run; a non-positive budget is refused by name."""
    import json

    from specforge_opd.stages import baselines

    bundle = make_target_dir(tmp_path / "target")
    start = save_drafter(make_tiny_drafter(bundle.model), tmp_path / "published_start",
                         metadata={"stage": "sft", "target": bundle.path})
    (start / "training_record.json").write_text(json.dumps({
        "training_dtype": "fp32", "config": yaml.safe_dump({"training": {"learning_rate": 1.0e-3, "num_anchors": 6}})}))
    sft_yaml, opd_yaml = _write_configs(tmp_path, str(start), bundle.path)
    assert not (tmp_path / "opd_run").exists()
    responses = [ResponseRecord(id=f"r{i}", prompt_ids=list(range(3, 13)), response_ids=list(range(20, 40)),
                                finished=True) for i in range(5)]
    seen = _fake_sft_run(tmp_path, monkeypatch, responses)
    baselines.run_fair_sft(str(sft_yaml), str(opd_yaml), source="opd_pool", out=tmp_path / "fair", opd_flops=6.0e9,
                           val_points=3)
    per_step = sft_flops(seen["cfg"], load_draft_config_of(start), bundle.model.config, responses, steps=1,
                         captured_here=False).drafter_train
    steps = math.ceil(6.0e9 / per_step)
    assert seen["budget"] == {"max_steps": steps, "val_interval": math.ceil(steps / 3)}
    with pytest.raises(baselines.BaselineError, match="opd_flops"):
        baselines.run_fair_sft(str(sft_yaml), str(opd_yaml), source="opd_pool", out=tmp_path / "fair", opd_flops=0.0)


def test_opd_at_scale_budget_of_a_recorded_run():
    """--match-from: the OPD run's own FLOPs are its last refresh's cumulative FLOPs less the start's (the
    best-validation row's where the best is the last); a table without the row names what to do."""
    bench = _bench_opd_at_scale()
    table = _scale_table(1, 1.3, 1.2)
    table["rows"][0]["drafter_flops"] = 1.0e15
    table["rows"][1].update(drafter="OPD naive best-val p192 s1", drafter_flops=1.3e15)
    assert bench.recorded_budget(table, "OPD naive", 192, 1, 43) == (pytest.approx(0.3e15), 43)
    table["rows"].append(dict(table["rows"][1], drafter="OPD naive last p192 s1", drafter_flops=1.5e15))
    assert bench.recorded_budget(table, "OPD naive", 192, 1, 43)[0] == pytest.approx(0.5e15)
    with pytest.raises(SystemExit, match="drop --match-from"):
        bench.recorded_budget(table, "OPD eq1_full", 192, 1, 43)


def test_opd_at_scale_compares_new_baselines_with_recorded_opd_rows_paired():
    """Rows keep their per-prompt counts; a later session that trains only a pair's baselines adds the committed
    OPD rows of that pair (weights gone) to its replay, and the ratio over the best baseline is paired on the
    same prompts; merge keeps the pair's OPD rows. Other trajectories (the start's counts differ) add nothing."""
    import types

    bench = _bench_opd_at_scale()

    def entry(tokens, steps):
        return {"path": "-", "datasets": {"a": {"tau": sum(tokens) / sum(steps), "num_prompts": len(tokens),
                                                "tokens_per_prompt": tokens, "steps_per_prompt": steps}}}

    def drafter(kind, name):
        return {"kind": kind, "select": "-", "pool": None if kind == "start" else 192,
                "seed": None if kind == "start" else 0, "path": f"runs/{name}"}

    args = types.SimpleNamespace(replicates=200)
    first = {"target": {}, "eval": {"max_new_tokens": 8}, "method": "replay",
             "drafters": {"start": entry([10, 20, 30], [10, 10, 10]), "OPD naive best-val p192 s0": entry([12, 26, 33], [10, 10, 10])}}
    committed = bench.summarize(first, {"start": drafter("start", "s"), "OPD naive best-val p192 s0": drafter("opd", "o")}, args)
    assert committed["rows"][1]["counts"] == {"a": [[12, 26, 33], [10, 10, 10]]}
    assert "over_best_baseline" not in committed["ratios"][0]
    later = {"target": {}, "eval": {"max_new_tokens": 8}, "method": "replay",
             "drafters": {"start": entry([10, 20, 30], [10, 10, 10]), "SFT fair fresh matched p192 s0": entry([11, 21, 30], [10, 10, 10])}}
    drafters = {"start": drafter("start", "s"), "SFT fair fresh matched p192 s0": drafter("sft", "b")}
    assert bench.add_recorded(committed, drafters, later) == ["OPD naive best-val p192 s0"]
    table = bench.merge(committed, bench.summarize(later, drafters, args))
    assert [r["drafter"] for r in table["rows"]] == ["start", "SFT fair fresh matched p192 s0", "OPD naive best-val p192 s0"]
    (ratio,) = table["ratios"]
    assert ratio["over_best_baseline"]["against"] == "SFT fair fresh matched p192 s0"
    assert ratio["over_best_baseline"]["ratio"] == pytest.approx((71 / 30) / (62 / 30))
    lo, hi = ratio["over_best_baseline"]["ci95"]
    assert 1.0 < lo <= hi  # paired: every prompt gains, so every resample does
    other = {**later, "drafters": {**later["drafters"], "start": entry([10, 20, 31], [10, 10, 10])}}
    assert bench.add_recorded(committed, {"start": drafter("start", "s")}, other) == []


@pytest.mark.parametrize("name", ["opd_at_scale", "opd_at_scale_l3", "opd_at_scale_b8", "opd_at_scale_v2", "opd_at_scale_v3"])
def test_readme_opd_at_scale_table_is_the_committed_result(name):
    """Each README OPD-at-scale table is bench_opd_at_scale.py --render of its benchmarks/results/<name>.json."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_opd_at_scale", root / "benchmarks" / "bench_opd_at_scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    readme = (root / "README.md").read_text()
    block = readme.split(f"<!-- {name}:begin -->")[1].split(f"<!-- {name}:end -->")[0].strip()
    assert block == bench.render(json.loads((root / "benchmarks" / "results" / f"{name}.json").read_text())).strip()


def _bench_opd_at_scale():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_opd_at_scale", root / "benchmarks" / "bench_opd_at_scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _scale_table(seed: int, opd: float, sft: float, start: float = 1.2) -> dict:
    def row(name, kind, tau):
        return {"drafter": name, "kind": kind, "select": "-", "pool": None if kind == "start" else 192,
                "seed": None if kind == "start" else seed, "tau": {"a": tau}, "mean_tau": tau, "ci95": [tau, tau],
                "drafter_flops": None, "val_tau": None, "pool_tau": None, "path": "-"}

    rows = [row("start", "start", start), row(f"OPD naive best-val s{seed}", "opd", opd),
            row(f"SFT fair fresh matched s{seed}", "sft", sft)]
    ratios = [{"drafter": f"OPD naive best-val s{seed}",
               "over_start": {"against": "start", "ratio": opd / start, "ci95": [0, 9]},
               "over_best_baseline": {"against": f"SFT fair fresh matched s{seed}", "ratio": opd / sft, "ci95": [0, 9]}}]
    return {"machine": {"cpu_model": f"m{seed}"}, "prompts": {"a": 3}, "datasets": ["a"], "rows": rows, "ratios": ratios,
            "replicates": 10, "eval": {"method": "replay", "max_new_tokens": 96}}


def test_opd_at_scale_merges_seeds_and_reports_the_lowest_ratio():
    """A later session's seed joins the committed table: the earlier seed's rows stay, a rerun seed replaces its
    own, and the across-seed table names each seed's ratio and the lowest; other trajectories are refused."""
    bench = _bench_opd_at_scale()
    s0, s1 = _scale_table(0, 1.32, 1.30), _scale_table(1, 1.26, 1.25)
    merged = bench.merge(s0, s1)  # tables named rows by seed only before: the pool joins the names
    assert [r["drafter"] for r in merged["rows"]] == ["start", "OPD naive best-val p192 s1", "SFT fair fresh matched p192 s1",
                                                       "OPD naive best-val p192 s0", "SFT fair fresh matched p192 s0"]
    assert merged["ratios"][1]["over_best_baseline"]["against"] == "SFT fair fresh matched p192 s0"
    assert merged["merged_from"] == ["p192 s0"]
    again = bench.merge(merged, _scale_table(1, 1.27, 1.25))  # seed 1 rerun: replaced, not duplicated
    assert sum(r["seed"] == 1 for r in again["rows"]) == 2
    (g,) = bench.across_seeds(merged)
    assert g["seeds"] == [0, 1] and abs(g["min_over_start"] - 1.26 / 1.2) < 1e-12
    assert g["over_start"] == [1.32 / 1.2, 1.26 / 1.2]
    assert abs(g["min_over_best_baseline"] - 1.26 / 1.25) < 1e-12
    assert "(**1.008**)" in bench.render(merged)
    with pytest.raises(ValueError, match="start drafter's mean tau differs"):
        bench.merge(s0, _scale_table(1, 1.3, 1.2, start=1.1))
    other_pool = _scale_table(0, 1.3, 1.2)  # same seed, another pool: kept beside, not replaced
    for r in other_pool["rows"][1:]:
        r["pool"] = 384
    both = bench.merge(merged, other_pool)
    assert {r["drafter"] for r in both["rows"]} >= {"OPD naive best-val p384 s0", "OPD naive best-val p192 s0"}
    assert [g["pool"] for g in bench.across_seeds(both)] == [192, 384]
    assert bench.across_seeds(both)[0]["drafter"] == "OPD naive best-val"


def test_opd_at_scale_start_keeps_the_validation_tau_of_each_pool():
    """Each (pool, seed) has its own validation prompts: a merge keeps the start's tau on every run's sets, and
    the table shows the start once per run, so no row is compared against another run's validation prompts."""
    bench = _bench_opd_at_scale()
    old, new = _scale_table(0, 1.3, 1.2), _scale_table(0, 1.3, 1.2)
    for r in new["rows"][1:]:
        r["pool"] = 1024
    old["rows"][0]["sets"] = {"p192 s0": {"val_tau": 1.527, "pool_tau": 1.634}}
    new["rows"][0]["sets"] = {"p1024 s0": {"val_tau": 1.535, "pool_tau": 1.634}}
    merged = bench.merge(old, new)
    assert merged["rows"][0]["sets"] == {"p192 s0": {"val_tau": 1.527, "pool_tau": 1.634},
                                         "p1024 s0": {"val_tau": 1.535, "pool_tau": 1.634}}
    lines = [x for x in bench.render(merged).splitlines() if x.startswith("| start")]
    assert [x.split(" | ")[0] for x in lines] == ["| start (val, pool: p192 s0)", "| start (val, pool: p1024 s0)"]
    assert "| 1.527 | 1.634 |" in lines[0] and "| 1.535 | 1.634 |" in lines[1]


def test_opd_at_scale_scale_curve_fits_gain_against_log_pool(tmp_path):
    """The scale curve averages each pool's seeds, fits the gain linearly in log10(pool), extrapolates to 10x the
    largest pool, and is rendered and plotted only for drafters measured at two pools or more."""
    bench = _bench_opd_at_scale()
    small = _scale_table(0, 1.2 * 1.01, 1.2)  # pool 48: gain 1%
    for r in small["rows"][1:]:
        r["pool"] = 48
    table = bench.merge(bench.merge(small, _scale_table(0, 1.2 * 1.03, 1.2)), _scale_table(1, 1.2 * 1.05, 1.2))
    (c,) = bench.scale_curve(table)
    assert c["drafter"] == "OPD naive best-val" and [q["pool"] for q in c["points"]] == [48, 192]
    assert abs(c["points"][1]["ratio"] - 1.04) < 1e-12 and abs(c["points"][1]["lowest"] - 1.03) < 1e-12
    slope = 0.03 / math.log10(4)  # two points: the line through them
    assert abs(c["slope_per_decade"] - slope) < 1e-12
    assert c["predicted_10x"]["pool"] == 1920 and abs(c["predicted_10x"]["ratio"] - (1.04 + slope)) < 1e-12
    assert "| OPD naive best-val | 1.010 (1 seed) | 1.040 (2 seeds) |" in bench.render(table)
    assert bench.plot_scale_curve(table, tmp_path / "curve.png").stat().st_size > 0
    one_pool = _scale_table(0, 1.3, 1.2)
    assert bench.scale_curve(one_pool) == [] and bench.plot_scale_curve(one_pool, tmp_path / "none.png") is None
    assert "against pool size" not in bench.render(one_pool) and not (tmp_path / "none.png").exists()


def test_opd_at_scale_replays_each_drafter_once(tmp_path, monkeypatch):
    """The eval phase reads a drafter's stored replay back when its weights and the eval settings are unchanged,
    and replays it again when either changes."""
    import json
    import types

    bench = _bench_opd_at_scale()
    drafters = {}
    for name in ("start", "OPD naive best-val p192 s0"):
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        (d / "model.safetensors").write_bytes(name.encode())
        (d / "config.json").write_text("{}")
        drafters[name] = {"path": str(d)}
    calls = []

    def fake_sh(argv, log):
        names = [a.split("=", 1)[0] for a in argv[argv.index("--drafter"):] if a != "--drafter"]
        calls.append(names)
        out = tmp_path / "out" / "eval"
        out.mkdir(parents=True, exist_ok=True)
        entries = {n: {"path": drafters[n]["path"], "datasets": {"mtbench": {"tau": float(len(calls))}}} for n in names}
        entries["prompt lookup (ngram)"] = {"path": None, "datasets": {"mtbench": {"tau": 1.6}}}
        (out / "eval.json").write_text(json.dumps({"target": {"identity": "t"}, "eval": {"max_new_tokens": 96},
                                                   "method": "offline_replay", "drafters": entries}))

    monkeypatch.setattr(bench, "sh", fake_sh)
    args = types.SimpleNamespace(eval_prompts=None, opd_config="configs/small/opd.yaml")
    first = bench.evaluate_all(args, drafters, tmp_path / "out")
    assert calls == [list(drafters)]
    again = bench.evaluate_all(args, drafters, tmp_path / "out")
    assert len(calls) == 1 and again == first  # nothing replayed, the same result
    (tmp_path / "start" / "model.safetensors").write_bytes(b"other weights")
    third = bench.evaluate_all(args, drafters, tmp_path / "out")
    assert calls[-1] == ["start"] and third["drafters"]["start"]["datasets"]["mtbench"]["tau"] == 2.0
    assert third["drafters"]["OPD naive best-val p192 s0"] == first["drafters"]["OPD naive best-val p192 s0"]
    args.eval_prompts = 8  # other settings: every drafter is replayed again
    bench.evaluate_all(args, drafters, tmp_path / "out")
    assert sorted(calls[-1]) == sorted(drafters)


def test_opd_at_scale_stores_set_replays(tmp_path):
    """Validation and pool tau of a drafter already replayed are read back, not replayed."""
    bench = _bench_opd_at_scale()
    calls = []
    replay = lambda: calls.append(1) or 1.375  # noqa: E731
    assert bench.stored_tau(tmp_path / "set-k.json", "d", replay) == 1.375
    assert bench.stored_tau(tmp_path / "set-k.json", "d", replay) == 1.375
    assert len(calls) == 1
    assert bench.stored_tau(tmp_path / "set-other.json", "d", replay) == 1.375 and len(calls) == 2


def test_opd_at_scale_recorded_opd_rows_without_counts_get_an_unpaired_baseline_ratio():
    """An OPD row recorded without per-prompt counts cannot be paired with baselines trained later: merge gives it
    an unpaired ratio over the best fair baseline of its pool and seed, from the two rows' intervals, marked as
    such; a paired ratio already there is kept."""
    import math

    bench = _bench_opd_at_scale()
    old = _scale_table(0, 1.32, 1.30)
    del old["ratios"][0]["over_best_baseline"]
    old["rows"] = old["rows"][:2]  # the OPD run alone: its baselines were not trained yet
    old["rows"][1]["ci95"] = [1.30, 1.34]
    new = _scale_table(0, 1.0, 1.28)
    new["rows"] = [new["rows"][0], new["rows"][2]]
    new["rows"][1]["ci95"] = [1.26, 1.30]
    new["ratios"] = []
    table = bench.merge(old, new)
    (e,) = table["ratios"]
    got = e["over_best_baseline"]
    assert got["against"] == "SFT fair fresh matched p192 s0" and got["paired"] is False
    assert got["ratio"] == pytest.approx(1.32 / 1.28)
    se = math.hypot(math.log(1.34 / 1.30), math.log(1.30 / 1.26)) / 3.92
    assert got["ci95"] == pytest.approx([1.32 / 1.28 * math.exp(-1.96 * se), 1.32 / 1.28 * math.exp(1.96 * se)])
    assert ", unpaired" in bench.render(table) and "wider than a paired one" in bench.render(table)
    better = _scale_table(0, 1.0, 1.31)  # a later session's better baseline of the same pool and seed
    better["rows"] = [better["rows"][0], dict(better["rows"][2], drafter="SFT fair opd_pool best-val p192 s0")]
    better["ratios"] = []
    again = bench.merge(table, better)["ratios"][0]["over_best_baseline"]
    assert again["against"] == "SFT fair opd_pool best-val p192 s0" and again["ratio"] == pytest.approx(1.32 / 1.31)
    assert bench.merge(table, new)["ratios"] == table["ratios"]  # merging again changes nothing
    seed1 = bench.merge(table, _scale_table(1, 1.26, 1.25))  # seed 1 paired, seed 0 unpaired
    (g,) = bench.across_seeds(seed1)
    assert g["unpaired"] == [0]
    assert f"{1.32 / 1.28:.3f} unpaired, {1.26 / 1.25:.3f} (**" in bench.render(seed1)
    stale = bench.merge(_scale_table(0, 1.32, 1.30), _scale_table(1, 1.26, 1.25))  # a paired ratio of rows without
    stale["rows"] = [dict(r, mean_tau=1.29, ci95=[1.27, 1.31]) if r["drafter"] == "SFT fair fresh matched p192 s0" else r
                     for r in stale["rows"]]  # counts whose baseline changed since: unpaired against the row now
    e0 = next(e for e in bench.unpaired_baseline_ratios(stale)["ratios"] if e["drafter"].endswith("s0"))
    assert e0["over_best_baseline"]["paired"] is False and e0["over_best_baseline"]["ratio"] == pytest.approx(1.32 / 1.29)
    paired = bench.merge(_scale_table(0, 1.32, 1.30), _scale_table(1, 1.26, 1.25))
    assert all(e["over_best_baseline"].get("paired") is None for e in paired["ratios"])
    assert "unpaired" not in bench.render(paired)


def test_opd_at_scale_baselines_with_a_changed_recipe_get_their_own_rows_and_dirs(tmp_path, monkeypatch):
    """--baseline-overrides reach run_fair_sft after the seed's overrides (they change the start's recipe), and
    --baseline-tag names the rows and run directories, so they never mix with the start-recipe baselines."""
    import argparse

    import specforge_opd.stages.baselines as baselines_mod

    bench = _bench_opd_at_scale()
    calls = []

    def fake_run_fair_sft(sft_config, opd_config, *, source, out, opd_out, overrides, **budget):
        calls.append((source, out, overrides))
        return {"matched": out / "m", "best_val": out / "final", "steps": 10, "selected_step": 5, "source": source,
                "curve": [{"step": 5, "drafter_flops": 1.0}, {"step": 10, "drafter_flops": 2.0}]}

    monkeypatch.setattr(baselines_mod, "run_fair_sft", fake_run_fair_sft)
    args = argparse.Namespace(baselines=["fresh"], out=str(tmp_path), phase="train", sft_config="s.yaml",
                              opd_config="o.yaml", baseline_overrides=["training.learning_rate=1e-4"],
                              baseline_tag="lr1e-4")
    rows = bench.baselines(args, tmp_path / "opd", 192, 0, ["training.seed=0"])
    assert calls == [("fresh", tmp_path / "p192" / "sft-fresh-lr1e-4-s0", ["training.seed=0", "training.learning_rate=1e-4"])]
    assert set(rows) == {"SFT fair fresh lr1e-4 matched p192 s0", "SFT fair fresh lr1e-4 best-val p192 s0"}
    untagged = argparse.Namespace(**{**vars(args), "baseline_overrides": [], "baseline_tag": None})
    calls.clear()
    assert set(bench.baselines(untagged, tmp_path / "opd", 192, 0, [])) == {"SFT fair fresh matched p192 s0",
                                                                           "SFT fair fresh best-val p192 s0"}
    assert calls[0][1] == tmp_path / "p192" / "sft-fresh-s0"


def test_help_names_the_render_form(capsys):
    """``--render`` is parsed before argparse; ``--help`` still tells a user it exists."""
    from specforge_opd.stages.compare import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--render SUMMARY.json" in capsys.readouterr().out
