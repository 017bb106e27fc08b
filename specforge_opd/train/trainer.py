"""The OPD trainer: replay rollout shards, acceptance-aware KL, FSDP2 over the drafter (paper section 4.2).

``distill`` reads top to bottom:

1. distributed setup (``torchrun``: gloo on CPUs, NCCL on GPUs; a plain
   process works as world size 1), the frozen target (embedding + lm_head, and
   the whole model for ``feature_source: target``), the drafter;
2. records from shards, a fixed global batch order per epoch;
3. FSDP2 (``fully_shard`` per drafter layer, then the root), AdamW, SpecForge's
   cosine-with-warmup schedule; resume from the latest checkpoint;
4. per step: global denominators from accepted counts (no forward needed),
   per sequence: replay forwards of at most ``training.max_blocks_per_forward``
   blocks, each with its chunked lm_head/KL and its own backward (every rank runs
   as many as the rank with the most, ``step_group_counts``), clip, step;
   non-finite guard; metrics; periodic checkpoints;
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

import contextlib
import copy
import hashlib
import json
import math
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
from specforge_opd.models.adapter import optimizer_and_scheduler
from specforge_opd.models.drafter import (
    check_compatible,
    drafter_layer_ids,
    drafter_mask_token_id,
    load_drafter,
    read_drafter_metadata,
)
from specforge_opd.precision import announce, machine_info, resolve_trainer
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.train.checkpoint import (
    CheckpointError,
    export_drafter,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from specforge_opd.train.losses import SlotPlan, linear_kl_loss, plan_slots, slot_coefficients
from specforge_opd.train.replay import block_groups, recompute_from_target, replay_hidden, slot_teacher


class DistillError(UserError, ValueError):
    """The trainer's inputs do not fit together (no drafter, no shards, shards of another block size or teacher form)."""


class NonFiniteError(UserError, RuntimeError):
    """Too many consecutive steps with a NaN/inf loss or gradient; a checkpoint was saved first."""


class InjectedFault(RuntimeError):
    """Raised by ``distill(fault_after_steps=N)``: a simulated kill, for resume tests."""


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


@dataclass
class BatchOrder:
    """Which records step s trains, on which rank and micro-step; a pure function of the step.

    Resume needs only the step counter: there is no iterator state to lose.
    """

    num_records: int
    batch_size: int
    accumulation_steps: int
    world_size: int
    num_epochs: int
    seed: int
    shuffle: bool = True

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_records / self.global_batch)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.num_epochs

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def step_indices(self, step: int) -> list[int]:
        """Record indices of global step ``step`` (0-based), in micro-step-major, then rank order."""
        epoch, i = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_records, generator=g).tolist()
        else:
            order = list(range(self.num_records))
        return order[i * self.global_batch : (i + 1) * self.global_batch]

    def local_slots(self, step: int, rank: int) -> list[list[Optional[int]]]:
        """[micro_step][j] -> record index for ``rank`` (None = padding of a short last batch)."""
        idx = self.step_indices(step)
        out = []
        for m in range(self.accumulation_steps):
            start = (m * self.world_size + rank) * self.batch_size
            chunk = idx[start : start + self.batch_size]
            out.append(chunk + [None] * (self.batch_size - len(chunk)))
        return out


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
    from specforge_opd.rollout.shards import read_shards

    out = []
    for d in shard_dirs:
        for rec in read_shards(d, expect):
            rec.extra.setdefault("shard_dir", str(d))
            out.append(rec)
    return out


# ---------------------------------------------------------------------------
# distributed + model setup


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
        from specforge_opd.models.target import load_target

        target = load_target(cfg.target)
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
# one sequence


