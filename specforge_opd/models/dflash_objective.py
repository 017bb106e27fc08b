"""The DFlash SFT objective over the frozen lm_head, computed once: no recompute in the backward.

SpecForge's DFlash objective (``OnlineDFlashModel._dflash_objective_chunk_terms``) runs
the lm_head in chunks under activation checkpointing, so the backward recomputes every
chunk's logits: three vocabulary matmuls per position (forward, recompute, backward into
the hidden state). Here each chunk's logits, loss and d(loss)/d(hidden) are computed in
the forward and only that gradient (one hidden-sized row per position) is kept: two
matmuls per position, the same peak memory as one chunk of logits. Positions with zero
weight (each block's anchor slot, positions past the sequence or the loss mask, dropped
blocks) add nothing to the loss, its gradient or the accuracy, so their logits are not
computed at all.

The terms equal SpecForge's for ``loss_type: dflash`` (the unit test holds them to 1e-5
in fp32); in bf16 the softmax runs in fp32 here, so the numbers differ within bf16's
rounding. This module is plain torch: the adapter plugs it into SpecForge's model.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class _StoredGradCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i W^T + b, t_i) over rows, with d/dh computed in the forward and stored."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, loss_weights, acc_mask, chunk_rows: int, need_grad: bool):
        rows = hidden.shape[0]
        loss_num = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        step = chunk_rows if chunk_rows > 0 else max(rows, 1)
        for s in range(0, rows, step):
            t = targets[s:s + step]
            w = loss_weights[s:s + step].float()
            logits = F.linear(hidden[s:s + step], weight, bias)
            # argmax of the logits in their own dtype, as SpecForge's accuracy takes it
            correct += ((logits.argmax(dim=-1) == t) & acc_mask[s:s + step]).sum()
            logp = F.log_softmax(logits, dim=-1, dtype=torch.float32)
            del logits
            loss_num -= (logp.gather(1, t[:, None]).squeeze(1) * w).sum()
            if need_grad:
                # d CE / d logits = softmax - onehot (fp32, in place of logp); the row weight scales the
                # [rows, H] product rather than the [rows, V] probabilities
                p = logp.exp_()
                p[torch.arange(p.shape[0], device=p.device), t] -= 1.0
                grad[s:s + step] = (p.to(weight.dtype) @ weight).float().mul_(w[:, None])
        if need_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss_num, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss.to(grad.dtype), None, None, None, None, None, None, None)


def dflash_objective_terms(hidden: torch.Tensor, lm_head_weight: torch.Tensor, lm_head_bias: Optional[torch.Tensor],
                           target_ids: torch.Tensor, weight_mask: torch.Tensor, loss_weights: torch.Tensor,
                           chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SpecForge's DFlash objective terms ``(loss_num, loss_den, correct_num, accuracy_den)``, lm_head not recomputed.

    Args:
        hidden: [B, N, block_size, H] drafter output (float32 or bfloat16), differentiable.
        lm_head_weight: [V, H] frozen lm_head weight in ``hidden``'s dtype (``requires_grad`` False);
            lm_head_bias: [V] or None.
        target_ids: [B, N, block_size] int64 token ids each position predicts.
        weight_mask: [B, N, block_size] float 0/1, the positions that count (accuracy: ``> 0.5``).
        loss_weights: [B, N, block_size] float, ``weight_mask`` times any slot decay (the loss weights).
        chunk_rows: weighted positions per lm_head chunk (0: all at once); bounds the [rows, V] logits.
    Returns:
        float32 scalars: ``loss_num`` = sum of weight x CE (differentiable w.r.t. ``hidden``),
        ``loss_den`` = sum of ``loss_weights``, ``correct_num`` = argmax hits where ``weight_mask > 0.5``,
        ``accuracy_den`` = sum of ``weight_mask``.
    Raises:
        ValueError: the lm_head weight requires a gradient (this objective keeps only d/dhidden).
    """
    if lm_head_weight.requires_grad:
        raise ValueError("dflash_objective_terms: the lm_head weight must be frozen (requires_grad False); "
                         "this objective stores d(loss)/d(hidden) only")
    hidden_size = hidden.shape[-1]
    flat_w = loss_weights.reshape(-1)
    flat_acc = weight_mask.reshape(-1) > 0.5
    rows = torch.nonzero((flat_w != 0) | flat_acc).squeeze(1)
    h = hidden.reshape(-1, hidden_size).index_select(0, rows)
    loss_num, correct = _StoredGradCrossEntropy.apply(h, lm_head_weight, lm_head_bias,
                                                      target_ids.reshape(-1).index_select(0, rows),
                                                      flat_w.index_select(0, rows), flat_acc.index_select(0, rows),
                                                      int(chunk_rows), torch.is_grad_enabled() and h.requires_grad)
    return loss_num, loss_weights.sum(), correct, weight_mask.sum()
