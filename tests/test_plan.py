"""The OPD schedule and spool check are fixed at plan time (issue 9)."""

import pytest

from specforge_opd.config import load_config
from specforge_opd.stages.plan import PlanError, estimate_sequence_bytes, iteration_prompt_indices, make_plan


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

    from specforge_opd.stages.opd import dry_run

    root = Path(__file__).resolve().parents[1]
    plan = dry_run(load_config(root / "configs" / f"qwen3-{size}" / "opd.yaml"))
    out = capsys.readouterr().out
    assert plan.pool_size == 16000 and plan.epochs == 8
    assert plan.total_steps == 16000 * 8 // 64 and plan.warmup_steps == round(0.05 * plan.total_steps)
    assert "hub sources" in out and "total_steps" in out
    # the SGLang server's KV pool and the rollouts it runs at once (sized from the GPU, not the laptop default)
    assert "sglang: KV pool" in out and "rollouts at once per server" in out
    # native mode: the trainer recomputes features and teacher, so the spool holds tokens and log-probs only
    assert plan.est_spool_bytes_per_iteration < plan.spool_budget_bytes


def test_verified_stream_needs_a_distribution_teacher():
    cfg = load_config(None, ["training.accepted_stream=verified", "rollout.teacher=token"])
    with pytest.raises(PlanError, match="rollout.teacher=full or topk"):
        make_plan(cfg, pool_size=10, hidden_size=64, num_layers_captured=2)
    ok = load_config(None, ["training.accepted_stream=verified", "rollout.teacher=full"])
    make_plan(ok, pool_size=10, hidden_size=64, num_layers_captured=2)


# -- ranks and per-rank memory ---------------------------------------------------------------


def test_per_rank_schedule_and_world_size(monkeypatch):
    from specforge_opd.stages.plan import per_rank_schedule, planned_world_size

    cfg = load_config(None, ["opd.prompts_per_step=16", "opd.prompts_per_iteration=48"])
    plan = make_plan(cfg, pool_size=100, hidden_size=64, num_layers_captured=2)
    for k in ("WORLD_SIZE", "NNODES", "NPROC"):
        monkeypatch.delenv(k, raising=False)
    assert planned_world_size() == 1
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NPROC", "8")
    assert planned_world_size() == 16
    monkeypatch.setenv("WORLD_SIZE", "4")  # inside torchrun the real world size wins
    assert planned_world_size() == 4
    s = per_rank_schedule(plan, 16)
    assert s["rollout_prompts_per_iteration"] == 3 and s["sequences_per_step"] == 1
    assert s["total_steps"] == plan.total_steps and s["steps_per_iteration"] == 3
    with pytest.raises(PlanError, match="prompts_per_step=16 is not divisible by the 3 ranks"):
        per_rank_schedule(plan, 3)
    monkeypatch.setenv("WORLD_SIZE", "zero")
    with pytest.raises(PlanError, match="WORLD_SIZE='zero'"):
        planned_world_size()