def sequence_group_losses(
    drafter,
    embed_tokens,
    lm_head_weight: torch.Tensor,
    record: RolloutRecord,
    plan: SlotPlan,
    coef: torch.Tensor,
    *,
    mask_token_id: int,
    attention_backend: str = "sdpa",
    chunk_slots: int = 1024,
    max_blocks_per_forward: Optional[int] = None,
    num_groups: Optional[int] = None,
):
    """Replay one sequence in groups of blocks; yield each group's (loss, acc_kl_sum, rej_wkl_sum).

    The loss ``sum_i coef_i KL_i`` over the planned slots (normalized over the
    global batch, ``losses.slot_coefficients``) is a sum over slots, and a slot's
    drafter output depends only on its own block and the context before its anchor
    (paper section 4.2, "Replay"), so it splits exactly over groups of at most
    ``max_blocks_per_forward`` blocks (``replay.block_groups``): the caller runs
    ``backward`` on each yielded loss before taking the next, and only one group's
    activations are alive at a time. The summed gradient equals one forward over
    all blocks. Within a group the lm_head and KL run in chunks of ``chunk_slots``
    slots (``losses.linear_kl_loss``).

    Args:
        num_groups: yield exactly this many losses (>= the record's own groups);
            the extra ones replay the first group with zero weight, so that every
            FSDP2 rank runs the same number of forwards and backwards.
    Yields:
        (loss, acc_kl_sum, rej_wkl_sum), 0-dim float32; ``loss`` carries the gradient.
    Raises:
        ValueError: ``num_groups`` smaller than the record's group count.
    """
    groups = block_groups(record.num_blocks, max_blocks_per_forward)
    if num_groups is not None and num_groups < len(groups):
        raise ValueError(f"num_groups={num_groups} < the {len(groups)} groups of record {record.sample_id}")
    pad = (num_groups or len(groups)) - len(groups)
    whole = len(groups) == 1
    for gi, (b0, b1) in enumerate(groups + groups[:1] * pad):
        h = replay_hidden(drafter, embed_tokens, record, mask_token_id, attention_backend, blocks=None if whole else (b0, b1))
        device = h.device
        sel = (plan.block >= b0) & (plan.block < b1)
        if not bool(sel.any()):
            zero = (h.float().sum() * 0.0).view(())
            yield zero, zero.detach(), zero.detach()
            continue
        sub = SlotPlan(*(getattr(plan, f)[sel] for f in ("block", "slot", "rejected", "reverse", "weight")))
        c = coef[sel] if gi < len(groups) else torch.zeros_like(coef[sel])
        hs = h[(sub.block - b0).to(device), sub.slot.to(device)]  # slot k of block m
        yield linear_kl_loss(
            hs,
            lm_head_weight,
            c.to(device),
            sub.reverse.to(device),
            sub.rejected.to(device),
            sub.weight.to(device),
            chunk_slots=chunk_slots,
            **slot_teacher(record, sub, device),
        )


def sequence_loss(
    drafter,
    embed_tokens,
    lm_head_weight: torch.Tensor,
    record: RolloutRecord,
    plan: SlotPlan,
    coef: torch.Tensor,
    *,
    mask_token_id: int,
    attention_backend: str = "sdpa",
    chunk_slots: int = 1024,
    max_blocks_per_forward: Optional[int] = None,
):
    """Replay one sequence and return its (loss, acc_kl_sum, rej_wkl_sum), 0-dim float32.

    The sum of ``sequence_group_losses`` (one group by default). ``loss`` keeps
    every group's graph until its backward: the trainer backpropagates group by
    group instead; this form is for benchmarks and tests.
    """
    total = [torch.zeros((), dtype=torch.float32) for _ in range(3)]
    for parts in sequence_group_losses(drafter, embed_tokens, lm_head_weight, record, plan, coef, mask_token_id=mask_token_id,
                                       attention_backend=attention_backend, chunk_slots=chunk_slots,
                                       max_blocks_per_forward=max_blocks_per_forward):
        total = [t.to(p.device) + p for t, p in zip(total, parts)]
    return tuple(total)


