"""Replay: rebuild the drafter's inputs from a rollout record (paper section 4.2, "Replay").

For one ``RolloutRecord`` the drafter sees, in ONE forward, the stored target
context features of the verified sequence and one block per recorded anchor:
slot 0 = the token at the anchor, slots 1..bs-1 = MASK. SpecForge's DFlash mask
(``create_dflash_sdpa_mask`` on CPU, ``create_dflash_block_mask`` with
flex_attention on GPU) lets a block see context rows strictly before its anchor
and its own block, nothing else, which is exactly what the drafter saw when it
drafted that block during the rollout. Slot k of block m predicts the token at
position a_m + k (DESIGN.md section 3; ``tests/test_replay.py`` pins it).

The teacher side lives here too: ``recompute_from_target`` rebuilds context
features and the teacher signal with a frozen target (``feature_source:
target``), one target forward per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from .adapter import create_dflash_block_mask, create_dflash_sdpa_mask, extract_context_feature
from .losses import SlotPlan
from .records import RolloutRecord


class ReplayError(ValueError):
    """A record cannot be replayed (missing features or teacher signal, wrong shapes)."""


def replay_inputs(record: RolloutRecord, mask_token_id: int, device=None):
    """Drafter inputs for all blocks of one sequence.

    Returns:
        (noise_ids, position_ids, anchors):
        noise_ids int64 [1, M*bs]: block m = [input_ids[a_m], MASK, ..., MASK];
        position_ids int64 [1, S + M*bs]: context 0..S-1 then a_m + j for slot j;
        anchors int64 [1, M]. S = T-1 context rows (``features`` rows).
    """
    bs = record.block_size
    anchors = record.anchors.to(device=device, dtype=torch.long)
    ids = record.input_ids.to(device=device, dtype=torch.long)
    M = anchors.numel()
    S = ids.numel() - 1
    noise = torch.full((M, bs), int(mask_token_id), dtype=torch.long, device=device)
    noise[:, 0] = ids[anchors]
    offsets = torch.arange(bs, device=device)
    pos = torch.cat([torch.arange(S, device=device), (anchors.view(-1, 1) + offsets).view(-1)])
    return noise.view(1, -1), pos.view(1, -1), anchors.view(1, -1)


def replay_hidden(
    drafter,
    embed_tokens: torch.nn.Module,
    record: RolloutRecord,
    mask_token_id: int,
    attention_backend: str = "sdpa",
    features: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drafter outputs for every block of ``record`` in one forward.

    Args:
        drafter: ``DFlashDraftModel`` (possibly FSDP2-sharded).
        embed_tokens: the target's frozen input embedding.
        features: [T-1, n*H] context features; default ``record.features``.
    Returns:
        [M, bs, H] drafter hidden states (after its final norm), drafter dtype;
        [m, k] is the output at slot k of block m (predicts position a_m + k).
    Raises:
        ReplayError: no features (set ``training.feature_source: target``).
    """
    feats = record.features if features is None else features
    if feats is None:
        raise ReplayError(
            f"record {record.sample_id} has no context features; the shards were written with "
            "rollout.store_features=false: set training.feature_source=target"
        )
    device = embed_tokens.weight.device
    noise_ids, position_ids, anchors = replay_inputs(record, mask_token_id, device)
    S = feats.shape[0]
    M, bs = anchors.shape[1], record.block_size
    keep = torch.ones_like(anchors, dtype=torch.bool)
    builder = create_dflash_block_mask if attention_backend == "flex_attention" else create_dflash_sdpa_mask
    mask = builder(anchor_positions=anchors, block_keep_mask=keep, S=S, block_size=bs, device=device)
    dtype = next(drafter.parameters()).dtype
    with torch.no_grad():
        noise = embed_tokens(noise_ids)
    out = drafter(
        position_ids=position_ids,
        noise_embedding=noise.to(dtype),
        target_hidden=feats.to(device=device, dtype=dtype).unsqueeze(0),
        attention_mask=mask,
    )
    return out.view(M, bs, -1)


def slot_teacher(record: RolloutRecord, plan: SlotPlan, device=None) -> dict:
    """The teacher signal at the planned slots, as keyword arguments of ``losses.linear_kl_loss``.

    Slot k of block m reads teacher index k-1 (the verify pass's output at slot
    k-1). Includes ``draft_ids`` = d_{m,k} for the topk/token forms.

    Raises:
        ReplayError: the record carries no teacher signal.
    """
    m, j = plan.block, plan.slot - 1
    form = record.teacher_form()
    if form is None:
        raise ReplayError(
            f"record {record.sample_id} has no teacher signal; set training.feature_source=target "
            "to recompute it with the frozen target"
        )
    out: dict = {}
    if form == "full":
        out["teacher_hidden"] = record.teacher_hidden[m, j]
    else:
        out["draft_ids"] = record.drafts[m, j]
        out["draft_logprob"] = record.teacher_draft_logprob[m, j]
        if form == "topk":
            out["topk_ids"] = record.teacher_topk_ids[m, j]
            out["topk_logprobs"] = record.teacher_topk_logprobs[m, j]
    return {k: v.to(device) for k, v in out.items()}


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
def recompute_from_target(
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
    new = dataclasses.replace(
        record, features=feats, teacher_hidden=None, teacher_topk_ids=None, teacher_topk_logprobs=None, teacher_draft_logprob=None
    )
    if form == "full":
        new.teacher_hidden = out.hidden_states[-1][0, S:].float().view(M, n, -1)
        return new
    logp = F.log_softmax(out.logits[0, S:].float(), dim=-1).view(M, n, -1)
    new.teacher_draft_logprob = logp.gather(-1, record.drafts.to(device).view(M, n, 1)).squeeze(-1)
    if form == "topk":
        vals, idx = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        new.teacher_topk_ids, new.teacher_topk_logprobs = idx, vals
    elif form != "token":
        raise ReplayError(f"rollout.teacher={form!r}: expected full, topk or token")
    return new


def replay_logits(drafter, embed_tokens, lm_head_weight, record: RolloutRecord, mask_token_id: int, attention_backend: str = "sdpa") -> torch.Tensor:
    """Dense student logits of every drafted slot: float32 [M, bs-1, V] (slot k at index k-1).

    For tests and offline analysis on small vocabularies; training uses the
    chunked path (``losses.linear_kl_loss``).
    """
    h = replay_hidden(drafter, embed_tokens, record, mask_token_id, attention_backend)
    return h[:, 1:].float() @ lm_head_weight.float().t()
