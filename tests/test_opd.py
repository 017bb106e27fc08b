"""The iterated OPD stage on a tiny random target: plan, loop, kill-and-resume (issue 9)."""

import json
import re

import pytest
import torch

from specforge_opd.config import load_config
from specforge_opd.models.drafter import load_drafter, save_drafter
from specforge_opd.models.target import TargetBundle

from conftest import make_tiny_drafter, make_tiny_target
from fault_hooks import FaultHooks, InjectedFault


def _setup(tmp_path, name):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    init = save_drafter(drafter, tmp_path / "init")
    bundle = TargetBundle(model=target, tokenizer=None, path=tmp_path, identity="tiny", stop_token_ids=[1])
    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(3, 90, (5 + i % 3,), generator=g).tolist()) for i in range(8)]
    cfg = load_config(None, [
        f"output.dir={tmp_path / name}", f"draft.path={init}", "draft.block_size=4", "draft.num_hidden_layers=2",
        "rollout.batch_size=2", "rollout.max_new_tokens=10", "rollout.teacher=full",
        "opd.prompts_per_step=2", "opd.prompts_per_iteration=4", "training.num_epochs=1",
        "training.checkpoint_interval=1", "output.tensorboard=false", "target.max_context=64",
    ])
    return cfg, bundle, prompts


def _params(d):
    return {k: v.clone() for k, v in load_drafter(d).state_dict().items()}


