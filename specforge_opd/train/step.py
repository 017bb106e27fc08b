"""One optimizer step of the OPD trainer, and the per-sequence replay losses it sums.

``train_step`` trains global step s (``BatchOrder``): the global denominators from
accepted counts (no forward needed), then per sequence replay forwards of at most
``training.max_blocks_per_forward`` blocks, each with its chunked lm_head/KL and its
own backward (every rank runs as many as the rank with the most,
``step_group_counts``), the all-reduce of the step's sums, clipping and the
optimizer and scheduler step (skipped when the loss or gradient is not finite).
``trainer.distill`` builds its inputs (``StepContext``) and runs it in a loop.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from specforge_opd.config import ExperimentConfig
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.train.hooks import TrainHooks
from specforge_opd.train.losses import SlotPlan, linear_kl_loss, plan_slots, slot_coefficients
from specforge_opd.train.replay import block_groups, recompute_from_target, replay_hidden, slot_teacher


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


def step_group_counts(order: BatchOrder, step: int, records: list[RolloutRecord], max_blocks_per_forward: int) -> list[list[int]]:
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
# one step


@dataclass
class StepContext:
    """What every step of one ``distill`` call reads, and no step changes.

    ``records`` and ``order``: every record (each rank holds all of them) and the batch
    layout; ``target_model``: the frozen target (its embedding and lm_head,
    ``embed_tokens`` and ``lm_head_weight``, and the whole model for
    ``training.feature_source: target``); ``layer_ids``, ``mask_id``, ``block_size``:
    the drafter's; ``autocast``: the bf16 autocast context of a single-process GPU run
    (None: none).
    """

    cfg: ExperimentConfig
    records: list[RolloutRecord]
    order: BatchOrder
    target_model: torch.nn.Module
    embed_tokens: torch.nn.Module
    lm_head_weight: torch.Tensor
    layer_ids: list[int]
    mask_id: int
    block_size: int
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    autocast: Optional[Any] = None


@dataclass
class StepResult:
    """What one ``train_step`` did.

    ``loss``, ``acc_kl_sum``, ``rej_wkl_sum``: the step's sums over the global batch
    (all ranks); ``n_acc``, ``w_rej``: its denominators; ``finite``: False when the loss
    or the gradient norm is NaN/inf (the step was then skipped); ``bad_record``: this
    rank's first record with a non-finite loss (None: none).
    """

    batch: list[RolloutRecord]
    loss: float
    acc_kl_sum: float
    rej_wkl_sum: float
    n_acc: float
    w_rej: float
    grad_norm: float
    finite: bool
    bad_record: Optional[RolloutRecord] = None


def train_step(ctx: StepContext, drafter, optimizer, scheduler, step: int, hooks: Optional[TrainHooks] = None) -> StepResult:
    """Train global step ``step`` (0-based) of ``ctx.order``: backward, clip, optimizer and scheduler step.

    Every rank calls it with the same ``step``. The gradients are zeroed at the end,
    whether the step was taken or skipped; ``hooks.on_gradients`` sees them before the
    clipping.

    Returns:
        StepResult (floats; the metrics of the step).
    Raises:
        ReplayError: a record that cannot be replayed.
    """
    tc, records, order, bs = ctx.cfg.training, ctx.records, ctx.order, ctx.block_size
    batch = [records[i] for i in order.step_indices(step)]
    plans = [plan_slots(r.accepted, bs, loss=tc.loss, rejected_decay=tc.rejected_decay, decay_from=tc.decay_from,
                        accepted_stream=tc.accepted_stream,
                        # the bonus token a_m + r_m + 1 exists unless the sequence ended inside the block
                        bonus_kept=r.anchors + r.accepted + 1 < r.input_ids.numel()) for r in batch]
    # The denominators are known from accepted counts alone, before any forward.
    n_acc = sum(p.n_acc() for p in plans)
    w_rej = sum(p.w_rej() for p in plans)
    by_index = dict(zip(order.step_indices(step), plans))
    micro = order.local_slots(step, ctx.rank)
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
                rec = recompute_from_target(ctx.target_model, rec, ctx.layer_ids, form=ctx.cfg.rollout.teacher,
                                            topk=ctx.cfg.rollout.teacher_topk, max_blocks_per_forward=tc.max_blocks_per_forward,
                                            chunk_rows=tc.chunk_slots)
            groups = sequence_group_losses(drafter, ctx.embed_tokens, ctx.lm_head_weight, rec, plan, coef, mask_token_id=ctx.mask_id,
                                           attention_backend=tc.attention_backend, chunk_slots=tc.chunk_slots,
                                           max_blocks_per_forward=tc.max_blocks_per_forward, num_groups=group_counts[mi][j])
            seq = torch.zeros(3, dtype=torch.float64)
            for _ in range(group_counts[mi][j]):
                done += 1
                if dist.is_initialized():
                    # gradients are reduced once, in the step's last backward
                    drafter.set_requires_gradient_sync(done == n_backward)
                with ctx.autocast if ctx.autocast is not None else contextlib.nullcontext():
                    loss, acc_s, rej_s = next(groups)
                (loss * ctx.world).backward()
                seq += torch.tensor([float(loss.detach()), float(acc_s), float(rej_s)], dtype=torch.float64)
            if idx is not None:
                sums += seq
                if not math.isfinite(float(seq[0])) and bad_local is None:
                    bad_local = rec
    if dist.is_initialized():
        s = sums.to(ctx.device)
        dist.all_reduce(s)
        sums = s.cpu()
    if hooks is not None:
        hooks.on_gradients(step + 1, drafter)  # 1-based, as in the metrics
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    finite = math.isfinite(float(sums[0])) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(batch, float(sums[0]), float(sums[1]), float(sums[2]), n_acc, w_rej, grad_norm, finite, bad_local)
