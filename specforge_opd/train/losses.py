"""The acceptance-aware distillation objective of Draft-OPD (paper section 4.2, Eq. 1; appendix 8).

Pure functions over tensors; no model, no I/O. DESIGN.md section 4 is the spec.

Slot layout (DESIGN.md section 3): a block has ``block_size`` (bs) slots; slot 0
holds the token at the anchor, slots k = 1..bs-1 are drafted, and block m accepted
r_m of them. Slot k is *accepted* when k <= r_m, *rejected* when k > r_m.

The loss is a weighted sum over slots, ``L = sum_i c_i * KL_i``, where the
per-slot coefficient c_i depends only on accepted counts of the whole global
batch (all ranks, all accumulation micro-steps). ``plan_slots`` and
``slot_coefficients`` compute c_i before any forward pass, so the drafter's
output can be consumed in chunks (``linear_kl_loss``) and each rank's
contribution is already normalized globally.

Eq. 1 with empty terms: ``L = (la * L_acc + lr * L_rej) / (la + lr)`` where
``L_acc = S_acc / N_acc`` and ``L_rej = S_rej / W_rej``. A term whose slot set is
empty in the global batch is 0, and the denominator stays ``la + lr``: each
term keeps its fixed share of the loss (with no rejected slot,
``L = la * L_acc / (la + lr)``, i.e. half of L_acc with the default lambdas).
The alternative reading (renormalizing to ``L = L_acc``) would make a slot's
weight jump with the batch's composition; we do not do that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Loss variants (``training.loss``), all configuration of the same two terms.
LOSS_VARIANTS = ("mixed", "all_forward", "all_reverse", "naive_target_assisted")

#: Clamps of the realized-token k3 estimator: those of verl's ``low_var_kl``
#: (the paper's OPD stage was built on verl; the paper itself states no clamp).
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0
#: Probability clamp of the Bernoulli forward-KL estimator, keeps log(1 - q) finite.
BERNOULLI_EPS = 1e-6


@dataclass
class SlotPlan:
    """The trained slots of one sequence, flattened.

    Attributes (all length N = number of trained slots):
        block: int64, block index m.
        slot: int64, slot index k in 1..bs-1 (teacher index k-1; predicts position a_m + k).
        rejected: bool, slot belongs to the rejected term (L_rej) rather than L_acc.
        reverse: bool, KL direction: True = KL(q || p) (reverse), False = KL(p || q) (forward).
        weight: float32, w_k for rejected slots (``rejected_decay`` powers), 1.0 for accepted.
    """

    block: torch.Tensor
    slot: torch.Tensor
    rejected: torch.Tensor
    reverse: torch.Tensor
    weight: torch.Tensor

    @property
    def num_slots(self) -> int:
        return int(self.block.numel())

    def n_acc(self) -> float:
        """Number of accepted-term slots (the L_acc denominator's share of this sequence)."""
        return float((~self.rejected).sum())

    def w_rej(self) -> float:
        """Sum of rejected-term weights (the L_rej denominator's share)."""
        return float(self.weight[self.rejected].sum())


def plan_slots(
    accepted: torch.Tensor,
    block_size: int,
    *,
    loss: str = "mixed",
    rejected_decay: float = 0.8,
    decay_from: str = "slot1",
    accepted_stream: str = "eq1",
    bonus_kept=None,
) -> SlotPlan:
    """Which slots of a sequence are trained, in which term, direction and weight.

    Args:
        accepted: int64 [M], r_m in 0..bs-1.
        block_size: bs (slots per block, slot 0 included; the paper's K = bs - 1).
        loss: ``mixed`` (Eq. 1: forward on accepted, reverse on rejected),
            ``all_forward`` / ``all_reverse`` (same terms and weights, one direction),
            ``naive_target_assisted`` (slots 1..r_m+1, forward KL, all in the
            accepted term with weight 1: the verified trajectory only, whose
            slot r_m+1 teacher is the bonus distribution; drafts after it dropped).
        rejected_decay: w_k = rejected_decay^(k-1) (paper section 4.2, gamma = 0.8 there).
        decay_from: ``slot1`` (paper: exponent k-1) or ``first_rejected`` (exponent k-r_m-1).
        accepted_stream: ``eq1`` (paper Eq. 1: the accepted term holds slots 1..r_m) or
            ``verified`` (the authors' code: the verified trajectory 1..r_m+1, so the bonus
            slot r_m+1 of a block with r_m < bs-1 is planned twice: once in the accepted
            term, weight 1, in the accepted term's direction, and once as the rejected draft
            it also is). ``naive_target_assisted`` is the verified stream already.
        bonus_kept: bool [M], whether block m's bonus token is in the sequence. False marks
            the block a stop token or the token budget cut short: its r_m was clipped to the
            tokens kept, so its slots after r_m are not verified rejections (verification
            may have accepted them) and lie past the end of the sequence. Such a block
            trains slots 1..r_m only: no rejected suffix (as the authors' code stores none
            there), no naive bonus slot, no ``verified`` bonus entry. None: all kept.

    Returns:
        SlotPlan over the trained slots, ordered by (block, slot); a doubly planned bonus
        slot has its accepted-term entry first.

    Raises:
        ValueError: unknown ``loss`` / ``decay_from`` / ``accepted_stream``, or accepted
            counts outside 0..bs-1.
    """
    if loss not in LOSS_VARIANTS:
        raise ValueError(f"training.loss={loss!r}: expected one of {LOSS_VARIANTS}")
    if decay_from not in ("slot1", "first_rejected"):
        raise ValueError(f"training.decay_from={decay_from!r}: expected slot1 or first_rejected")
    if accepted_stream not in ("eq1", "verified"):
        raise ValueError(f"training.accepted_stream={accepted_stream!r}: expected eq1 or verified")
    accepted = accepted.long().view(-1)
    M = accepted.numel()
    if M and (int(accepted.min()) < 0 or int(accepted.max()) > block_size - 1):
        raise ValueError(f"accepted counts must lie in 0..{block_size - 1}, got {accepted.tolist()}")
    k = torch.arange(1, block_size).view(1, -1).expand(M, -1)  # [M, bs-1]
    r = accepted.view(-1, 1)
    rejected = k > r
    if loss == "naive_target_assisted":
        keep = k <= r + 1
        rejected_term = torch.zeros_like(rejected)
        reverse = torch.zeros_like(rejected)
        weight = torch.ones(k.shape, dtype=torch.float32)
    else:
        keep = torch.ones_like(rejected)
        rejected_term = rejected
        if loss == "mixed":
            reverse = rejected
        elif loss == "all_forward":
            reverse = torch.zeros_like(rejected)
        else:  # all_reverse
            reverse = torch.ones_like(rejected)
        exponent = (k - 1) if decay_from == "slot1" else (k - r - 1)
        weight = torch.where(rejected, torch.tensor(rejected_decay, dtype=torch.float64) ** exponent.double(), 1.0).float()
    cut = None
    if bonus_kept is not None:
        cut = ~torch.as_tensor(bonus_kept, dtype=torch.bool).view(-1, 1)
        keep = keep & ~(cut & (k > r))
    blocks = torch.arange(M).view(-1, 1).expand(M, block_size - 1)
    plan = SlotPlan(
        block=blocks[keep],
        slot=k[keep],
        rejected=rejected_term[keep],
        reverse=reverse[keep],
        weight=weight[keep],
    )
    if accepted_stream == "eq1" or loss == "naive_target_assisted":
        return plan
    bonus = k == r + 1  # at most one slot per block; none when all bs-1 drafts were accepted
    if cut is not None:
        bonus = bonus & ~cut
    extra_reverse = loss == "all_reverse"  # the accepted term's direction in this variant
    n = int(bonus.sum())
    merged = SlotPlan(
        block=torch.cat([plan.block, blocks[bonus]]),
        slot=torch.cat([plan.slot, k[bonus]]),
        rejected=torch.cat([plan.rejected, torch.zeros(n, dtype=torch.bool)]),
        reverse=torch.cat([plan.reverse, torch.full((n,), extra_reverse, dtype=torch.bool)]),
        weight=torch.cat([plan.weight, torch.ones(n, dtype=torch.float32)]),
    )
    # (block, slot) order, the accepted-term entry of a bonus slot before its rejected one
    key = (merged.block * block_size + merged.slot) * 2 + merged.rejected.long()
    order = torch.argsort(key, stable=True)
    return SlotPlan(*(getattr(merged, f)[order] for f in ("block", "slot", "rejected", "reverse", "weight")))


def slot_coefficients(
    plan: SlotPlan,
    n_acc: float,
    w_rej: float,
    *,
    lambda_acc: float = 1.0,
    lambda_rej: float = 1.0,
    combine: str = "eq1",
) -> torch.Tensor:
    """Per-slot coefficients c_i so that the global loss is ``sum_i c_i KL_i``.

    ``n_acc`` and ``w_rej`` are the global denominators: the count of
    accepted-term slots and the sum of rejected-term weights over the whole
    global batch (every rank and accumulation micro-step).

    * ``eq1`` (paper Eq. 1): accepted c = la / ((la + lr) n_acc); rejected
      c = lr w_k / ((la + lr) w_rej). An empty term contributes 0 and the other
      keeps its share la/(la+lr) or lr/(la+lr) (module docstring).
    * ``pooled`` (the authors' code): c = 1 / (n_acc + w_rej) accepted,
      w_k / (n_acc + w_rej) rejected.

    Returns:
        float32 [N]. All zeros when the global batch has no trained slot.

    Raises:
        ValueError: unknown ``combine``, or both lambdas zero with ``eq1``.
    """
    w = plan.weight.float()
    if combine == "pooled":
        den = n_acc + w_rej
        if den <= 0:
            return torch.zeros_like(w)
        return torch.where(plan.rejected, w, torch.ones_like(w)) / den
    if combine != "eq1":
        raise ValueError(f"training.combine={combine!r}: expected eq1 or pooled")
    lam = lambda_acc + lambda_rej
    if lam <= 0:
        raise ValueError("training.lambda_acc + training.lambda_rej must be > 0 (set either to 1.0)")
    c_acc = lambda_acc / (lam * n_acc) if n_acc > 0 else 0.0
    c_rej = lambda_rej / (lam * w_rej) if w_rej > 0 else 0.0
    return torch.where(plan.rejected, w * c_rej, torch.full_like(w, c_acc))


# ---------------------------------------------------------------------------
# KL estimators per teacher form; every function returns per-slot KL, float32 [N]


def kl_from_logprobs(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) = sum_y p(y) (log p(y) - log q(y)) over the last axis.

    Args: log-probabilities [..., V] of two normalized distributions (any float dtype).
    Returns: float32 [...]. Categories with p = 0 contribute 0 (no NaN from 0 * -inf).
    """
    logp = logp.float()
    logq = logq.float()
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))
    return (p * diff).sum(-1)


def kl_full(student_logits: torch.Tensor, teacher_logits: torch.Tensor, reverse: torch.Tensor) -> torch.Tensor:
    """Exact per-slot KL over the full vocabulary (teacher form ``full``).

    Args:
        student_logits: [N, V], drafter hidden through the frozen target lm_head (q).
        teacher_logits: [N, V], the verify pass's final hidden through the same lm_head (p).
        reverse: bool [N]; False = forward KL(p || q) (paper appendix 8, accepted),
            True = reverse KL(q || p) (rejected).
    Returns:
        float32 [N], >= 0. Both distributions at temperature 1, unfiltered.
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)
    logp = F.log_softmax(teacher_logits.float(), dim=-1)
    # One pass per row in its own direction: KL = sum_y w(y) (log p - log q) with
    # w = p (forward) or -q (reverse). log_softmax of finite logits is finite, so
    # no 0 * -inf guard is needed here.
    diff = logp - logq
    w = torch.where(reverse.view(-1, 1), -logq.exp(), logp.exp())
    return (w * diff).sum(-1)


