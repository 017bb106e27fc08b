"""The OPD schedule and spool check are fixed at plan time (issue 9)."""

import pytest

from specforge_opd.config import load_config
from specforge_opd.plan import PlanError, estimate_sequence_bytes, iteration_prompt_indices, make_plan


def test_schedule_follows_pool_size():
    cfg = load_config(None, ["opd.prompts_per_step=4", "opd.prompts_per_iteration=8", "training.num_epochs=2"])
    plan = make_plan(cfg, pool_size=10, hidden_size=64, num_layers_captured=2)
    assert plan.iterations == 3  # 20 prompts over 8 per iteration
    assert plan.total_steps == 5  # ceil(20 / 4)
    assert plan.steps_per_iteration == 2
    assert plan.warmup_steps == round(0.05 * 5)
    seen = [i for it in range(plan.iterations) for i in iteration_prompt_indices(plan, it, seed=0)]
    assert len(seen) == 20 and sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    # deterministic: a resumed run rolls out the same prompts
    assert iteration_prompt_indices(plan, 1, seed=0) == iteration_prompt_indices(plan, 1, seed=0)


def test_spool_budget_refusal_names_the_setting():
    cfg = load_config(None, ["opd.spool_budget_bytes=1000"])
    with pytest.raises(PlanError, match="opd.spool_budget_bytes"):
        make_plan(cfg, pool_size=10, hidden_size=64, num_layers_captured=2)


def test_sequence_bytes_counts_features():
    cfg = load_config(None, ["rollout.max_new_tokens=10", "data.max_prompt_tokens=5", "rollout.teacher=token", "draft.block_size=4"])
    with_feats = estimate_sequence_bytes(cfg, 64, 2)
    cfg2 = load_config(None, ["rollout.max_new_tokens=10", "data.max_prompt_tokens=5", "rollout.teacher=token", "draft.block_size=4", "rollout.store_features=false"])
    without = estimate_sequence_bytes(cfg2, 64, 2)
    assert with_feats - without == 14 * 2 * 64 * 4


def test_bad_multiple():
    cfg = load_config(None, ["opd.prompts_per_step=3", "opd.prompts_per_iteration=8"])
    with pytest.raises(PlanError, match="multiple"):
        make_plan(cfg, pool_size=10, hidden_size=64, num_layers_captured=2)


@pytest.mark.parametrize("size", ["4b", "8b", "30b-a3b"])
def test_qwen3_opd_configs_plan_offline(size, capsys):
    """The paper-scale configs resolve and plan here from the packaged Qwen3 config fixtures."""
    from pathlib import Path

    from specforge_opd.opd import dry_run

    root = Path(__file__).resolve().parents[1]
    plan = dry_run(load_config(root / "configs" / f"qwen3-{size}" / "opd.yaml"))
    out = capsys.readouterr().out
    assert plan.pool_size == 16000 and plan.epochs == 8
    assert plan.total_steps == 16000 * 8 // 64 and plan.warmup_steps == round(0.05 * plan.total_steps)
    assert "hub sources" in out and "total_steps" in out
    # native mode: the trainer recomputes features and teacher, so the spool holds tokens and log-probs only
    assert plan.est_spool_bytes_per_iteration < plan.spool_budget_bytes


def test_verified_stream_needs_a_distribution_teacher():
    cfg = load_config(None, ["training.accepted_stream=verified", "rollout.teacher=token"])
    with pytest.raises(PlanError, match="rollout.teacher=full or topk"):
        make_plan(cfg, pool_size=10, hidden_size=64, num_layers_captured=2)
    ok = load_config(None, ["training.accepted_stream=verified", "rollout.teacher=full"])
    make_plan(ok, pool_size=10, hidden_size=64, num_layers_captured=2)