def _peak_bytes(fn) -> int:
    """Peak bytes allocated on the CPU while ``fn`` runs, above what was allocated before
    (allocations and frees from the profiler, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def _small_case(form, vocab, hidden, prompt_len, response_len, max_blocks, chunk):
    from specforge_opd.models.drafter import drafter_layer_ids

    from conftest import make_tiny_drafter, make_tiny_target
    from opd_helpers import make_record

    target = make_tiny_target(vocab=vocab, hidden=hidden, layers=3).requires_grad_(False)
    drafter = make_tiny_drafter(target, block_size=4, layers=2, mask_token_id=vocab - 1).train()
    rec = make_record(target, drafter_layer_ids(drafter), seed=1, prompt_len=prompt_len, response_len=response_len,
                      block_size=4, form=form, topk=8, vocab_hi=vocab - 2, greedy=False)
    cfg = load_config(None, [f"data.max_prompt_tokens={prompt_len}", f"rollout.max_new_tokens={response_len}",
                             "draft.block_size=4", "draft.num_hidden_layers=2", f"training.chunk_slots={chunk}",
                             f"training.max_blocks_per_forward={max_blocks}", f"rollout.teacher={form}",
                             "rollout.teacher_topk=8", "target.dtype=float32", "training.feature_source=target"])
    return target, drafter, rec, cfg


# Shapes where each term leads in turn: replay activations (wide hidden, long sequence), the
# lm_head/KL chunk (vocabulary 8192 over hidden 32, as Qwen3's 151936 over 4096), the mask
# (all blocks in one forward) and groups of 16 blocks.
CASES = [("full", 2048, 64, 40, 200, 512, 64), ("full", 2048, 64, 40, 200, 16, 64), ("token", 8192, 32, 20, 100, 512, 128),
         ("topk", 8192, 32, 20, 100, 512, 64), ("full", 8192, 32, 20, 100, 512, 128), ("token", 512, 128, 60, 240, 32, 32)]


@pytest.mark.parametrize("case", CASES)
def test_trainer_memory_estimate_matches_a_measured_step(case):
    """The plan's replay terms against the bytes one training step of one sequence really allocates
    on the CPU (forward and backward of every group, fp32): within 25% below / 50% above."""
    from specforge_opd.stages.plan import estimate_rank_memory
    from specforge_opd.train.losses import plan_slots, slot_coefficients
    from specforge_opd.train.trainer import sequence_group_losses

    target, drafter, rec, cfg = _small_case(*case)
    plan = plan_slots(rec.accepted, rec.block_size)
    coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())

    def step():
        for loss, _, _ in sequence_group_losses(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef,
                                                mask_token_id=case[1] - 1, chunk_slots=cfg.training.chunk_slots,
                                                max_blocks_per_forward=cfg.training.max_blocks_per_forward):
            loss.backward()

    step()  # first-call allocations (thread pools, caches) are not the step's
    drafter.zero_grad(set_to_none=True)
    measured = _peak_bytes(step)
    est = estimate_rank_memory(cfg, target.config, num_blocks=rec.num_blocks, on_gpu=False)
    grads = 4 * sum(p.numel() for p in drafter.parameters())  # part of drafter_state, allocated by this first backward
    estimated = est["replay_activations"] + est["replay_mask"] + est["kl_chunk"] + grads
    assert 0.75 * measured <= estimated <= 1.5 * measured, (estimated, measured, est)


@pytest.mark.parametrize("case", CASES[:4] + [("full", 512, 128, 60, 240, 512, 1024)])
def test_recompute_memory_estimate_matches_a_measured_recompute(case):
    """The plan's recompute terms against the bytes ``recompute_from_target`` allocates for one sequence."""
    import torch

    from specforge_opd.models.drafter import drafter_layer_ids
    from specforge_opd.stages.plan import estimate_rank_memory
    from specforge_opd.train.replay import recompute_from_target

    target, drafter, rec, cfg = _small_case(*case)
    layers = drafter_layer_ids(drafter)
    kept = []

    def run():
        kept.append(recompute_from_target(target, rec, layers, form=cfg.rollout.teacher, topk=8,
                                          max_blocks_per_forward=cfg.training.max_blocks_per_forward,
                                          chunk_rows=cfg.training.chunk_slots))

    with torch.no_grad():
        run()
        kept.clear()
        measured = _peak_bytes(run)
    est = estimate_rank_memory(cfg, target.config, num_blocks=rec.num_blocks, on_gpu=False)
    estimated = (est["sequence_inputs"] + est["recompute_kv_cache"] + est["recompute_activations"] + est["recompute_mask"]
                 + est["recompute_lm_head"])
    assert 0.75 * measured <= estimated <= 1.5 * measured, (estimated, measured, est)


def test_rank_memory_shrinks_the_sharded_drafter_state_only():
    from pathlib import Path

    from specforge_opd.stages.plan import _target_config, estimate_rank_memory

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "qwen3-8b" / "opd.yaml")
    one, sixteen = estimate_rank_memory(cfg, _target_config(cfg), 1), estimate_rank_memory(cfg, _target_config(cfg), 16)
    assert one["drafter_params"] > 0.9e9  # 5 Qwen3-8B-wide layers and the 5-layer fc
    assert one["drafter_state"] - sixteen["drafter_state"] == 16 * one["drafter_params"] // 1 - 16 * one["drafter_params"] // 16
    for k in ("target_weights", "replay_activations", "kl_chunk", "recompute_kv_cache"):
        assert one[k] == sixteen[k]
    assert one["replay_mask"] == 0  # flex_attention on a GPU: no dense mask
    assert one["blocks_per_forward"] == 512 and one["sequence_tokens"] == 2048 + 4096


