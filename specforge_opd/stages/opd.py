"""The iterated OPD stage (``scripts/train_opd.sh``): roll out, train, export, repeat.

Shape: one job with alternating phases. Each iteration

1. **rollout**: every rank rolls out its share of the iteration's prompts with a
   full copy of the current drafter (target-assisted speculative decoding,
   ``specforge_opd.rollout.engine.SpeculativeEngine``), one shard per batch, into the
   iteration's spool directory; the rollout measures the current drafter's
   on-policy tau for free;
2. **train**: all ranks train together on those shards (``trainer.distill``,
   FSDP2), one optimizer step per ``opd.prompts_per_step`` prompts, on the one
   cosine schedule of the whole stage, carrying optimizer state across
   iterations; the new drafter is exported and handed to the next rollout;
3. **bookkeeping**: metrics to ``opd_metrics.jsonl`` and TensorBoard, shards
   deleted unless ``opd.keep_shards``, ``opd_state.json`` advanced last.

Alternating rather than overlapped phases keeps the rollout exactly on-policy
(policy lag 0 at the first step of each iteration) and needs no second process
to coordinate on a CPU; the spool budget therefore has to hold one iteration,
which ``plan.make_plan`` checks before any work.

Resume: killing the job anywhere and rerunning the same command continues.
Finished rollout batches are found in the spool's manifest by sample id and not
redone; training resumes from the iteration's last checkpoint (``distill``);
a finished iteration is never redone (``opd_state.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from specforge_opd.atomic import atomic_write_json
from specforge_opd.config import ExperimentConfig
from specforge_opd.data.prompts import HUB_SOURCES, prompt_token_ids, training_pool_with_stats
from specforge_opd.errors import DiskFullError, is_disk_full
from specforge_opd.eval.flops import FlopsLedger, rollout_target_flops
from specforge_opd.models import target as target_mod
from specforge_opd.models.drafter import (
    METADATA_FILE,
    check_target_dtype,
    drafter_layer_ids,
    drafter_mask_token_id,
    load_any_drafter,
    read_drafter_metadata,
    save_drafter,
)
from specforge_opd.rollout.driver import drive
from specforge_opd.rollout.engine import SpeculativeEngine
from specforge_opd.rollout.records import accepted_histogram, tau_of
from specforge_opd.rollout.shard_meta import ShardMeta
from specforge_opd.rollout.shards import ShardWriter, read_shards
from specforge_opd.run_fingerprint import check_config_unchanged
from specforge_opd.sglang.sizing import plan_line
from specforge_opd.stages.opd_report import write_report  # noqa: F401  (also opd.write_report for callers)
from specforge_opd.stages.opd_state import OPDRun, metrics_row, record_iteration
from specforge_opd.stages.opd_validation import (
    OPD_CURVE_PLOT,
    OPDValidation,
    backfill_refreshes,
    plot_opd_curve,
    select_refresh,
)
from specforge_opd.stages.plan import (
    OPDPlan,
    PlanError,
    _target_config,
    captured_layers,
    estimate_rank_memory,
    iteration_prompt_indices,
    make_plan,
    per_rank_schedule,
    planned_world_size,
    with_start_shape,
)
from specforge_opd.stages.rollout import make_backend
from specforge_opd.stepkeys import dir_bytes
from specforge_opd.train.hooks import TrainHooks
from specforge_opd.train.trainer import distill

STATE_FILE = "opd_state.json"


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def bind_rank_device(cfg: ExperimentConfig) -> ExperimentConfig:
    """Pin this torchrun rank to its own GPU before anything touches CUDA.

    ``torch.cuda.set_device(LOCAL_RANK)`` first, whatever ``target.device`` says
    (NCCL's init and barriers, which run whenever CUDA is available, and every
    bare ``"cuda"`` tensor then use the rank's GPU instead of GPU 0; NCCL refuses
    two ranks on one GPU), as the trainer does; ``target.device`` "auto"/"cuda"
    becomes ``cuda:LOCAL_RANK``, an explicit device is kept. Returns ``cfg``
    unchanged outside torchrun or without CUDA.
    """
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        return cfg
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if cfg.target.device not in ("auto", "cuda"):
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.target.device = f"cuda:{local}"
    return cfg


def _target_dims(cfg: ExperimentConfig) -> tuple[int, int, int]:
    """(hidden size, target layers, drafter layers captured) without loading weights."""
    tcfg = _target_config(cfg)
    return int(tcfg.hidden_size), int(tcfg.num_hidden_layers), captured_layers(cfg)


def _pool(cfg: ExperimentConfig, tokenizer=None):
    return training_pool_with_stats(cfg.data, cache=cfg.target.cache_dir, tokenizer=tokenizer)


def dry_run(cfg: ExperimentConfig) -> OPDPlan:
    """Print the plan (schedule, spool estimate, drafter, and per rank: prompts, steps and the
    estimated peak GPU memory of the trainer and the recompute) without loading any weights.

    The ranks are ``plan.planned_world_size()`` (``WORLD_SIZE``, or ``NNODES`` x ``NPROC``).

    Raises:
        PlanError: the schedule does not fit (see ``plan.make_plan``, ``plan.per_rank_schedule``).
    """
    tconf = _target_config(cfg)
    cfg = with_start_shape(cfg)  # the start drafter's shape where the config leaves it unset
    hidden, n_target, n_captured = int(tconf.hidden_size), int(tconf.num_hidden_layers), captured_layers(cfg)
    remote = [s for s in cfg.data.train_sources if s in HUB_SOURCES and s not in cfg.data.local_files]
    if remote:
        # a dry run never reaches for the hub: plan from the configured counts
        pool_size = cfg.data.num_prompts or sum(cfg.data.source_limits.values())
        pool_note = f"hub sources {remote} not loaded by a dry run; planning with the configured {pool_size} prompts"
    else:
        pool, stats = _pool(cfg)
        pool_size, pool_note = len(pool), stats.summary()
    plan = make_plan(cfg, pool_size, hidden, n_captured)
    layers = lambda n: f"{n} layer" + ("s" if n != 1 else "")  # noqa: E731
    print(f"OPD plan for {cfg.name} (target hidden {hidden}, {layers(n_target)}; drafter {layers(cfg.draft.num_hidden_layers)}, "
          f"block_size {cfg.draft.block_size})")
    print(f"  prompt pool: {pool_size} ({pool_note})")
    for k, v in plan.as_dict().items():
        if "bytes" in k:
            print(f"  {k:32s} {v / 2**30:10.3f} GiB")
        else:
            print(f"  {k:32s} {v}")
    print(f"  rollout: backend={cfg.rollout.backend} batch={cfg.rollout.batch_size} max_new_tokens={cfg.rollout.max_new_tokens} "
          f"T={cfg.rollout.temperature} teacher={cfg.rollout.teacher} anchors={cfg.rollout.anchors} features={'shard' if cfg.rollout.store_features else 'recomputed'}")
    print(f"  loss: {cfg.training.loss} combine={cfg.training.combine} rejected_decay={cfg.training.rejected_decay} "
          f"lr={cfg.training.learning_rate} {cfg.training.lr_scheduler} warmup_ratio={cfg.training.warmup_ratio}")
    print(f"  initial drafter: {cfg.draft.path}; output: {cfg.output.dir}")
    world = planned_world_size()
    sched = per_rank_schedule(plan, world)
    print(f"  per rank ({world} rank{'s' if world != 1 else ''}): {sched['rollout_prompts_per_iteration']} rollout prompts per iteration, "
          f"{sched['sequences_per_step']} sequences per optimizer step, {sched['total_steps']} steps "
          f"({sched['steps_per_iteration']} per iteration)")
    mem = estimate_rank_memory(cfg, tconf, world)
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    # the config's intent: a dry run of a GPU config on a laptop still plans GPU memory
    print(f"  peak {'CPU' if cfg.target.device == 'cpu' else 'GPU'} memory per rank (estimate; a {mem['sequence_tokens']}-token sequence with {mem['blocks']} blocks, "
          f"{mem['blocks_per_forward']} per forward):")
    print(f"    trainer   {gib(mem['trainer_peak']):>10}  = target {gib(mem['target_weights'])} + drafter state "
          f"{gib(mem['drafter_state'])} + sequence {gib(mem['sequence_inputs'])} + replay activations "
          f"{gib(mem['replay_activations'])} + mask {gib(mem['replay_mask'])} + lm_head/KL chunk {gib(mem['kl_chunk'])}")
    if mem["recompute_peak"] is not None:
        print(f"    recompute {gib(mem['recompute_peak']):>10}  = target + drafter state + sequence + KV cache "
              f"{gib(mem['recompute_kv_cache'])} + activations {gib(mem['recompute_activations'])} + mask "
              f"{gib(mem['recompute_mask'])} + lm_head chunk {gib(mem['recompute_lm_head'])}")
    if cfg.rollout.backend != "embedded":
        # the server starts beside the trainer's drafter state (the target is offloaded while it runs)
        on_gpu = torch.cuda.is_available()
        total = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else 80.0
        line = plan_line(cfg, tconf, cfg.data.max_prompt_tokens, free_gib=total - mem["drafter_state"] / 2**30,
                         weights_gib=mem["target_weights"] / 2**30)
        print(f"  {line}" + ("" if on_gpu else " (planned for an 80 GiB GPU)"))
    return plan


# ---------------------------------------------------------------------------
# rollout phase


def rollout_phase(cfg, engine, bundle, prompts: list[tuple[str, list[int]]], shard_dir: Path, meta: ShardMeta, drafter_step: int,
                  drafter_dir: Optional[str] = None, hooks: Optional[TrainHooks] = None) -> dict:
    """Roll out ``prompts`` (this rank's share) into ``shard_dir``; skip sequences already written.

    The backend is ``rollout.backend``'s (``stages.rollout.make_backend``), driven by ``rollout.driver.drive``.
    The embedded backend rolls out every prompt left in one continuous batch of
    ``rollout.batch_size`` rows and writes shards of that many sequences in prompt order;
    SGLang's modes write ``rollout.sequences_per_shard`` (native mode launches the server with
    ``drafter_dir``, this iteration's drafter). ``hooks.after_shard(n)`` (tests) is called after
    each shard written, ``n`` the shards written so far.

    Returns stats of the batches rolled out now plus those found done:
    sequences, completion tokens, verify steps, accepted histogram, seconds, FLOPs, and
    ``healed``: damaged shards moved aside on resume (their prompts were rolled out again).
    """
    writer = ShardWriter(shard_dir, meta)
    rank, _ = _rank_world()
    backend = make_backend(cfg, bundle, engine, per=cfg.rollout.batch_size, draft_path=drafter_dir, log_dir=shard_dir)
    shards_now = 0

    def after_shard(recs) -> None:
        nonlocal shards_now
        shards_now += 1
        if hooks is not None:
            hooks.after_shard(shards_now)

    run = drive(backend, prompts, writer, drafter_step=drafter_step, on_write=after_shard, quiet=rank != 0)
    # Stats over everything in the spool (resumed batches included), without features.
    recs = list(read_shards(shard_dir))
    ledger = FlopsLedger()
    tcfg = bundle.model.config
    for r in recs:
        ledger.target_rollout += rollout_target_flops(tcfg, prompt_len=r.prompt_len, anchors=r.anchors.tolist(), block_size=r.block_size)
    return {
        "sequences": len(recs),
        "completion_tokens": sum(r.completion_tokens for r in recs),
        "verify_steps": sum(r.num_blocks for r in recs),
        "tau": tau_of(recs),
        "histogram": accepted_histogram(recs, recs[0].block_size) if recs else [],
        "seconds": run.seconds,
        "tokens_per_s": run.tokens_per_s,
        "skipped_too_long": run.skipped,
        "target_rollout_flops": ledger.target_rollout,
        "healed": len(writer.healed),
    }


def _rollout_engine(cfg, bundle, drafter_dir, it: int) -> tuple[SpeculativeEngine, ShardMeta, int]:
    """The drafter in ``drafter_dir`` on the target's device, the engine that rolls out with it, the shard meta
    of iteration ``it``'s rollout, and the drafter's optimizer step (its metadata's ``step``, 0 when absent).

    The engine samples with the seed the shard meta records (``ShardMeta.of_rollout``: ``rollout.seed + it``),
    which the SGLang backends receive too, so every refresh draws afresh and both backends draw alike."""
    drafter = load_any_drafter(drafter_dir, bundle.model.config).to(bundle.model.device).eval()
    step = int(read_drafter_metadata(drafter_dir).get("step", 0))
    meta = _rollout_meta(cfg, bundle, drafter, drafter_dir, step, it)
    engine = SpeculativeEngine(
        bundle.model, drafter, cfg.rollout.model_copy(update={"seed": meta.seed}), stop_token_ids=bundle.stop_token_ids,
        mask_token_id=drafter_mask_token_id(drafter), max_context=cfg.target.max_context, too_long=cfg.target.too_long,
        prefill_chunk=cfg.target.prefill_chunk,
    )
    return engine, meta, step


def _rollout_meta(cfg, bundle, drafter, drafter_dir, drafter_step: int, it: int) -> ShardMeta:
    """The shard meta of iteration ``it``'s rollout (``shards`` module docstring)."""
    return ShardMeta.of_rollout(cfg, target_identity=bundle.identity, drafter_identity=str(drafter_dir),
                                drafter_step=drafter_step, block_size=int(drafter.block_size),
                                target_layer_ids=drafter_layer_ids(drafter), mask_token_id=drafter_mask_token_id(drafter),
                                iteration=it)


def _final_rollout(cfg, bundle, prompts, plan: OPDPlan, drafter_dir, spool_root: Path) -> dict:
    """The final drafter's on-policy tau, on the first iteration's prompts with its seed: the prompts the
    initial drafter's tau was measured on, so the two compare directly. Rank 0 rolls them all out;
    the shards go to ``<spool>/final`` (deleted unless ``opd.keep_shards``).

    Returns:
        ``{"tau", "sequences", "drafter"}``.
    """
    engine, meta, step = _rollout_engine(cfg, bundle, drafter_dir, 0)
    mine = [(f"{prompts[i][0]}#g{j}", prompts[i][1]) for j, i in enumerate(iteration_prompt_indices(plan, 0, cfg.data.seed))]
    shard_dir = spool_root / "final"
    print(f"OPD: measuring the final drafter's tau on iteration 1's {len(mine)} prompts", file=sys.stderr)
    ro = rollout_phase(cfg, engine, bundle, mine, shard_dir, meta, step, drafter_dir=drafter_dir)
    if not cfg.opd.keep_shards:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return {"tau": ro["tau"], "sequences": ro["sequences"], "drafter": str(drafter_dir)}


# ---------------------------------------------------------------------------
# the loop


def run_opd(cfg: ExperimentConfig, *, target=None, prompts: Optional[list[tuple[str, list[int]]]] = None,
            val_prompts: Optional[list[tuple[str, list[int]]]] = None, hooks: Optional[TrainHooks] = None,
            allow_config_change: bool = False) -> Path:
    """Run (or resume) the whole OPD stage; returns the final drafter directory.

    Setup and resume (``_setup``), one ``_run_iteration`` per iteration not yet done, then the final
    drafter (``_finish``).

    Args:
        target: a loaded ``TargetBundle`` (None: ``target.load_target(cfg.target)``).
        prompts: the prompt pool as (id, token ids) (None: ``data`` sources rendered
            with the target's chat template, as SFT capture and evaluation render them).
        val_prompts: the validation prompts (None: ``opd.val_prompts`` prompts of the pool
            after the rolled-out ones; ``stages.opd_validation``).
        hooks: test and tooling callbacks (``train.hooks.TrainHooks``), passed to every
            iteration's rollout phase (``after_shard``) and ``distill``; None: none.
        allow_config_change: resume although a field that changes the result differs from
            the run's start (``run_fingerprint``); the change is recorded.
    Raises:
        PlanError: the plan cannot run (spool budget, schedule).
        ConfigError: a resume with a changed config (``run_fingerprint.check_config_unchanged``).
        and whatever the rollout, shards and trainer raise on bad input.
    """
    run = _setup(cfg, target=target, prompts=prompts, val_prompts=val_prompts, hooks=hooks,
                 allow_config_change=allow_config_change)
    for it in range(run.state["iterations_done"], run.plan.iterations):
        _run_iteration(run, it)
    return _finish(run)


def _setup(cfg: ExperimentConfig, *, target, prompts, val_prompts, hooks, allow_config_change: bool) -> OPDRun:
    """Everything before the first iteration (``run_opd``'s arguments): the rank's GPU, the config check,
    the target, the prompt pool, the plan, the resume state (``_load_state``), the process group, and
    validation point 0 with the refreshes a resumed run already exported.

    Raises:
        PlanError, ConfigError: as ``run_opd``.
    """
    cfg = bind_rank_device(cfg)
    rank, world = _rank_world()
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    check_config_unchanged(cfg, out, "opd", allow_change=allow_config_change, write=rank == 0)
    bundle = target if target is not None else target_mod.load_target(cfg.target)  # through the module: tests patch it there
    tok = bundle.tokenizer
    if prompts is None:
        pool, pool_stats = _pool(cfg, tokenizer=tok)
        pool_stats = pool_stats.summary()
        # Rendered once: the same chat rendering as SFT capture and evaluation.
        prompts = [(str(p.id), prompt_token_ids(tok, p, cfg)) for p in pool]
    else:
        pool_stats = "given by the caller"
    tconf = getattr(bundle.model.config, "text_config", bundle.model.config)
    shaped = with_start_shape(cfg)  # the spool estimate needs the start drafter's block size
    plan = make_plan(shaped, len(prompts), int(tconf.hidden_size), captured_layers(shaped))
    if cfg.training.batch_size * cfg.training.accumulation_steps * world != cfg.opd.prompts_per_step:
        # one optimizer step per prompts_per_step prompts: derive accumulation from it
        per_rank = cfg.opd.prompts_per_step // world
        if per_rank * world != cfg.opd.prompts_per_step:
            raise PlanError(f"opd.prompts_per_step={cfg.opd.prompts_per_step} is not divisible by the {world} ranks")
        cfg = cfg.model_copy(deep=True)
        cfg.training.batch_size = 1
        cfg.training.accumulation_steps = per_rank
    state_path = out / STATE_FILE
    state = _load_state(cfg, out, state_path, plan, bundle, rank)
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        dist.barrier()
    if state["iterations_done"] == 0:
        state["drafter"] = str(out / "initial_drafter")
    if state.get("plan", {}).get("total_steps") != plan.total_steps:
        raise PlanError(
            f"{state_path} was written for another plan ({state.get('plan')}); rerun with the same config, or a fresh output.dir"
        )
    spool_root = Path(cfg.opd.spool_dir) if cfg.opd.spool_dir else out / "spool"
    if rank == 0:
        # a run killed inside iteration 0 has rollouts in the spool but no state file yet
        begun = state_path.is_file() or any(spool_root.glob("iter_*"))
        print(f"OPD: {plan.iterations} iterations x {plan.steps_per_iteration} steps ({plan.total_steps} total), pool {len(prompts)} prompts "
              f"({pool_stats}); {'resuming at' if begun else 'starting at'} iteration {state['iterations_done']}",
              file=sys.stderr)
    initial_drafter = out / "initial_drafter"
    initial_meta = read_drafter_metadata(initial_drafter)
    flops = FlopsLedger.from_dict(state["flops"])
    tb = _tensorboard(cfg, out) if rank == 0 else None
    validation = None
    if cfg.opd.val_prompts and rank == 0:
        validation = OPDValidation(cfg, bundle, out, prompts=val_prompts)
        # point 0: the start, so the curve shows what OPD adds to it
        validation.point(0, initial_drafter, drafter_flops=FlopsLedger.from_dict(initial_meta.get("flops")).drafter_budget,
                         opd_flops=0.0)
        backfill_refreshes(validation, out, state["iterations_done"])
    return OPDRun(cfg=cfg, rank=rank, world=world, out=out, bundle=bundle, prompts=prompts, plan=plan, state=state,
                  state_path=state_path, spool_root=spool_root, initial_drafter=initial_drafter, initial_meta=initial_meta,
                  flops=flops, tb=tb, validation=validation, hooks=hooks)


def _load_state(cfg: ExperimentConfig, out: Path, state_path: Path, plan: OPDPlan, bundle, rank: int) -> dict:
    """``state_path``'s state, or a fresh one at iteration 0; on a fresh run rank 0 saves the start drafter
    as ``out/initial_drafter`` (before the process group's first barrier: the other ranks read it after).

    Raises:
        PlanError: draft.path unset, or not the drafter the run started from; rollout.backend
            sglang_native with sglang.urls.
    """
    state = json.loads(state_path.read_text()) if state_path.is_file() else {
        "iterations_done": 0,
        "drafter": str(cfg.resolve_path(cfg.draft.path)) if cfg.draft.path else None,
        "plan": plan.as_dict(),
        "flops": FlopsLedger().to_dict(),
        "history": [],
    }
    if state["drafter"] is None:
        raise PlanError("draft.path is not set: the OPD stage starts from the SFT stage's export or another DFlash/SpecForge drafter")
    source = str(cfg.resolve_path(cfg.draft.path))
    started_from = state.get("source") or (read_drafter_metadata(out / "initial_drafter").get("source")
                                           if state["iterations_done"] else None)
    if started_from is not None and started_from != source:
        # resuming would continue (or call finished) a run that started from another drafter
        raise PlanError(f"{state_path} belongs to a run that started from {started_from}, but draft.path is {source}; "
                        "use a fresh output.dir, or set draft.path back to resume it")
    state.setdefault("source", source)
    if cfg.rollout.backend == "sglang_native" and cfg.sglang.urls:
        raise PlanError(
            "rollout.backend=sglang_native with sglang.urls: a given server keeps the drafter it was started with, so "
            "each iteration's new drafter could not reach it; leave sglang.urls empty and the launcher restarts "
            "SGLang with every iteration's drafter"
        )
    if state["iterations_done"] == 0 and rank == 0:
        # Any accepted checkpoint form (SpecForge step dir, exports, published DFlash) becomes
        # one HF directory, checked against the target once, before any rollout.
        src = state["drafter"]
        init = load_any_drafter(src, bundle.model.config, expected_mask_token_id=cfg.draft.mask_token_id,
                                target_dtype=cfg.target.dtype)
        meta = read_drafter_metadata(src) if Path(src).is_dir() else {}
        check_target_dtype(meta, cfg.target.dtype, src)
        save_drafter(init, out / "initial_drafter", metadata=dict(meta, source=str(src)), dtype=cfg.target.dtype)
    return state


def _run_iteration(run: OPDRun, it: int) -> None:
    """Iteration ``it``: 1. rollout (``_iteration_rollout``), 2. train (``distill``), 3. bookkeeping (the FLOPs
    stamped on the export, ``opd_state.metrics_row``, the validation point of rank 0, and on rank 0
    ``opd_state.record_iteration``); with
    several ranks, every rank then reads back the state rank 0 advanced."""
    it_dir = run.out / f"iter_{it:03d}"
    drafter_dir = run.state["drafter"]
    # -- 1. rollout ------------------------------------------------------
    ro, drafter_step = _iteration_rollout(run, it, it_dir, drafter_dir)
    spool_bytes = dir_bytes(run.spool_root)
    # -- 2. train --------------------------------------------------------
    shard_dirs = sorted({p.parent for p in (run.spool_root / f"iter_{it:03d}").rglob("manifest.json")})
    tcfg = run.cfg.model_copy(deep=True)
    tcfg.training.num_epochs = 1
    prev_ckpt = run.out / f"iter_{it - 1:03d}" / "train" / "checkpoints" if it > 0 else None
    t0 = time.perf_counter()
    res = distill(
        tcfg, shard_dirs, drafter_dir, it_dir / "train", target=run.bundle,
        schedule=(it * run.plan.steps_per_iteration, run.plan.total_steps), carry_from=prev_ckpt, hooks=run.hooks,
    )
    train_seconds = time.perf_counter() - t0
    # -- 3. bookkeeping --------------------------------------------------
    # distill records the drafter-side FLOPs of the steps it trained; the rollout adds the target's.
    # The stamp below replaces "flops" with the cumulative ledger and keeps distill's own as
    # "iteration_flops": a run killed after the stamp but before the state is written reads
    # this iteration's own cost again on resume, not the history counted twice.
    export_meta = read_drafter_metadata(res.export_dir)
    own = export_meta.get("iteration_flops") or export_meta.get("flops")
    it_flops = FlopsLedger.from_dict(own)
    it_flops.target_rollout += ro.pop("target_rollout_flops")
    run.flops = flops = run.flops.add(it_flops)
    # "flops": the drafter's whole history (initial drafter + this stage), comparable with a
    # continued-SFT drafter's ledger; "opd_flops": this stage alone (what a matched baseline spends).
    cumulative = FlopsLedger.from_dict(run.initial_meta.get("flops")).add(flops)
    _stamp_metadata(res.export_dir, {"flops": cumulative.to_dict(), "opd_flops": flops.to_dict(), "opd_iteration": it,
                                     "iteration_flops": own,
                                     "initial_drafter": str(run.initial_drafter), "initial_flops": run.initial_meta.get("flops")})
    row = metrics_row(run, it, ro, res, drafter_step=drafter_step, train_seconds=train_seconds, spool_bytes=spool_bytes)
    if run.validation is not None:
        # before the iteration is marked done: a kill here measures it again on resume
        row["val_tau"] = run.validation.point(it + 1, res.export_dir, drafter_flops=cumulative.drafter_budget,
                                              opd_flops=flops.drafter_budget)["tau"]
    if run.rank == 0:
        record_iteration(run, it, row, ro, res, spool_bytes)
    if run.world > 1:
        dist.barrier()
        run.state = json.loads(run.state_path.read_text())


def _iteration_rollout(run: OPDRun, it: int, it_dir: Path, drafter_dir: str) -> tuple[dict, int]:
    """Roll out this rank's share of iteration ``it``'s prompts with the drafter in ``drafter_dir``.

    Shards healed on any rank restart the iteration's training (rank 0 deletes its checkpoints);
    with several ranks, ends with every rank's rollout done (all-reduce of the healed count, barriers).
    Returns ``rollout_phase``'s stats without ``healed``, and the drafter's step.
    """
    cfg, rank, world, bundle = run.cfg, run.rank, run.world, run.bundle
    shard_dir = run.spool_root / f"iter_{it:03d}" / (f"rank{rank}" if world > 1 else "")
    engine, meta, drafter_step = _rollout_engine(cfg, bundle, drafter_dir, it)
    idx = iteration_prompt_indices(run.plan, it, cfg.data.seed)
    prompts = run.prompts
    mine = [(f"{prompts[i][0]}#g{it * run.plan.prompts_per_iteration + j}", prompts[i][1]) for j, i in enumerate(idx)][rank::world]
    # the config the SGLang backends are built from (``make_backend``) samples with the meta's seed too
    rcfg = cfg.model_copy(deep=True)
    rcfg.rollout.seed = meta.seed
    ro = rollout_phase(rcfg, engine, bundle, mine, shard_dir, meta, drafter_step, drafter_dir=drafter_dir, hooks=run.hooks)
    del engine  # and its drafter: the trainer loads its own copy
    healed = ro.pop("healed")
    if world > 1:
        flag = torch.tensor([healed], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flag)
        healed = int(flag.item())
        dist.barrier()
    if healed and rank == 0 and (it_dir / "train" / "checkpoints").is_dir():
        # the healed spool holds the same prompts in another order: this iteration's training starts over
        print(f"OPD: iteration {it + 1}'s shards were healed; its training restarts from the iteration's start",
              file=sys.stderr)
        shutil.rmtree(it_dir / "train" / "checkpoints")
    if world > 1:
        dist.barrier()
    return ro, drafter_step


def _finish(run: OPDRun) -> Path:
    """After the last iteration: the final drafter's rollout tau (rank 0, ``opd.final_rollout``, once), then
    rank 0 copies the selected refresh (``opd.select`` with validation, else the last export) to ``out/final``,
    stamps it, and writes the report. Returns ``out/final`` (on every rank).

    Raises:
        PlanError: no iteration ran.
        DiskFullError: the disk filled while copying the final drafter.
    """
    cfg, out, state, validation = run.cfg, run.out, run.state, run.validation
    final = out / "final"
    if (run.rank == 0 and cfg.opd.final_rollout and state["iterations_done"] == run.plan.iterations
            and "final_rollout" not in state):
        state["final_rollout"] = _final_rollout(cfg, run.bundle, run.prompts, run.plan, state["drafter"], run.spool_root)
        atomic_write_json(run.state_path, state)
    if run.rank == 0:
        if state["iterations_done"] == 0:
            raise PlanError("no OPD iteration ran")
        chosen, record = state["drafter"], {}
        if validation is not None:
            curve = validation.curve()
            sel = select_refresh(curve, cfg.opd.select)
            chosen = sel["export"]
            plot_opd_curve(curve, out / OPD_CURVE_PLOT, sel["step"], run.initial_meta)
            record = {"validation": {"select": cfg.opd.select, "selected_refresh": sel["step"], "selected_tau": sel["tau"],
                                     "curve": curve, "val_prompts": len(validation.prompt_ids)}}
            print(f"[opd val] exporting refresh {sel['step']} (opd.select={cfg.opd.select}: validation tau "
                  f"{sel['tau']:.3f}); curve: {out / OPD_CURVE_PLOT}", file=sys.stderr)
        tmp = out / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(chosen, tmp)  # keeps the export's modes (0644/0755 under umask 0022)
        except (OSError, shutil.Error) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e) or "No space left" in str(e):
                raise DiskFullError(final, f"copying {chosen}") from e
            raise
        # the whole run's drafter-training FLOPs and last drafter: what a matched baseline spends and
        # compares with, whichever refresh was selected
        _stamp_metadata(tmp, dict(record, opd_run_flops=state["flops"], opd_last_export=str(state["drafter"])))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_report(out, final_rollout=state.get("final_rollout"))
        if run.tb is not None:
            run.tb.close()
    return final


def _stamp_metadata(drafter_dir: Path, extra: dict) -> None:
    p = Path(drafter_dir) / METADATA_FILE
    meta = json.loads(p.read_text()) if p.is_file() else {}
    meta.update(extra)
    atomic_write_json(p, meta)


def _tensorboard(cfg, out: Path):
    if not cfg.output.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard" / "opd"))