def step_group_counts(order: "BatchOrder", step: int, records: list[RolloutRecord], max_blocks_per_forward: int) -> list[list[int]]:
    """[micro_step][j] -> the most replay groups any rank has at that position of step ``step``.

    Every rank holds every record (``load_records``), so this needs no
    communication; ranks pad to it (``sequence_group_losses(num_groups=...)``)
    and FSDP2's all-gathers and reduce-scatters stay paired across ranks.
    """
    per_rank = [order.local_slots(step, r) for r in range(order.world_size)]
    pad_index = order.step_indices(step)[0]  # a rank without a record replays this one (zero weight)
    out = []
    for m in range(order.accumulation_steps):
        row = []
        for j in range(order.batch_size):
            n = 1
            for r in range(order.world_size):
                idx = per_rank[r][m][j]
                idx = pad_index if idx is None else idx
                n = max(n, len(block_groups(records[idx].num_blocks, max_blocks_per_forward)))
            row.append(n)
        out.append(row)
    return out


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
    fault_after_steps: Optional[int] = None,
    on_gradients=None,
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
        fault_after_steps: raise ``InjectedFault`` after this many steps of this call (tests).
        on_gradients: ``fn(step, drafter)`` called on every rank after the backward
            passes of a step, before clipping (gradient statistics, tests).
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
    tc = cfg.training
    out = Path(out_dir if out_dir is not None else cfg.output.dir)
    rank, world, device, initialized_here = _setup_distributed()
    try:
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
        total = order.total_steps
        fingerprint = data_fingerprint(records, order)

        # 3. sharding, optimizer, schedule, resume
        precision = resolve_trainer(tc.mixed_precision, device.type)
        if rank == 0:
            announce(precision, "distill")
        bf16 = precision.value == "bf16"
        if dist.is_initialized():
            drafter = _shard(drafter, device, bf16)
        else:
            drafter.to(device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if (bf16 and device.type == "cuda" and not dist.is_initialized()) else None
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
        scheduler = _scheduler(optimizer, cfg, total if schedule is None else int(schedule[1]))
        ckpt_root = out / "checkpoints"
        step, skipped_total, nonfinite_run = 0, 0, 0
        ckpt = latest_checkpoint(ckpt_root) if resume else None
        if ckpt is not None:
            state = load_checkpoint(ckpt, drafter, optimizer)
            if state.get("fingerprint") != fingerprint:
                raise CheckpointError(
                    f"{ckpt} was written for other data or batch layout (fingerprint {state.get('fingerprint')} != {fingerprint}); "
                    f"use a fresh --out, or the same shards and training.batch_size/accumulation_steps/num_epochs/seed and world size"
                )
            scheduler.load_state_dict(state["scheduler"])
            step, skipped_total, nonfinite_run = int(state["step"]), int(state["nonfinite_skipped"]), int(state["nonfinite_run"])
        else:
            prev = latest_checkpoint(carry_from) if carry_from is not None and Path(carry_from).is_dir() else None
            if prev is not None:
                prev_state = load_checkpoint(prev, drafter, optimizer)
                scheduler.load_state_dict(prev_state["scheduler"])
            elif schedule is not None:
                for _ in range(int(schedule[0])):
                    scheduler.step()
        metrics = MetricsLog(out, cfg, rank, step)
        export_dir = out / "final"

        def trainer_state():
            return {
                "fingerprint": fingerprint,
                "epoch": order.epoch_of(step) if step < total else tc.num_epochs,
                "cursor_in_epoch": step % order.steps_per_epoch,
                "total_steps": total,
                "scheduler": scheduler.state_dict(),
                "nonfinite_skipped": skipped_total,
                "nonfinite_run": nonfinite_run,
                "drafter_step0": drafter_step0,
                "world_size": world,
            }

        if step >= total:
            if rank == 0:
                print(f"distill: {ckpt} is already at the last step {step}/{total}; no step left to train (use a fresh --out for a new run)", file=sys.stderr)
            if not (export_dir / "config.json").is_file():
                export_drafter(drafter, export_dir, metadata={"step": drafter_step0 + step, "opd_steps": step,
                                                               "target_dtype": cfg.target.dtype,
                                                               "precision": precision.record()}, dtype=cfg.target.dtype)
            return DistillResult(out, export_dir, step, total, 0, drafter_step0 + step, skipped_total, already_complete=True)

        # 4. the loop
        bar = None
        if progress and rank == 0:
            bar = progress_bar(total, "distill", "step", initial=step)
        steps_run, last = 0, {}
        while step < total:
            t0 = time.perf_counter()
            batch = [records[i] for i in order.step_indices(step)]
            plans = [plan_slots(r.accepted, bs, loss=tc.loss, rejected_decay=tc.rejected_decay, decay_from=tc.decay_from,
                                accepted_stream=tc.accepted_stream,
                                # the bonus token a_m + r_m + 1 exists unless the sequence ended inside the block
                                bonus_kept=r.anchors + r.accepted + 1 < r.input_ids.numel()) for r in batch]
            # The denominators are known from accepted counts alone, before any forward.
            n_acc = sum(p.n_acc() for p in plans)
            w_rej = sum(p.w_rej() for p in plans)
            by_index = dict(zip(order.step_indices(step), plans))
            micro = order.local_slots(step, rank)
            group_counts = step_group_counts(order, step, records, tc.max_blocks_per_forward)
            sums = torch.zeros(3, dtype=torch.float64)  # loss, acc_kl_sum, rej_wkl_sum
            bad_local = None
            n_backward = sum(sum(row) for row in group_counts)
            done = 0
            for mi, mb in enumerate(micro):
                for j, idx in enumerate(mb):
                    rec = records[idx] if idx is not None else batch[0]
                    plan = by_index[idx] if idx is not None else plans[0]
                    coef = slot_coefficients(plan, n_acc, w_rej, lambda_acc=tc.lambda_acc, lambda_rej=tc.lambda_rej, combine=tc.combine)
                    if idx is None:
                        coef = torch.zeros_like(coef)  # padding: keeps FSDP2 collectives aligned
                    if tc.feature_source == "target":
                        rec = recompute_from_target(target_model, rec, layer_ids, form=cfg.rollout.teacher, topk=cfg.rollout.teacher_topk,
                                                    max_blocks_per_forward=tc.max_blocks_per_forward, chunk_rows=tc.chunk_slots)
                    groups = sequence_group_losses(drafter, embed_tokens, lm_head_weight, rec, plan, coef, mask_token_id=mask_id,
                                                   attention_backend=tc.attention_backend, chunk_slots=tc.chunk_slots,
                                                   max_blocks_per_forward=tc.max_blocks_per_forward, num_groups=group_counts[mi][j])
                    seq = torch.zeros(3, dtype=torch.float64)
                    for _ in range(group_counts[mi][j]):
                        done += 1
                        if dist.is_initialized():
                            # gradients are reduced once, in the step's last backward
                            drafter.set_requires_gradient_sync(done == n_backward)
                        with autocast if autocast is not None else contextlib.nullcontext():
                            loss, acc_s, rej_s = next(groups)
                        (loss * world).backward()
                        seq += torch.tensor([float(loss.detach()), float(acc_s), float(rej_s)], dtype=torch.float64)
                    if idx is not None:
                        sums += seq
                        if not math.isfinite(float(seq[0])) and bad_local is None:
                            bad_local = rec
            if dist.is_initialized():
                s = sums.to(device)
                dist.all_reduce(s)
                sums = s.cpu()
            if on_gradients is not None:
                on_gradients(step + 1, drafter)  # 1-based, as in the metrics
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            finite = math.isfinite(float(sums[0])) and math.isfinite(grad_norm)
            step += 1
            if finite:
                optimizer.step()
                scheduler.step()
                nonfinite_run = 0
            else:
                skipped_total += 1
                nonfinite_run += 1
            optimizer.zero_grad(set_to_none=True)
            if not finite and nonfinite_run >= tc.max_nonfinite_steps:
                where = bad_local or batch[0]
                save_checkpoint(ckpt_root, step, drafter, optimizer, trainer_state())  # prunes nothing: older ones are the good ones
                raise NonFiniteError(
                    f"step {step}: non-finite loss or gradient for {nonfinite_run} steps in a row "
                    f"(training.max_nonfinite_steps={tc.max_nonfinite_steps}); record {where.sample_id} of shard "
                    f"{where.extra.get('shard_dir', '<in memory>')}; checkpoint saved in {ckpt_root}; "
                    f"inspect that shard or lower training.learning_rate"
                )
            dt = time.perf_counter() - t0
            positions = sum(r.num_blocks * bs for r in batch)
            last = {
                "step": step,
                "epoch": order.epoch_of(step - 1),
                "loss": float(sums[0]),
                "L_acc": float(sums[1]) / n_acc if n_acc else 0.0,
                "L_rej": float(sums[2]) / w_rej if w_rej else 0.0,
                "grad_norm": grad_norm,
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": sum(int(r.input_ids.numel()) for r in batch) / dt,
                "positions_per_s": positions / dt,
                "accepted_fraction": sum(int(r.accepted.sum()) for r in batch) / max(1, sum(r.num_blocks * (bs - 1) for r in batch)),
                "policy_lag": sum(drafter_step0 + step - 1 - r.drafter_step for r in batch) / len(batch),
                "sequences": len(batch),
                "nonfinite_skipped": skipped_total,
                "skipped": not finite,
                "mixed_precision": precision.value,
            }
            if step % tc.log_interval == 0 or step == total:
                metrics.log(last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}", refresh=False)
            if step % tc.checkpoint_interval == 0 or step == total:
                save_checkpoint(ckpt_root, step, drafter, optimizer, trainer_state(), keep=tc.keep_checkpoints)
            steps_run += 1
            if fault_after_steps is not None and steps_run >= fault_after_steps and step < total:
                raise InjectedFault(f"injected fault after step {step}")
        if bar is not None:
            bar.close()
        metrics.close()

        # 5. export
        from specforge_opd.eval.flops import opd_replay_ledger

        meta = {"step": drafter_step0 + step, "opd_steps": step, "target_dtype": cfg.target.dtype, "loss": tc.loss, "combine": tc.combine, "nonfinite_skipped": skipped_total,
                "precision": precision.record(), "machine": machine_info(),
                "flops": opd_replay_ledger(drafter.config, records, cfg.rollout.teacher, step / max(1, order.steps_per_epoch)).to_dict()}
        export_drafter(drafter, export_dir, metadata=meta, dtype=cfg.target.dtype)
        return DistillResult(out, export_dir, step, total, steps_run, drafter_step0 + step, skipped_total, last_metrics=last)
    finally:
        if initialized_here and dist.is_initialized():
            dist.destroy_process_group()