def kl_full_and_grad(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, reverse: torch.Tensor, *, inplace: bool = False
):
    """``kl_full`` and its gradient with respect to the student logits, in closed form.

    With q = softmax(z), D = log q - log p (paper appendix 8 terms):
    forward KL(p || q) = -sum_y p D, d/dz = q - p;
    reverse KL(q || p) = sum_y q D, d/dz = q (D - KL).
    Same values as autograd through ``kl_full`` with fewer passes over [N, V]
    (the trainer's hot loop with the ``full`` teacher).

    Args: as ``kl_full``; ``inplace=True`` reuses the two (float32) logits
        tensors as work buffers, which overwrites them: peak memory is then
        two [N, V] float32 buffers beyond the inputs' own, three with the result.
    Runs in float32 with autocast disabled (under bf16 autocast the row dot
    products would otherwise run in bf16).

    Returns: (kl float32 [N], grad float32 [N, V]).
    """
    with torch.autocast(student_logits.device.type, enabled=False):
        return _kl_full_and_grad(student_logits, teacher_logits, reverse, inplace)


def _kl_full_and_grad(student_logits, teacher_logits, reverse, inplace):
    z, t = student_logits.float(), teacher_logits.float()
    if not inplace:
        z, t = z.clone(), t.clone()
    # Shift by the row max before the log-sum-exp (as log_softmax does): subtracting
    # a large lse directly rounds log q at the spacing of the largest logit.
    logq = z.sub_(z.amax(-1, keepdim=True))
    logq = logq.sub_(torch.logsumexp(logq, -1, keepdim=True))
    logp = t.sub_(t.amax(-1, keepdim=True))
    logp = logp.sub_(torch.logsumexp(logp, -1, keepdim=True))
    q = logq.exp()
    d = logq.sub_(logp)  # D, in the log q buffer
    p = logp.exp_()  # p, in the log p buffer
    # Row dot products through one reused buffer, not einsum: a matmul there
    # would run in TF32 wherever a user enables it.
    tmp = torch.mul(q, d)
    kl_rev = tmp.sum(-1)
    kl_fwd = -torch.mul(p, d, out=tmp).sum(-1)
    del tmp
    kl = torch.where(reverse, kl_rev, kl_fwd)
    rev = reverse.view(-1, 1)
    grad = torch.where(rev, d.sub_(kl.view(-1, 1)).mul_(q), p.neg_().add_(q))
    return kl, grad


