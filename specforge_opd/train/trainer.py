"""The OPD trainer: replay rollout shards, acceptance-aware KL, FSDP2 over the drafter (paper section 4.2).

``distill`` reads top to bottom (setup, loop, export):

1. distributed setup (``torchrun``: gloo on CPUs, NCCL on GPUs; a plain
   process works as world size 1), the frozen target (embedding + lm_head, and
   the whole model for ``feature_source: target``), the drafter;
2. records from shards, a fixed global batch order per epoch;
3. FSDP2 (``fully_shard`` per drafter layer, then the root), AdamW, SpecForge's
   cosine-with-warmup schedule; resume from the latest checkpoint;
4. per step (``step.train_step``): global denominators from accepted counts (no
   forward needed), per sequence: replay forwards of at most
   ``training.max_blocks_per_forward`` blocks, each with its chunked lm_head/KL and
   its own backward (every rank runs as many as the rank with the most,
   ``step_group_counts``), clip, step; then non-finite guard; metrics; periodic
   checkpoints;
5. HF export through ``drafter.save_drafter``.

Global batch: ``training.batch_size`` sequences per rank per micro-step, times
``accumulation_steps``, times world size. Step s trains records
``order[s*G:(s+1)*G]`` of its epoch, split into micro-steps, then ranks; the
last batch of an epoch may be short (a rank without a record replays a dummy
with zero weight so that FSDP2's collectives stay aligned). The loss is
normalized over the global batch (``losses.slot_coefficients``), so the
gradient does not depend on how the batch is split; FSDP2 averages gradients
over ranks, hence the backward of ``world_size * loss``.

Optimizer: ``torch.optim.AdamW`` over the FSDP2-sharded fp32 parameters (the
fp32 master weights; bf16 compute comes from FSDP2's MixedPrecisionPolicy).
SpecForge's ``BF16Optimizer`` keeps its own flat fp32 copies outside the
module, which neither FSDP2's DTensor parameters nor DCP's optimizer state
dict understand, so it is not used. The LR schedule is SpecForge's
``CosineAnnealingWarmupLR`` (``ConstantWarmupLR`` for ``lr_scheduler: constant``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from specforge_opd.config import ExperimentConfig, bonus_teacher_missing
from specforge_opd.errors import UserError
from specforge_opd.eval.flops import opd_replay_ledger
from specforge_opd.models import target as target_mod
from specforge_opd.models.adapter import optimizer_and_scheduler
from specforge_opd.models.drafter import (
    check_compatible,
    drafter_layer_ids,
    drafter_mask_token_id,
    load_drafter,
    read_drafter_metadata,
)
from specforge_opd.precision import Precision, announce, machine_info, resolve_trainer
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.rollout.shards import read_shards
from specforge_opd.train.checkpoint import (
    CheckpointError,
    export_drafter,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from specforge_opd.train.hooks import TrainHooks
from specforge_opd.train.step import (  # noqa: F401  (sequence_loss, sequence_group_losses, step_group_counts: trainer.* for callers)
    BatchOrder,
    StepContext,
    StepResult,
    sequence_group_losses,
    sequence_loss,
    step_group_counts,
    train_step,
)


class DistillError(UserError, ValueError):
    """The trainer's inputs do not fit together (no drafter, no shards, shards of another block size or teacher form)."""


class NonFiniteError(UserError, RuntimeError):
    """Too many consecutive steps with a NaN/inf loss or gradient; a checkpoint was saved first."""


@dataclass
class DistillResult:
    """What one ``distill`` call did.

    ``step`` counts optimizer steps of this run (batches consumed, skipped ones
    included); ``drafter_step`` = the initial drafter's step + ``step``.
    """

    out_dir: Path
    export_dir: Optional[Path]
    step: int
    total_steps: int
    steps_run: int
    drafter_step: int
    nonfinite_skipped: int
    already_complete: bool = False
    last_metrics: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------
# data order


def data_fingerprint(records: list[RolloutRecord], order: BatchOrder) -> str:
    """Hash of the records' identity and the batch layout; a resume onto other data is refused."""
    h = hashlib.sha1()
    for r in records:
        h.update(f"{r.sample_id}:{int(r.input_ids.numel())}:{r.num_blocks}\n".encode())
    h.update(f"{order.global_batch}:{order.num_epochs}:{order.seed}:{order.shuffle}".encode())
    return h.hexdigest()[:16]