def test_dry_run_prints_per_rank_plan(monkeypatch, capsys):
    from pathlib import Path

    from specforge_opd.stages.opd import dry_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NPROC", "8")
    dry_run(load_config(Path(__file__).resolve().parents[1] / "configs" / "qwen3-8b" / "opd.yaml"))
    out = capsys.readouterr().out
    assert "per rank (16 ranks): 64 rollout prompts per iteration, 4 sequences per optimizer step, 2000 steps" in out
    assert "peak GPU memory per rank" in out and "trainer" in out and "recompute" in out


def test_train_opd_script_checks_the_rendezvous(tmp_path):
    """scripts/train_opd.sh refuses a multi-node launch without its rendezvous settings, and plans
    NNODES x NPROC ranks with --dry-run."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = str(root / "scripts" / "train_opd.sh")
    cfg = str(root / "configs" / "qwen3-8b" / "opd.yaml")
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run(["bash", script, cfg], env=dict(base, NNODES="2", NPROC="8"), capture_output=True, text=True)
    assert r.returncode == 2 and "needs MASTER_ADDR" in r.stderr
    r = subprocess.run(["bash", script, cfg], env=dict(base, NNODES="2", MASTER_ADDR="10.0.0.1", NODE_RANK="2"),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "NODE_RANK set to this node's rank, 0..1" in r.stderr
    r = subprocess.run(["bash", script, cfg], env=dict(base, NNODES="two"), capture_output=True, text=True)
    assert r.returncode == 2 and "NNODES=two must be a positive integer" in r.stderr
    r = subprocess.run(["bash", script, cfg, "--dry-run"], env=dict(base, NNODES="2", NPROC="8"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "per rank (16 ranks)" in r.stdout


def test_plan_takes_the_start_drafters_shape_where_the_config_leaves_it(tmp_path):
    """A bare draft.path to a block-4, 2-layer drafter: the spool estimate is the drafter's (the schema's default
    block 16 would overstate it ~4x and could refuse a run that fits); fields the config sets stay its own."""
    from conftest import make_tiny_drafter, make_tiny_target

    from specforge_opd.models.drafter import save_drafter
    from specforge_opd.stages.plan import captured_layers, with_start_shape

    d = save_drafter(make_tiny_drafter(make_tiny_target(), block_size=4, layers=2), tmp_path / "d")
    bare = load_config(None, [f"draft.path={d}", "rollout.teacher=full", "data.max_prompt_tokens=16"])
    shaped = with_start_shape(bare)
    assert (shaped.draft.block_size, shaped.draft.num_hidden_layers) == (4, 2)
    assert captured_layers(shaped) == len(shaped.draft.target_layer_ids)
    assert estimate_sequence_bytes(shaped, 64, 2) < estimate_sequence_bytes(bare, 64, 2)
    budget = estimate_sequence_bytes(shaped, 64, captured_layers(shaped)) * 8  # one 8-prompt iteration fits
    tight = [f"draft.path={d}", "rollout.teacher=full", "data.max_prompt_tokens=16", f"opd.spool_budget_bytes={budget}",
             "opd.prompts_per_iteration=8"]
    cfg = load_config(None, tight)
    with pytest.raises(PlanError, match="opd.spool_budget_bytes"):
        make_plan(cfg, 8, 64, captured_layers(cfg))
    ok = with_start_shape(cfg)
    make_plan(ok, 8, 64, captured_layers(ok))
    given = with_start_shape(load_config(None, [f"draft.path={d}", "draft.num_hidden_layers=2"]))
    assert given.draft.block_size == 4 and given.draft.num_hidden_layers == 2
    assert with_start_shape(load_config(None, [])).draft.block_size == 16  # no start drafter: the config's own


def test_backfill_refuses_a_finished_refresh_whose_export_is_missing(tmp_path):
    """A refresh recorded as done whose export is gone is a user error naming the export (it was a NameError:
    the module raised PlanError without importing it)."""
    from specforge_opd.stages.opd_validation import backfill_refreshes
    from specforge_opd.stages.plan import PlanError

    with pytest.raises(PlanError, match="refresh 1 is recorded as done but its export is missing"):
        backfill_refreshes(validation=None, out=tmp_path, iterations_done=1)