def test_opd_loop_and_resume(tmp_path, capsys):
    from specforge_opd.stages.opd import run_opd

    cfg, bundle, prompts = _setup(tmp_path, "clean")
    final = run_opd(cfg, target=bundle, prompts=prompts)
    out = tmp_path / "clean"
    err = capsys.readouterr().err
    # a fresh run says it starts (not "resuming"), and its losses print short
    assert "starting at iteration 0" in err and "resuming" not in err
    losses = re.findall(r"\bloss=(\S+) L_acc=(\S+) L_rej=(\S+)", err)
    assert len(losses) == 2 and all(x == f"{float(x):.4g}" for row in losses for x in row)
    rows = [json.loads(l) for l in (out / "opd_metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(r["train_steps"] == 2 for r in rows)  # 4 prompts per iteration / 2 per step
    assert rows[0]["rollout_sequences"] == 4 and rows[0]["rollout_tau"] >= 1.0
    assert (out / "report.md").is_file() and (out / "tau_per_iteration.png").is_file()
    assert not (out / "spool" / "iter_000").exists()  # consumed shards deleted
    meta = json.loads((final / "specforge_opd.json").read_text())
    assert meta["opd_flops"]["drafter_train"] > 0 and meta["opd_flops"]["target_rollout"] > 0
    # the initial drafter has no recorded FLOPs here, so the cumulative ledger equals the stage's
    assert meta["flops"]["drafter_budget"] == pytest.approx(meta["opd_flops"]["drafter_budget"])
    assert meta["step"] == 4  # 2 iterations x 2 optimizer steps
    reference = _params(final)
    # one cosine schedule over the whole stage: iteration 1 continues where iteration 0 stopped
    lrs = [json.loads(l)["lr"] for it in (0, 1) for l in (out / f"iter_{it:03d}" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == pytest.approx(0.0, abs=1e-12) and lrs[0] == pytest.approx(3e-4)

    # killed in the rollout phase (after one batch), then in the training phase (after one step)
    cfg2, bundle2, _ = _setup(tmp_path, "killed")
    with pytest.raises(InjectedFault):
        run_opd(cfg2, target=bundle2, prompts=prompts, hooks=FaultHooks(after_shards=1))
    assert (tmp_path / "killed" / "spool" / "iter_000" / "manifest.json").is_file()
    with pytest.raises(InjectedFault):
        run_opd(cfg2, target=bundle2, prompts=prompts, hooks=FaultHooks(after_steps=1))
    capsys.readouterr()
    final2 = run_opd(cfg2, target=bundle2, prompts=prompts)
    assert "resuming at iteration" in capsys.readouterr().err
    resumed = _params(final2)
    for k in reference:
        assert torch.allclose(reference[k], resumed[k], atol=1e-6), k
    rows2 = [json.loads(l) for l in (tmp_path / "killed" / "opd_metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows2] == [0, 1]
    assert rows2[0]["rollout_tau"] == pytest.approx(rows[0]["rollout_tau"])
    # the steps of the killed invocation count too
    assert all(r["train_steps"] == 2 for r in rows2)
    # the final drafter's tau is measured on iteration 1's prompts and reported beside the start
    final_ro = json.loads((tmp_path / "killed" / "opd_state.json").read_text())["final_rollout"]
    assert final_ro["sequences"] == 4 and final_ro["tau"] >= 1.0
    assert f"Final drafter: rollout tau {final_ro['tau']:.3f}" in (tmp_path / "killed" / "report.md").read_text()
    # a finished run started again trains nothing more
    again = run_opd(cfg2, target=bundle2, prompts=prompts)
    for k, v in _params(again).items():
        assert torch.equal(v, resumed[k])
    # the same output.dir with another initial drafter is refused, not taken as finished
    from specforge_opd.stages.plan import PlanError

    other = save_drafter(make_tiny_drafter(bundle2.model, seed=5), tmp_path / "init_other")
    cfg3 = cfg2.model_copy(update={"draft": cfg2.draft.model_copy(update={"path": str(other)})})
    with pytest.raises(PlanError, match="started from .*init, but draft.path is .*init_other"):
        run_opd(cfg3, target=bundle2, prompts=prompts)


def test_iteration_rollout_samples_with_the_seed_its_shards_record(tmp_path):
    """Iteration ``it``'s embedded engine samples with ``rollout.seed + it``: the seed its shard meta records and
    the SGLang backends are sent. It used to sample every iteration with ``rollout.seed``."""
    from specforge_opd.stages.opd import _rollout_engine

    cfg, bundle, _ = _setup(tmp_path, "seed")
    cfg.rollout.seed = 7
    for it in (0, 1, 3):
        engine, meta, step = _rollout_engine(cfg, bundle, cfg.draft.path, it)
        assert (engine.rcfg.seed, meta.seed, step) == (7 + it, 7 + it, 0)
    assert cfg.rollout.seed == 7  # the run's config is left as it was


def test_opd_loop_over_sglang_verify_standin(tmp_path):
    """rollout.backend=sglang_verify: the OPD loop rolls out through an SGLang(-shaped) server and measures
    the same on-policy tau per iteration as the embedded backend; native mode refuses fixed URLs."""
    from specforge_opd.models.drafter import drafter_layer_ids
    from specforge_opd.sglang.contract import server_layer_ids
    from specforge_opd.testing.standin import StandinBackend, ThreadedStandin, make_app
    from specforge_opd.stages.opd import run_opd
    from specforge_opd.stages.plan import PlanError

    cfg, bundle, prompts = _setup(tmp_path, "embedded")
    cfg.rollout.teacher = "topk"
    run_opd(cfg, target=bundle, prompts=prompts)
    layers = drafter_layer_ids(make_tiny_drafter(bundle.model))
    with ThreadedStandin(make_app(StandinBackend(bundle.model, aux_layer_ids=server_layer_ids(layers)))) as server:
        cfg2, _, _ = _setup(tmp_path, "http")
        cfg2.rollout.teacher = "topk"
        cfg2.rollout.backend = "sglang_verify"
        cfg2.sglang.urls = [server.url]
        run_opd(cfg2, target=bundle, prompts=prompts)
        cfg3, _, _ = _setup(tmp_path, "native")
        cfg3.rollout.backend = "sglang_native"
        cfg3.sglang.urls = [server.url]
        with pytest.raises(PlanError, match="sglang.urls"):
            run_opd(cfg3, target=bundle, prompts=prompts)
    a = [json.loads(l) for l in (tmp_path / "embedded" / "opd_metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (tmp_path / "http" / "opd_metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_tau"] for r in b] == pytest.approx([r["rollout_tau"] for r in a])
    assert [r["rollout_verify_steps"] for r in b] == [r["rollout_verify_steps"] for r in a]


def test_opd_validation_curve_selects_the_best_refresh(tmp_path):
    """With opd.val_prompts, the start and every refresh get a validation tau on held-out prompts; final is the
    best refresh (opd.select=best_val) or the last, and records the whole run's FLOPs for a matched baseline."""
    from specforge_opd.stages.opd import run_opd
    from specforge_opd.stages.opd_validation import OPD_CURVE_FILE
    from specforge_opd.eval.validation import read_curve

    cfg, bundle, prompts = _setup(tmp_path, "val")
    g = torch.Generator().manual_seed(9)
    val = [(f"v{i}", torch.randint(3, 90, (6,), generator=g).tolist()) for i in range(3)]
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "output.dir": tmp_path / "val", "draft.path": cfg.draft.path, "draft.block_size": 4, "draft.num_hidden_layers": 2,
        "rollout.batch_size": 2, "rollout.max_new_tokens": 10, "opd.prompts_per_step": 2, "opd.prompts_per_iteration": 4,
        "training.num_epochs": 1, "training.checkpoint_interval": 1, "output.tensorboard": "false",
        "target.max_context": 64, "opd.val_prompts": 3, "training.learning_rate": 3e-2,
        "opd.final_rollout": "false"}.items()])
    final = run_opd(cfg, target=bundle, prompts=prompts, val_prompts=val)
    out = tmp_path / "val"
    curve = read_curve(out, OPD_CURVE_FILE)
    assert [p["step"] for p in curve] == [0, 1, 2] and all(p["tau"] >= 1.0 for p in curve)
    assert curve[0]["opd_flops"] == 0.0 and curve[1]["opd_flops"] < curve[2]["opd_flops"]
    best = max(curve[1:], key=lambda p: (p["tau"], -p["step"]))
    meta = json.loads((final / "specforge_opd.json").read_text())
    assert meta["validation"]["selected_refresh"] == best["step"]
    assert meta["opd_run_flops"]["drafter_budget"] == pytest.approx(curve[2]["opd_flops"])
    want = _params(best["export"])
    assert all(torch.equal(v, want[k]) for k, v in _params(final).items())
    assert (out / "opd_curve.png").read_bytes()[:4] == b"\x89PNG"
    # opd.final_rollout=false: the curve measured the final drafter; no extra rollout of it
    assert "final_rollout" not in json.loads((out / "opd_state.json").read_text())
    rows = [json.loads(l) for l in (out / "opd_metrics.jsonl").read_text().splitlines()]
    assert [r["val_tau"] for r in rows] == [p["tau"] for p in curve[1:]]
    # the validated points are read back, not measured again, when the finished run is started again
    before = (out / OPD_CURVE_FILE).read_text()
    run_opd(cfg.model_copy(update={"opd": cfg.opd.model_copy(update={"select": "last"})}), target=bundle, prompts=prompts,
            val_prompts=val)
    assert (out / OPD_CURVE_FILE).read_text() == before
    last = _params(curve[2]["export"])
    assert all(torch.equal(v, last[k]) for k, v in _params(out / "final").items())
    # a finished run without refresh points (validation switched on after it ran) measures them on resume
    # instead of failing at the export with nothing to select
    (out / OPD_CURVE_FILE).write_text(before.splitlines(keepends=True)[0])
    run_opd(cfg, target=bundle, prompts=prompts, val_prompts=val)
    again = read_curve(out, OPD_CURVE_FILE)
    assert [(p["step"], p["tau"], p["export"]) for p in again] == [(p["step"], p["tau"], p["export"]) for p in curve]
    assert [p["opd_flops"] for p in again] == pytest.approx([p["opd_flops"] for p in curve])
    assert [p["drafter_flops"] for p in again] == pytest.approx([p["drafter_flops"] for p in curve])


def test_kill_after_an_iteration_is_stamped_counts_its_flops_once(tmp_path, monkeypatch):
    """A run killed between stamping an iteration's export (its cumulative FLOPs) and recording the
    iteration as done resumes with the same FLOPs ledger as a run never killed: the iteration's own cost
    is read back, not the stamped history counted again."""
    from specforge_opd.stages import opd_validation
    from specforge_opd.stages.opd import run_opd

    cfg, bundle, prompts = _setup(tmp_path, "whole")
    g = torch.Generator().manual_seed(9)
    val = [(f"v{i}", torch.randint(3, 90, (6,), generator=g).tolist()) for i in range(2)]
    ov = {"val_prompts": 2, "final_rollout": False}
    whole = cfg.model_copy(update={"opd": cfg.opd.model_copy(update=ov)})
    run_opd(whole, target=bundle, prompts=prompts, val_prompts=val)
    want = json.loads((tmp_path / "whole" / "opd_state.json").read_text())["flops"]

    killed = whole.model_copy(update={"output": whole.output.model_copy(update={"dir": str(tmp_path / "killed")})})
    real_point = opd_validation.OPDValidation.point

    def die_at_refresh_1(self, step, *a, **kw):
        if step == 1:
            raise KeyboardInterrupt("killed after the stamp, before the iteration is recorded")
        return real_point(self, step, *a, **kw)

    monkeypatch.setattr(opd_validation.OPDValidation, "point", die_at_refresh_1)
    with pytest.raises(KeyboardInterrupt):
        run_opd(killed, target=bundle, prompts=prompts, val_prompts=val)
    state = tmp_path / "killed" / "opd_state.json"
    assert not state.exists() or json.loads(state.read_text())["iterations_done"] == 0
    # the iteration's export was stamped with the cumulative ledger before the kill
    assert "opd_flops" in json.loads((tmp_path / "killed" / "iter_000" / "train" / "final" / "specforge_opd.json").read_text())
    monkeypatch.setattr(opd_validation.OPDValidation, "point", real_point)
    run_opd(killed, target=bundle, prompts=prompts, val_prompts=val)
    got = json.loads((tmp_path / "killed" / "opd_state.json").read_text())["flops"]
    nums = lambda d: {k: v for k, v in d.items() if isinstance(v, (int, float))}  # noqa: E731
    assert nums(got) == pytest.approx(nums(want)) and got["drafter_budget"] > 0


def test_validation_points_on_another_prompt_count_are_measured_again(tmp_path):
    """A resumed run whose opd.val_prompts changed measures its refreshes again: taus on different prompt
    sets are not compared when the best refresh is selected."""
    from specforge_opd.eval.validation import read_curve
    from specforge_opd.stages.opd import run_opd
    from specforge_opd.stages.opd_validation import OPD_CURVE_FILE

    cfg, bundle, prompts = _setup(tmp_path, "n")
    g = torch.Generator().manual_seed(9)
    val = [(f"v{i}", torch.randint(3, 90, (6,), generator=g).tolist()) for i in range(3)]
    three = cfg.model_copy(update={"opd": cfg.opd.model_copy(update={"val_prompts": 3, "final_rollout": False})})
    run_opd(three, target=bundle, prompts=prompts, val_prompts=val)
    assert [p["val_prompts"] for p in read_curve(tmp_path / "n", OPD_CURVE_FILE)] == [3, 3, 3]
    two = three.model_copy(update={"opd": three.opd.model_copy(update={"val_prompts": 2})})
    run_opd(two, target=bundle, prompts=prompts, val_prompts=val[:2], allow_config_change=True)
    assert [p["val_prompts"] for p in read_curve(tmp_path / "n", OPD_CURVE_FILE)] == [2, 2, 2]