def load_records(shard_dirs: Iterable, expect: Optional[dict] = None) -> list[RolloutRecord]:
    """All records of ``shard_dirs`` in order (``shards.read_shards``), tagged with their shard directory.

    Records stay in memory on every rank: an OPD iteration's shards are bounded
    by the spool budget (DESIGN.md section 2), and every rank needs every
    record's accepted counts for the global denominators.
    """
    out = []
    for d in shard_dirs:
        for rec in read_shards(d, expect):
            rec.extra.setdefault("shard_dir", str(d))
            out.append(rec)
    return out

# ---------------------------------------------------------------------------
# setup


def _setup_distributed() -> tuple[int, int, torch.device, bool]:
    """(rank, world_size, device, initialized_here). A plain process is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available()
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
        initialized_here = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return rank, world, device, initialized_here


def _target_model(target, cfg: ExperimentConfig, device):
    """The frozen target as an HF causal LM (from a module, a TargetBundle, or ``target.load_target``)."""
    if target is None:
        target = target_mod.load_target(cfg.target)
    model = target if isinstance(target, torch.nn.Module) else target.model
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _initial_drafter(drafter_init, cfg: ExperimentConfig, target_model):
    """(drafter, step of the initial drafter). A module is copied, never trained in place."""
    backend = cfg.training.attention_backend
    if isinstance(drafter_init, torch.nn.Module):
        drafter = copy.deepcopy(drafter_init)
        drafter.config._attn_implementation = backend
        step0 = 0
    else:
        path = drafter_init if drafter_init is not None else cfg.draft.path
        if path is None:
            raise DistillError("no initial drafter: pass --drafter DIR or set draft.path")
        drafter = load_drafter(path, backend, target_config=target_model.config, target_dtype=cfg.target.dtype)
        step0 = int(read_drafter_metadata(path).get("step", 0))
    check_compatible(drafter.config, target_model.config, expected_mask_token_id=cfg.draft.mask_token_id)
    drafter.train()
    return drafter.float(), step0


def _shard(drafter, device, bf16: bool):
    """FSDP2: ``fully_shard`` each decoder layer, then the root (fp32 params; bf16 compute on GPUs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    drafter.to(device)
    for layer in drafter.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(drafter, mp_policy=mp)
    return drafter


def _scheduler(optimizer, cfg: ExperimentConfig, total_steps: int):
    _, lr_scheduler = optimizer_and_scheduler()
    warmup = int(cfg.training.warmup_ratio * total_steps)
    if cfg.training.lr_scheduler == "constant":
        return lr_scheduler.ConstantWarmupLR(optimizer, total_steps=total_steps, warmup_steps=min(warmup, total_steps - 1))
    return lr_scheduler.CosineAnnealingWarmupLR(optimizer, total_steps=total_steps, warmup_steps=warmup)

# ---------------------------------------------------------------------------
# metrics


class MetricsLog:
    """Per-step metrics to ``metrics.jsonl`` (and TensorBoard / wandb when configured), rank 0 only."""

    def __init__(self, out_dir: Path, cfg: ExperimentConfig, rank: int, resume_step: int):
        self.enabled = rank == 0
        self.path = out_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        if not self.enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            # Steps after the resumed checkpoint are trained again: drop their old lines.
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, self.path)
        if cfg.output.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1)
        if cfg.output.wandb_project:
            try:
                import wandb

                self.wandb = wandb.init(project=cfg.output.wandb_project, name=cfg.name, resume="allow")
            except ImportError:
                print("warning: output.wandb_project is set but wandb is not installed; logging to JSONL/TensorBoard only", file=sys.stderr)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        step = row["step"]
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                if self.tb is not None:
                    self.tb.add_scalar(f"opd/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------
# the loop


@dataclass
class _Run:
    """One ``distill`` call: what its setup built, and the counters its loop advances (saved in checkpoints)."""

    ctx: StepContext
    out: Path
    drafter: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    precision: Precision
    drafter_step0: int
    fingerprint: str
    ckpt: Optional[Path] = None  # the checkpoint resumed from
    step: int = 0
    skipped_total: int = 0
    nonfinite_run: int = 0

    @property
    def total(self) -> int:
        return self.ctx.order.total_steps

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    @property
    def export_dir(self) -> Path:
        return self.out / "final"

    def trainer_state(self) -> dict:
        order = self.ctx.order
        return {
            "fingerprint": self.fingerprint,
            "epoch": order.epoch_of(self.step) if self.step < self.total else self.ctx.cfg.training.num_epochs,
            "cursor_in_epoch": self.step % order.steps_per_epoch,
            "total_steps": self.total,
            "scheduler": self.scheduler.state_dict(),
            "nonfinite_skipped": self.skipped_total,
            "nonfinite_run": self.nonfinite_run,
            "drafter_step0": self.drafter_step0,
            "world_size": self.ctx.world,
        }


def _inputs(cfg: ExperimentConfig, shard_dirs, drafter_init, target, records, rank: int, world: int, device):
    """Setup 1 and 2: the frozen target, the initial drafter, the checked records and their order.

    Returns:
        (StepContext without autocast, the drafter in fp32 on the CPU, the initial drafter's step).
    """
    tc = cfg.training
    # 1. models: the frozen target (embedding + lm_head; whole model for feature_source=target)
    target_model = _target_model(target, cfg, device)
    embed_tokens = target_model.get_input_embeddings()
    lm_head_weight = target_model.get_output_embeddings().weight.detach()
    drafter, drafter_step0 = _initial_drafter(drafter_init, cfg, target_model)
    layer_ids, mask_id, bs = drafter_layer_ids(drafter), drafter_mask_token_id(drafter), int(drafter.block_size)

    # 2. data
    if records is None:
        if not shard_dirs:
            raise DistillError("distill needs shard directories (--shards DIR) or records")
        records = load_records(shard_dirs, expect={"block_size": bs, "target_layer_ids": layer_ids, "mask_token_id": mask_id,
                                                   "target_dtype": cfg.target.dtype})
    records = [r for r in records if r.num_blocks > 0]
    if any(bonus_teacher_missing(tc.accepted_stream, r.teacher_form()) for r in records):
        raise DistillError("training.accepted_stream=verified needs the full or topk teacher (the shards hold the "
                           "token teacher, which has no bonus-token distribution); roll out with rollout.teacher=full")
    if not records:
        raise DistillError("no record with at least one block in the given shards: nothing to train on")
    for r in records:
        if r.block_size != bs:
            raise DistillError(f"record {r.sample_id}: block_size {r.block_size} != drafter block_size {bs} (draft.block_size)")
        if tc.feature_source == "shard" and r.features is None:
            raise DistillError(f"record {r.sample_id} ({r.extra.get('shard_dir', '?')}) has no features: set training.feature_source=target")
    order = BatchOrder(len(records), tc.batch_size, tc.accumulation_steps, world, tc.num_epochs, tc.seed, tc.shuffle)
    ctx = StepContext(cfg, records, order, target_model, embed_tokens, lm_head_weight, layer_ids, mask_id, bs,
                      rank=rank, world=world, device=device)
    return ctx, drafter, drafter_step0


def _prepare(ctx: StepContext, drafter, drafter_step0: int, out: Path, *, resume: bool, schedule, carry_from) -> _Run:
    """Setup 3: sharding, optimizer, schedule, resume (or carry over the previous phase's state); sets ``ctx.autocast``.

    Raises:
        CheckpointError: the checkpoint to resume was written for other data or batch layout.
    """
    cfg, tc, device = ctx.cfg, ctx.cfg.training, ctx.device
    fingerprint = data_fingerprint(ctx.records, ctx.order)
    precision = resolve_trainer(tc.mixed_precision, device.type)
    if ctx.rank == 0:
        announce(precision, "distill")
    bf16 = precision.value == "bf16"
    if dist.is_initialized():
        drafter = _shard(drafter, device, bf16)
    else:
        drafter.to(device)
    ctx.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if (bf16 and device.type == "cuda" and not dist.is_initialized()) else None
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
    scheduler = _scheduler(optimizer, cfg, ctx.order.total_steps if schedule is None else int(schedule[1]))
    run = _Run(ctx, out, drafter, optimizer, scheduler, precision, drafter_step0, fingerprint)
    run.ckpt = latest_checkpoint(run.ckpt_root) if resume else None
    if run.ckpt is not None:
        state = load_checkpoint(run.ckpt, drafter, optimizer)
        if state.get("fingerprint") != fingerprint:
            raise CheckpointError(
                f"{run.ckpt} was written for other data or batch layout (fingerprint {state.get('fingerprint')} != {fingerprint}); "
                f"use a fresh --out, or the same shards and training.batch_size/accumulation_steps/num_epochs/seed and world size"
            )
        scheduler.load_state_dict(state["scheduler"])
        run.step, run.skipped_total, run.nonfinite_run = int(state["step"]), int(state["nonfinite_skipped"]), int(state["nonfinite_run"])
    else:
        prev = latest_checkpoint(carry_from) if carry_from is not None and Path(carry_from).is_dir() else None
        if prev is not None:
            prev_state = load_checkpoint(prev, drafter, optimizer)
            scheduler.load_state_dict(prev_state["scheduler"])
        elif schedule is not None:
            for _ in range(int(schedule[0])):
                scheduler.step()
    return run


def _metrics_row(run: _Run, res: StepResult, dt: float) -> dict:
    """The metrics of the step just done (``run.step``, 1-based); ``dt``: its seconds."""
    batch, bs, step = res.batch, run.ctx.block_size, run.step
    positions = sum(r.num_blocks * bs for r in batch)
    return {
        "step": step,
        "epoch": run.ctx.order.epoch_of(step - 1),
        "loss": res.loss,
        "L_acc": res.acc_kl_sum / res.n_acc if res.n_acc else 0.0,
        "L_rej": res.rej_wkl_sum / res.w_rej if res.w_rej else 0.0,
        "grad_norm": res.grad_norm,
        "lr": run.scheduler.get_last_lr()[0],
        "tokens_per_s": sum(int(r.input_ids.numel()) for r in batch) / dt,
        "positions_per_s": positions / dt,
        "accepted_fraction": sum(int(r.accepted.sum()) for r in batch) / max(1, sum(r.num_blocks * (bs - 1) for r in batch)),
        "policy_lag": sum(run.drafter_step0 + step - 1 - r.drafter_step for r in batch) / len(batch),
        "sequences": len(batch),
        "nonfinite_skipped": run.skipped_total,
        "skipped": not res.finite,
        "mixed_precision": run.precision.value,
    }


def _loop(run: _Run, metrics: MetricsLog, progress: bool, hooks: TrainHooks) -> tuple[int, dict]:
    """4. The loop: train from ``run.step`` to the last step; returns (steps run, the last step's metrics).

    Raises:
        NonFiniteError: ``training.max_nonfinite_steps`` non-finite steps in a row (a checkpoint is saved first).
    """
    tc, total = run.ctx.cfg.training, run.total
    bar = None
    if progress and run.ctx.rank == 0:
        bar = progress_bar(total, "distill", "step", initial=run.step)
    steps_run, last = 0, {}
    while run.step < total:
        t0 = time.perf_counter()
        res = train_step(run.ctx, run.drafter, run.optimizer, run.scheduler, run.step, hooks)
        run.step += 1
        if res.finite:
            run.nonfinite_run = 0
        else:
            run.skipped_total += 1
            run.nonfinite_run += 1
        if not res.finite and run.nonfinite_run >= tc.max_nonfinite_steps:
            where = res.bad_record or res.batch[0]
            save_checkpoint(run.ckpt_root, run.step, run.drafter, run.optimizer, run.trainer_state())  # prunes nothing: older ones are the good ones
            raise NonFiniteError(
                f"step {run.step}: non-finite loss or gradient for {run.nonfinite_run} steps in a row "
                f"(training.max_nonfinite_steps={tc.max_nonfinite_steps}); record {where.sample_id} of shard "
                f"{where.extra.get('shard_dir', '<in memory>')}; checkpoint saved in {run.ckpt_root}; "
                f"inspect that shard or lower training.learning_rate"
            )
        last = _metrics_row(run, res, time.perf_counter() - t0)
        if run.step % tc.log_interval == 0 or run.step == total:
            metrics.log(last)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}", refresh=False)
        if run.step % tc.checkpoint_interval == 0 or run.step == total:
            save_checkpoint(run.ckpt_root, run.step, run.drafter, run.optimizer, run.trainer_state(), keep=tc.keep_checkpoints)
        steps_run += 1
        hooks.after_step(run.step, total, steps_run)
    if bar is not None:
        bar.close()
    metrics.close()
    return steps_run, last