def kl_topk(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_logprob: torch.Tensor,
    reverse: torch.Tensor,
) -> torch.Tensor:
    """Per-slot KL on a coarsened vocabulary (teacher form ``topk``).

    The categories are the teacher's top-k ids, the drafted token (when it is not
    among them: a rejected draft usually is not), and one tail bucket holding the
    remaining mass on both sides. KL between the two coarsened distributions is a
    true KL (hence >= 0) and a lower bound of the full KL (data processing); it
    equals ``kl_full`` when k = V.

    Args:
        student_logits: [N, V].
        topk_ids: int64 [N, k]; topk_logprobs: [N, k] teacher log-probs (temperature 1).
        draft_ids: int64 [N], d_{m,k}; draft_logprob: [N], the teacher's log p(d_{m,k}).
        reverse: bool [N] (see ``kl_full``).
    Returns:
        float32 [N], >= 0.
    """
    logits = student_logits.float()
    N, V = logits.shape
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    draft_ids = draft_ids.view(-1, 1)
    draft_new = ~(topk_ids == draft_ids).any(-1, keepdim=True)  # [N, 1]
    ids = torch.cat([topk_ids, draft_ids], dim=1)  # [N, k+1]
    logq_ids = logits.gather(1, ids) - lse
    # Top-k ids are distinct, so the support has k + [draft is new] ids; the tail
    # is absent only when that is the whole vocabulary. The student tail mass is
    # 1 - sum over the support (accumulated in float64), clamped at 0: no pass
    # over [N, V] beyond the logsumexp.
    tail_present = (topk_ids.shape[1] + draft_new.long()) < V
    q_support = torch.where(torch.cat([torch.ones_like(topk_ids, dtype=torch.bool), draft_new], 1), logq_ids.exp(), torch.zeros_like(logq_ids))
    q_tail = (1.0 - q_support.double().sum(-1, keepdim=True)).float().clamp_min(0.0)
    logq_tail = torch.where(tail_present, q_tail.clamp_min(1e-30).log(), torch.zeros_like(lse))

    logp_ids = torch.cat([topk_logprobs.float(), draft_logprob.float().view(-1, 1)], dim=1)
    valid = torch.cat([torch.ones_like(topk_ids, dtype=torch.bool), draft_new], dim=1)
    p_ids = torch.where(valid, logp_ids.exp(), torch.zeros_like(logp_ids))
    # Stored log-probs can sum to slightly more than 1 after rounding: the tail
    # is clamped at 0, never negative.
    p_tail = torch.where(tail_present, (1.0 - p_ids.sum(-1, keepdim=True)).clamp_min(0.0), torch.zeros_like(lse))
    logp_tail = p_tail.clamp_min(1e-30).log()

    logp_all = torch.cat([torch.where(valid, logp_ids, torch.zeros_like(logp_ids)), logp_tail], dim=1)
    logq_all = torch.cat([torch.where(valid, logq_ids, torch.zeros_like(logq_ids)), logq_tail], dim=1)
    present = torch.cat([valid, tail_present], dim=1)
    p_all = torch.cat([p_ids, p_tail], dim=1)
    q_all = torch.where(present, logq_all.exp(), torch.zeros_like(logq_all))
    fwd = (p_all * (logp_all - logq_all)).sum(-1)
    rev = (q_all * (logq_all - logp_all)).sum(-1)
    return torch.where(reverse, rev, fwd)


