"""The teacher recompute as it was before it was bounded: one HF forward over all L = S + (bs-1)*M
rows with a dense [L, L] mask, every layer's hidden states and full-vocabulary logits.

Kept only as the reference the bounded ``replay.recompute_from_target`` is tested against
(same values), and as the "before" of the memory-count tests.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from specforge_opd.models.adapter import extract_context_feature
from specforge_opd.rollout.records import RolloutRecord, Teacher


def verify_mask(T: int, anchors: torch.Tensor, block_size: int, device=None) -> torch.Tensor:
    """Boolean attention mask [1, 1, L, L] of the teacher recompute forward.

    Rows/columns: the S = T-1 context tokens, then per block m the bs-1 verify
    inputs [token at a_m, d_1..d_{bs-2}]. Context is causal. Verify slot j of
    block m sees context positions < a_m and its own slots 0..j: exactly the
    KV cache and causal block of the rollout's verify step.
    """
    S = T - 1
    n = block_size - 1
    M = anchors.numel()
    L = S + M * n
    q = torch.arange(L, device=device).view(-1, 1)
    kv = torch.arange(L, device=device).view(1, -1)
    ctx_q = q < S
    blk_q = (q - S).clamp_min(0) // n
    a = anchors.to(device).view(-1)[blk_q.clamp_max(max(M - 1, 0))] if M else torch.zeros_like(q)
    ctx_part = (kv < S) & torch.where(ctx_q, kv <= q, kv < a)
    same_block = (~ctx_q) & (kv >= S) & ((kv - S) // n == blk_q) & (kv <= q)
    return (ctx_part | same_block).view(1, 1, L, L)


@torch.no_grad()
def recompute_from_target_dense(
    target,
    record: RolloutRecord,
    layer_ids: list[int],
    *,
    form: str = "full",
    topk: int = 32,
) -> RolloutRecord:
    """Context features and teacher signal from a frozen target (``feature_source: target``).

    One target forward per sequence over the verified tokens 0..T-2 and every
    block's verify inputs [token at a_m, d_1..d_{bs-2}] (``verify_mask``), at
    positions a_m + j. Features = HF ``hidden_states[k + 1]`` for k in
    ``layer_ids`` at the context rows; teacher at slot k = the output at verify
    slot k-1, final-norm hidden (``full``), top-k log-probs + log p(d_k)
    (``topk``) or log p(d_k) alone (``token``), temperature 1.

    Args:
        target: HF causal LM (eval; an sdpa/eager attention backend: it needs a 4D mask).
        form: teacher form to produce (``full``, ``topk``, ``token``).
    Returns:
        A copy of ``record`` with ``features`` and the teacher fields of ``form`` set
        (float32 on the target's device).
    """
    device = next(target.parameters()).device
    ids = record.input_ids.to(device).long()
    T, bs, M = ids.numel(), record.block_size, record.num_blocks
    n = bs - 1
    anchors = record.anchors.to(device).long()
    blocks = torch.cat([ids[anchors].view(-1, 1), record.drafts.to(device)[:, : n - 1]], dim=1)  # [M, bs-1]
    inp = torch.cat([ids[: T - 1], blocks.reshape(-1)]).view(1, -1)
    pos = torch.cat([torch.arange(T - 1, device=device), (anchors.view(-1, 1) + torch.arange(n, device=device)).view(-1)])
    out = target(
        input_ids=inp,
        position_ids=pos.view(1, -1),
        attention_mask=verify_mask(T, anchors, bs, device),
        output_hidden_states=True,
    )
    S = T - 1
    feats = extract_context_feature(out.hidden_states, layer_ids)[0, :S].float()
    if form == "full":
        return dataclasses.replace(record, features=feats, teacher=Teacher("full", hidden=out.hidden_states[-1][0, S:].float().view(M, n, -1)))
    logp = F.log_softmax(out.logits[0, S:].float(), dim=-1).view(M, n, -1)
    draft_logprob = logp.gather(-1, record.drafts.to(device).view(M, n, 1)).squeeze(-1)
    if form == "topk":
        vals, idx = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        teacher = Teacher("topk", topk_ids=idx, topk_logprobs=vals, draft_logprob=draft_logprob)
    elif form == "token":
        teacher = Teacher("token", draft_logprob=draft_logprob)
    else:
        raise ValueError(f"rollout.teacher={form!r}: expected full, topk or token")
    return dataclasses.replace(record, features=feats, teacher=teacher)