def distill(
    cfg: ExperimentConfig,
    shard_dirs: Optional[Iterable] = None,
    drafter_init=None,
    out_dir=None,
    target=None,
    *,
    records: Optional[list[RolloutRecord]] = None,
    resume: bool = True,
    progress: bool = True,
    hooks: Optional[TrainHooks] = None,
    schedule: Optional[tuple[int, int]] = None,
    carry_from=None,
) -> DistillResult:
    """Train the drafter with Draft-OPD on rollout shards; resumable (paper section 4.2).

    Args:
        cfg: experiment config (``training`` section; ``rollout.teacher``/``teacher_topk``
            for ``feature_source: target``; ``output.tensorboard``/``wandb_project``).
        shard_dirs: shard directories (``shards.read_shards``); or pass ``records``.
        drafter_init: HF DFlash directory (default ``draft.path``) or a ``DFlashDraftModel``
            (copied, not modified).
        out_dir: run directory (default ``output.dir``): ``checkpoints/``, ``final/``,
            ``metrics.jsonl``, ``tensorboard/``.
        target: HF causal LM or ``TargetBundle``; None loads ``target.load_target(cfg.target)``.
        resume: continue from ``out_dir/checkpoints/latest`` when present.
        hooks: test and tooling callbacks (``hooks.TrainHooks``: ``on_gradients`` after
            the backward passes of each step, ``after_step``); None: none.
        schedule: ``(start, total)``: this call is steps ``start..start+steps`` of a
            longer LR schedule of ``total`` steps (the iterated OPD stage runs one
            cosine over all its iterations). None: the schedule spans this call.
        carry_from: a ``checkpoints/`` directory of the previous phase; on a fresh
            start its latest checkpoint's weights, optimizer moments and scheduler
            continue here (its data fingerprint is not checked: the data is new).
    Returns:
        DistillResult.
    Raises:
        NonFiniteError: ``training.max_nonfinite_steps`` non-finite steps in a row
            (a checkpoint is saved first; the message names the step and shard).
        CheckpointError: the checkpoint to resume belongs to other data or layout.
        DistillError: no records, or records that do not fit the drafter (a ``ValueError``).
    """
    out = Path(out_dir if out_dir is not None else cfg.output.dir)
    rank, world, device, initialized_here = _setup_distributed()
    try:
        ctx, drafter, drafter_step0 = _inputs(cfg, shard_dirs, drafter_init, target, records, rank, world, device)
        run = _prepare(ctx, drafter, drafter_step0, out, resume=resume, schedule=schedule, carry_from=carry_from)
        metrics = MetricsLog(out, cfg, rank, run.step)
        if run.step >= run.total:
            if rank == 0:
                print(f"distill: {run.ckpt} is already at the last step {run.step}/{run.total}; no step left to train "
                      "(use a fresh --out for a new run)", file=sys.stderr)
            if not (run.export_dir / "config.json").is_file():
                export_drafter(run.drafter, run.export_dir, metadata={"step": drafter_step0 + run.step, "opd_steps": run.step,
                                                                      "target_dtype": cfg.target.dtype,
                                                                      "precision": run.precision.record()}, dtype=cfg.target.dtype)
            return DistillResult(out, run.export_dir, run.step, run.total, 0, drafter_step0 + run.step, run.skipped_total,
                                 already_complete=True)

        steps_run, last = _loop(run, metrics, progress, hooks if hooks is not None else TrainHooks())

        # 5. export
        step = run.step
        meta = {"step": drafter_step0 + step, "opd_steps": step, "target_dtype": cfg.target.dtype, "loss": cfg.training.loss,
                "combine": cfg.training.combine, "nonfinite_skipped": run.skipped_total,
                "precision": run.precision.record(), "machine": machine_info(),
                "flops": opd_replay_ledger(run.drafter.config, ctx.records, cfg.rollout.teacher,
                                           step / max(1, ctx.order.steps_per_epoch)).to_dict()}
        export_drafter(run.drafter, run.export_dir, metadata=meta, dtype=cfg.target.dtype)
        return DistillResult(out, run.export_dir, step, run.total, steps_run, drafter_step0 + step, run.skipped_total,
                             last_metrics=last)
    finally:
        if initialized_here and dist.is_initialized():
            dist.destroy_process_group()