def kl_token(
    student_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_logprob: torch.Tensor,
    reverse: torch.Tensor,
) -> torch.Tensor:
    """Realized-token estimators of the authors (teacher form ``token``): a surrogate, not an unbiased KL.

    * forward: Bernoulli KL between "the slot emits d" under p and under q:
      ``p_d log(p_d/q_d) + (1-p_d) log((1-p_d)/(1-q_d))``, probabilities clamped
      to [1e-6, 1-1e-6]. A lower bound of KL(p || q).
    * reverse: k3 = exp(delta) - delta - 1 with delta = log p(d) - log q(d),
      delta clamped to [-20, 20] and the value to [-10, 10] (verl's clamps). k3 is
      unbiased for KL(q || p) only when d ~ q; DFlash drafts are the argmax, so
      here it is a surrogate that penalizes the drafter's own mode where the
      teacher disagrees.

    Args:
        student_logits: [N, V]; draft_ids: int64 [N]; draft_logprob: [N] teacher log p(d);
        reverse: bool [N].
    Returns:
        float32 [N], >= 0.
    """
    logq_d = F.log_softmax(student_logits.float(), dim=-1).gather(1, draft_ids.view(-1, 1)).squeeze(1)
    logp_d = draft_logprob.float()
    p = logp_d.exp().clamp(BERNOULLI_EPS, 1 - BERNOULLI_EPS)
    q = logq_d.exp().clamp(BERNOULLI_EPS, 1 - BERNOULLI_EPS)
    bern = p * (p.log() - q.log()) + (1 - p) * ((1 - p).log() - (1 - q).log())
    delta = (logp_d - logq_d).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    k3 = (delta.exp() - delta - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
    return torch.where(reverse, k3, bern)


def slot_kl(
    student_logits: torch.Tensor,
    reverse: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
    draft_logprob: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-slot KL of a chunk, the teacher form picked by which tensors are given.

    ``teacher_logits`` -> ``kl_full``; ``topk_ids`` -> ``kl_topk``; else ``kl_token``.
    Args: student_logits [n, V]; reverse bool [n]; teacher tensors as in those functions.
    Returns: float32 [n].
    """
    if teacher_logits is not None:
        return kl_full(student_logits, teacher_logits, reverse)
    if topk_ids is not None:
        return kl_topk(student_logits, topk_ids, topk_logprobs, draft_ids, draft_logprob, reverse)
    return kl_token(student_logits, draft_ids, draft_logprob, reverse)


class _PrecomputedGrad(torch.autograd.Function):
    """Attach a gradient computed during the forward pass: d loss / d input = ``grad``."""

    @staticmethod
    def forward(ctx, inp, value, grad):
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None


def _chunk_kl_and_grad(logits, teacher_logits, reverse, coef, need_grad, **token_teacher):
    """Per-slot KL [n] of one chunk and, when ``need_grad``, d(sum coef KL)/d logits [n, V] (else None).

    ``token_teacher``: the topk/token teacher tensors of the chunk (``slot_kl``'s keywords).
    """
    if not need_grad:
        return slot_kl(logits, reverse, teacher_logits, **token_teacher), None
    if teacher_logits is not None:
        kl, g = kl_full_and_grad(logits, teacher_logits, reverse, inplace=True)
        return kl, g.mul_(coef.view(-1, 1))
    # topk/token: autograd over the fp32 logits only (a leaf here; the matmul stays outside)
    with torch.enable_grad():
        logits.requires_grad_(True)
        kl = slot_kl(logits, reverse, **token_teacher)
        (g,) = torch.autograd.grad((coef * kl).sum(), logits)
    return kl.detach(), g


def linear_kl_loss(
    student_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    coef: torch.Tensor,
    reverse: torch.Tensor,
    rejected: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_slots: int = 1024,
    teacher_hidden: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
    draft_logprob: torch.Tensor | None = None,
):
    """``sum_i coef_i KL_i`` through the frozen lm_head, in chunks, with its gradient computed in the forward.

    Student logits = ``student_hidden @ lm_head_weight.T`` (matmul in the
    lm_head's dtype, KL in fp32). For each chunk of ``chunk_slots`` slots the
    dense logits exist once: the chunk's KL is evaluated, the gradient with
    respect to the logits is taken right away and projected back through the
    lm_head (``g @ W``), and the logits are freed. The backward pass then only
    scales the stored [N, H] gradient. This is the fused-linear-loss pattern:
    per slot it costs one vocabulary matmul for the student, one for the
    ``full`` teacher and one for the gradient, where activation checkpointing
    (SpecForge's ``checkpointed_chunk_reduce``) would redo the student and
    teacher matmuls in the backward (5 against 3 for ``full``, 3 against 2 for
    ``topk``/``token``). The ``full`` gradient is closed form (``kl_full_and_grad``),
    the others use autograd over the chunk's logits only. Values and gradients
    equal plain autograd through the dense loss.

    Args:
        student_hidden: [N, H] drafter outputs at the trained slots (any float dtype).
        lm_head_weight: [V, H], frozen (must not require grad).
        coef: float32 [N] (``slot_coefficients``); reverse, rejected: bool [N]; weight: float32 [N].
        chunk_slots: slots per chunk (> 0); bounds the fp32 [chunk, V] buffers.
        teacher_hidden: [N, H] verify-pass final hidden (``full``), or
        topk_ids/topk_logprobs [N, k] (``topk``), plus draft_ids/draft_logprob [N] (``topk``/``token``).
    Returns:
        (loss, acc_kl_sum, rej_wkl_sum): 0-dim float32. ``loss`` carries the
        gradient to ``student_hidden``; the sums (detached) feed the L_acc / L_rej
        metrics (accepted-slot KL sum, rejected-slot ``w_k``-weighted KL sum).
        Double backward raises (the gradient is precomputed, not differentiable).
    Raises:
        ValueError: ``chunk_slots`` < 1, an empty slot set, per-slot tensors whose
            first dimension is not N, or an lm_head that requires grad.
    """
    if chunk_slots < 1:
        raise ValueError(f"training.chunk_slots={chunk_slots}: must be >= 1")
    if lm_head_weight.requires_grad:
        raise ValueError("the target lm_head is frozen in Draft-OPD; call requires_grad_(False) on it")
    n = student_hidden.shape[0]
    if n == 0:
        raise ValueError("linear_kl_loss received no slots")
    token_teacher = dict(topk_ids=topk_ids, topk_logprobs=topk_logprobs, draft_ids=draft_ids, draft_logprob=draft_logprob)
    per_slot = dict(coef=coef, reverse=reverse, rejected=rejected, weight=weight, teacher_hidden=teacher_hidden, **token_teacher)
    for name, x in per_slot.items():
        if x is not None and x.shape[0] != n:
            raise ValueError(f"linear_kl_loss: {name} has {x.shape[0]} slots, student_hidden has {n}; pass tensors aligned per slot")
    w = lm_head_weight
    need_grad = torch.is_grad_enabled() and student_hidden.requires_grad
    h = student_hidden.detach()
    grad_h = torch.empty_like(h) if need_grad else None
    zero = torch.zeros((), dtype=torch.float32, device=h.device)
    loss, acc, rej = zero, zero, zero
    for start in range(0, n, chunk_slots):
        sl = slice(start, min(n, start + chunk_slots))
        with torch.no_grad():
            logits = (h[sl].to(w.dtype) @ w.t()).float()
            teacher_logits = None if teacher_hidden is None else (teacher_hidden[sl].to(w.dtype) @ w.t()).float()
        chunk_teacher = {k: None if v is None else v[sl] for k, v in token_teacher.items()}
        kl, g = _chunk_kl_and_grad(logits, teacher_logits, reverse[sl], coef[sl], need_grad, **chunk_teacher)
        chunk_loss = (coef[sl] * kl).sum()
        if need_grad:
            grad_h[sl] = (g.to(w.dtype) @ w).to(h.dtype)
            del g
        del logits, teacher_logits
        kd = kl.detach()
        rj = rejected[sl]
        loss = loss + chunk_loss
        acc = acc + torch.where(rj, torch.zeros_like(kd), kd).sum()
        rej = rej + torch.where(rj, kd * weight[sl], torch.zeros_like(kd)).sum()
    if need_grad:
        loss = _PrecomputedGrad.apply(student_hidden, loss, grad_h)
    return loss, acc, rej
