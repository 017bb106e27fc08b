"""Replay: rebuild the drafter's inputs from a rollout record (paper section 4.2, "Replay").

For one ``RolloutRecord`` the drafter sees, in one forward per group of at most
``training.max_blocks_per_forward`` blocks (``block_groups``), the stored target
context features of the verified sequence and one block per recorded anchor:
slot 0 = the token at the anchor, slots 1..bs-1 = MASK. The DFlash mask
(SpecForge's ``create_dflash_sdpa_mask`` with sdpa, ``dflash_flex_block_mask``
with flex_attention on GPU) lets a block see context rows strictly before its anchor
and its own block, nothing else, which is exactly what the drafter saw when it
drafted that block during the rollout. Slot k of block m predicts the token at
position a_m + k (DESIGN.md section 3; ``tests/test_replay.py`` pins it).

The teacher side lives here too: ``recompute_from_target`` rebuilds context
features and the teacher signal with a frozen target (``feature_source:
target``): a prefill of the context through the target's decoder body, then
the verify blocks in groups over its KV cache; no full-vocabulary logits for
the ``full`` teacher, and none over the context rows for any teacher.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from specforge_opd.errors import UserError
from specforge_opd.models.adapter import create_dflash_sdpa_mask
from specforge_opd.rollout.records import RolloutRecord, Teacher
from specforge_opd.teacher_form import TEACHER_FORMS
from specforge_opd.train.losses import SlotPlan


class ReplayError(UserError, ValueError):
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


def block_groups(num_blocks: int, max_blocks_per_forward: Optional[int]) -> list[tuple[int, int]]:
    """Consecutive block ranges [(b0, b1), ...] of at most ``max_blocks_per_forward`` blocks each.

    None (or a cap >= ``num_blocks``) gives one range over all blocks. SpecForge's
    DFlash SFT caps a forward at ``num_anchors`` = 512 blocks for the same reason:
    activations and the mask grow with the blocks of one forward.

    Raises:
        ReplayError: a cap < 1 (set ``training.max_blocks_per_forward`` to a positive count).
    """
    if max_blocks_per_forward is None or max_blocks_per_forward >= num_blocks:
        return [(0, num_blocks)]
    if max_blocks_per_forward < 1:
        raise ReplayError(f"training.max_blocks_per_forward={max_blocks_per_forward}: must be >= 1 (default 512)")
    return [(b, min(num_blocks, b + max_blocks_per_forward)) for b in range(0, num_blocks, max_blocks_per_forward)]


def dflash_flex_block_mask(anchors: torch.Tensor, S: int, block_size: int, device, compile: Optional[bool] = None):
    """flex_attention ``BlockMask`` of the DFlash replay mask (same mask as ``create_dflash_sdpa_mask``).

    Query row q (slot q % bs of block q // bs) sees context rows kv < a_{q // bs}
    and the rows of its own block. Unlike SpecForge's ``create_dflash_block_mask``,
    the mask function reads only tensors (the per-row anchor and the context length
    as 0-dim tensors) and the block size, so ``create_block_mask(_compile=True)``
    traces it once and replays it for new sequences (new shapes recompile once into
    a dynamic-shape graph) instead of evaluating it eagerly over the dense
    [Q, KV] grid, which is what materializes mask-sized intermediates on a GPU.

    Args:
        anchors: int64 [M] (or [1, M]), each in 0..S.
        S: context rows; block_size: bs.
        compile: compile the mask construction; default: on CUDA devices only.
    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` for Q_LEN = M*bs, KV_LEN = S + M*bs.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(device) if device is not None else anchors.device
    anchors = anchors.to(device=device, dtype=torch.long).view(-1)
    M = anchors.numel()
    q_len, kv_len = M * block_size, S + M * block_size
    # Padded to whole 128-row tiles: the mask function may be evaluated past Q_LEN.
    pad = -q_len % 128 + 128
    row_anchor = torch.cat([anchors.repeat_interleave(block_size), anchors.new_zeros(pad)])
    ctx_len = torch.tensor(S, device=device, dtype=torch.long)
    bs = int(block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        context = kv_idx < row_anchor[q_idx]  # anchors <= S, so these are context rows
        own = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // bs == q_idx // bs)
        return context | own

    if compile is None:
        compile = device.type == "cuda"
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device, _compile=compile)


def replay_hidden(
    drafter,
    embed_tokens: torch.nn.Module,
    record: RolloutRecord,
    mask_token_id: int,
    attention_backend: str = "sdpa",
    features: Optional[torch.Tensor] = None,
    blocks: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Drafter outputs for the blocks of ``record`` in one forward (all of them, or a range).

    Args:
        drafter: ``DFlashDraftModel`` (possibly FSDP2-sharded).
        embed_tokens: the target's frozen input embedding.
        attention_backend: ``sdpa``/``eager`` (dense boolean mask, SpecForge's
            ``create_dflash_sdpa_mask``) or ``flex_attention`` (``dflash_flex_block_mask``).
        features: [T-1, n*H] context features; default ``record.features``.
        blocks: (b0, b1): replay blocks b0..b1-1 only (``block_groups``), with the
            context cut to the rows before the group's last anchor (no block of the
            group sees later rows). None: every block, over the whole context.
    Returns:
        [g, bs, H] drafter hidden states (after its final norm), drafter dtype,
        g = b1 - b0 (M for all blocks); [m, k] is the output at slot k of block
        b0 + m (predicts position a_m + k).
    Raises:
        ReplayError: no features (set ``training.feature_source: target``), or an
            empty or out-of-range ``blocks``.
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
    if blocks is not None:
        b0, b1 = int(blocks[0]), int(blocks[1])
        if not 0 <= b0 < b1 <= M:
            raise ReplayError(f"record {record.sample_id}: blocks {blocks} outside 0..{M}")
        anchors = anchors[:, b0:b1]
        S = max(1, min(S, int(anchors.max())))
        noise_ids = noise_ids[:, b0 * bs : b1 * bs]
        position_ids = torch.cat([position_ids[:, :S], position_ids[:, feats.shape[0] + b0 * bs : feats.shape[0] + b1 * bs]], dim=1)
        feats = feats[:S]
        M = b1 - b0
    if attention_backend == "flex_attention":
        mask = dflash_flex_block_mask(anchors, S, bs, device)
    else:
        keep = torch.ones_like(anchors, dtype=torch.bool)
        mask = create_dflash_sdpa_mask(anchor_positions=anchors, block_keep_mask=keep, S=S, block_size=bs, device=device)
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
    t = record.teacher
    if t is None:
        raise ReplayError(
            f"record {record.sample_id} has no teacher signal; set training.feature_source=target "
            "to recompute it with the frozen target"
        )
    out: dict = {}
    if t.form == "full":
        out["teacher_hidden"] = t.hidden[m, j]
    else:
        out["draft_ids"] = record.drafts[m, j]
        out["draft_logprob"] = t.draft_logprob[m, j]
        if t.form == "topk":
            out["topk_ids"] = t.topk_ids[m, j]
            out["topk_logprobs"] = t.topk_logprobs[m, j]
    return {k: v.to(device) for k, v in out.items()}


def verify_group_mask(anchors: torch.Tensor, S: int, n: int, device=None) -> torch.Tensor:
    """Boolean attention mask [1, 1, g*n, S + g*n] of one group of verify blocks over a cached context.

    Rows: the g blocks' verify inputs [token at a_m, d_1..d_{bs-2}] (n = bs-1 each).
    Columns: the S cached context rows, then the group's own rows. Verify slot j
    of block m sees context positions < a_m and its own slots 0..j: exactly the KV
    cache and causal block of the rollout's verify step (DESIGN.md section 3).
    Its size is bounded by the group (``training.max_blocks_per_forward``), never
    [L, L] over the whole sequence.

    Args:
        anchors: int64 [g], the group's anchors a_m (each in 0..S).
    """
    g = anchors.numel()
    q = torch.arange(g * n, device=device).view(-1, 1)
    kv = torch.arange(S + g * n, device=device).view(1, -1)
    a = anchors.to(device).view(-1).repeat_interleave(n).view(-1, 1)
    ctx = (kv < S) & (kv < a)
    own = (kv >= S) & ((kv - S) // n == q // n) & (kv - S <= q)
    return (ctx | own).view(1, 1, g * n, S + g * n)


def _decoder_body(target):
    """The target's decoder without its head (HF ``get_decoder()``, or ``.model``)."""
    body = target.get_decoder() if hasattr(target, "get_decoder") else None
    if body is None or body is target:
        body = getattr(target, "model", None)
    if body is None or not hasattr(body, "layers"):
        raise ReplayError(
            f"{type(target).__name__}: feature_source=target needs an HF causal LM with a decoder body "
            "(``model.layers``); load the target with transformers AutoModelForCausalLM"
        )
    return body


def _new_cache(config):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


@torch.no_grad()
def recompute_from_target(
    target,
    record: RolloutRecord,
    layer_ids: list[int],
    *,
    form: str = "full",
    topk: int = 32,
    max_blocks_per_forward: int = 512,
    chunk_rows: int = 1024,
) -> RolloutRecord:
    """Context features and teacher signal from a frozen target (``feature_source: target``).

    Two phases, as the rollout itself ran (DESIGN.md section 5, "Feature source"):

    1. prefill: the verified tokens 0..T-2 through the target's decoder body
       (no lm_head), causal, into a KV cache, in chunks of
       ``max_blocks_per_forward * (bs-1)`` rows. Forward hooks on the decoder layers
       in ``layer_ids`` copy their outputs into the feature rows; nothing else is
       kept (HF ``output_hidden_states=True`` would keep every layer). Layer k =
       HF ``hidden_states[k + 1]``: the output of decoder layer k, and for the last
       layer the final-norm output, as HF returns it.
    2. verify: groups of at most ``max_blocks_per_forward`` blocks, each block's
       verify inputs [token at a_m, d_1..d_{bs-2}] at positions a_m + j, over the
       cached context (``verify_group_mask``); the cache is cropped back to the
       context after each group. Teacher at slot k = the output at verify slot
       k-1: the final-norm hidden (``full``: no lm_head here, the trainer applies
       it in chunks), or the lm_head applied to ``chunk_rows`` rows at a time,
       then top-k log-probs + log p(d_k) (``topk``) or log p(d_k) alone
       (``token``), temperature 1.

    Memory: no tensor scales with L = S + (bs-1)*M in both dimensions; the largest
    are the group's mask (g*n x (S + g*n) bools), the cache and features
    ([S, n_layers*H]), and fp32 [chunk_rows, V] logits for topk/token.

    Args:
        target: HF causal LM (eval; sdpa/eager attention: it needs a 4D mask).
        layer_ids: ``dflash_config.target_layer_ids``.
        form: teacher form to produce (``full``, ``topk``, ``token``).
        max_blocks_per_forward: blocks per verify forward (> 0).
        chunk_rows: rows per lm_head chunk (> 0).
    Returns:
        A copy of ``record`` with ``features`` ([T-1, n*H], target dtype) and the
        teacher fields of ``form`` set (``teacher_hidden`` in the target dtype,
        log-probs float32), on the target's device.
    Raises:
        ReplayError: unknown ``form``, non-positive group/chunk sizes, or a target
            without a decoder body.
    """
    if form not in TEACHER_FORMS:
        raise ReplayError(f"rollout.teacher={form!r}: expected full, topk or token")
    if max_blocks_per_forward < 1 or chunk_rows < 1:
        raise ReplayError(
            f"training.max_blocks_per_forward={max_blocks_per_forward} / training.chunk_slots={chunk_rows}: must be >= 1"
        )
    body = _decoder_body(target)
    device = next(target.parameters()).device
    ids = record.input_ids.to(device).long()
    cache = _new_cache(target.config)
    feats = _prefill_features(target, body, cache, ids, layer_ids, record.block_size - 1, max_blocks_per_forward)
    teacher = _verify_teacher(target, body, cache, ids, record, form=form, topk=topk,
                              max_blocks_per_forward=max_blocks_per_forward, chunk_rows=chunk_rows)
    return dataclasses.replace(record, features=feats, teacher=teacher)


def _prefill_features(target, body, cache, ids: torch.Tensor, layer_ids: list[int], n: int,
                      max_blocks_per_forward: int) -> torch.Tensor:
    """Phase 1 of ``recompute_from_target``: the context rows 0..T-2 through ``body`` into ``cache``.

    Runs in chunks of ``max_blocks_per_forward * n`` rows (``n`` = block size - 1).
    Returns the features [T-1, len(layer_ids)*H] in the target's dtype, on ``ids``' device.
    """
    device = ids.device
    S = ids.numel() - 1
    H = target.config.hidden_size
    n_layers = len(body.layers)
    dtype = next(body.parameters()).dtype
    feats = torch.empty(S, len(layer_ids) * H, dtype=dtype, device=device)
    rows = slice(0, 0)  # the prefill chunk the hooks write into

    def capture(cols):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            feats[rows, cols] = out[0]

        return hook

    # A layer id may repeat (its columns then repeat); the last layer's feature is the
    # final-norm output (HF ties hidden_states[-1] to last_hidden_state), taken below.
    handles = []
    last_cols = []
    for i, k in enumerate(layer_ids):
        cols = slice(i * H, (i + 1) * H)
        if k == n_layers - 1:
            last_cols.append(cols)
        else:
            handles.append(body.layers[k].register_forward_hook(capture(cols)))
    step_rows = max_blocks_per_forward * n
    try:
        for start in range(0, S, step_rows):
            rows = slice(start, min(S, start + step_rows))
            out = body(
                input_ids=ids[rows].view(1, -1),
                position_ids=torch.arange(rows.start, rows.stop, device=device).view(1, -1),
                past_key_values=cache,
                use_cache=True,
            )
            for cols in last_cols:
                feats[rows, cols] = out.last_hidden_state[0]
    finally:
        for h in handles:
            h.remove()
    return feats


def _verify_teacher(target, body, cache, ids: torch.Tensor, record: RolloutRecord, *, form: str, topk: int,
                    max_blocks_per_forward: int, chunk_rows: int) -> Teacher:
    """Phase 2 of ``recompute_from_target``: the verify blocks in groups over the prefilled ``cache``.

    Returns the ``Teacher`` of ``form`` ([M, bs-1, ...] tensors on ``ids``' device); the
    cache is cropped back to the context after each group.
    """
    device = ids.device
    bs, M = record.block_size, record.num_blocks
    n, S = bs - 1, ids.numel() - 1
    H = target.config.hidden_size
    anchors = record.anchors.to(device).long()
    drafts = record.drafts.to(device).long()
    dtype = next(body.parameters()).dtype
    hidden = torch.empty(M, n, H, dtype=dtype, device=device) if form == "full" else None
    draft_logprob = torch.empty(M, n, dtype=torch.float32, device=device) if form != "full" else None
    topk_ids = topk_logprobs = None
    if form == "topk":
        k_top = min(topk, target.get_output_embeddings().weight.shape[0])
        topk_ids = torch.empty(M, n, k_top, dtype=torch.long, device=device)
        topk_logprobs = torch.empty(M, n, k_top, dtype=torch.float32, device=device)
    head = target.get_output_embeddings()
    softcap = getattr(target.config, "final_logit_softcapping", None)
    offsets = torch.arange(n, device=device)
    for g0 in range(0, M, max_blocks_per_forward):
        g1 = min(M, g0 + max_blocks_per_forward)
        a = anchors[g0:g1]
        inp = torch.cat([ids[a].view(-1, 1), drafts[g0:g1, : n - 1]], dim=1).view(1, -1)
        out = body(
            input_ids=inp,
            position_ids=(a.view(-1, 1) + offsets).view(1, -1),
            attention_mask=verify_group_mask(a, S, n, device),
            past_key_values=cache,
            use_cache=True,
        )
        # back to the context; a negative count removes that many tokens in every transformers 5.x
        # (a positive length is deprecated from 5.17)
        cache.crop(-(g1 - g0) * n)
        h = out.last_hidden_state[0]  # [(g1-g0)*n, H]
        if form == "full":
            hidden[g0:g1] = h.view(g1 - g0, n, H)
            continue
        d = drafts[g0:g1].reshape(-1)
        for r0 in range(0, h.shape[0], chunk_rows):
            r1 = min(h.shape[0], r0 + chunk_rows)
            logits = head(h[r0:r1])
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logp = F.log_softmax(logits.float(), dim=-1)
            del logits
            flat = slice(g0 * n + r0, g0 * n + r1)
            draft_logprob.view(-1)[flat] = logp.gather(-1, d[r0:r1].view(-1, 1)).squeeze(-1)
            if form == "topk":
                vals, idx = logp.topk(topk_ids.shape[-1], dim=-1)
                topk_ids.view(-1, vals.shape[-1])[flat] = idx
                topk_logprobs.view(-1, vals.shape[-1])[flat] = vals
            del logp
    return Teacher(form, hidden=hidden, topk_ids=topk_ids, topk_logprobs=topk_logprobs, draft_logprob=draft_logprob)


def recompute_largest_tensor_bytes(
    config,
    S: int,
    M: int,
    block_size: int,
    *,
    form: str = "full",
    topk: int = 32,
    n_feature_layers: int = 5,
    max_blocks_per_forward: int = 512,
    chunk_rows: int = 1024,
    dtype_bytes: int = 2,
) -> int:
    """Upper bound on the largest single tensor ``recompute_from_target`` allocates (bytes).

    The maximum over: the features [S, n_layers*H]; the ``full`` teacher [M, bs-1, H];
    the top-k ids [M, bs-1, k] (int64); fp32 logits of one lm_head chunk
    [chunk_rows, V]; one group's verify mask (R x (S + R) bools, R = g*(bs-1));
    one forward's activations at R rows (MLP intermediate, q/k/v, per-layer KV
    cache over S + R rows with KV heads repeated to all heads). It assumes a
    memory-efficient SDPA kernel (CPU flash and the CUDA kernels are; the math
    fallback would add heads x R x (S + R) fp32 scores). The dense recompute it
    replaced held fp32 [L, V] log-probs, L = S + (bs-1)*M.

    Args:
        config: the target's HF config (hidden_size, vocab_size, intermediate_size,
            num_attention_heads, num_key_value_heads, head_dim).
        S: context rows (T-1); M: blocks; dtype_bytes: the target's element size.
    """
    n = block_size - 1
    H, V = config.hidden_size, config.vocab_size
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or H // heads
    inter = getattr(config, "intermediate_size", 4 * H)
    g = min(M, max_blocks_per_forward)
    R = max(min(S, max_blocks_per_forward * n), g * n)
    parts = [
        S * n_feature_layers * H * dtype_bytes,
        R * (S + R),
        R * max(inter, heads * hd, H) * dtype_bytes,
        (S + R) * heads * hd * dtype_bytes,
    ]
    if form == "full":
        parts.append(M * n * H * dtype_bytes)
    else:
        parts.append(min(chunk_rows, M * n) * V * 4)
        if form == "topk":
            parts.append(M * n * min(topk, V) * 8)
    return int(max(parts))


def replay_logits(drafter, embed_tokens, lm_head_weight, record: RolloutRecord, mask_token_id: int, attention_backend: str = "sdpa") -> torch.Tensor:
    """Dense student logits of every drafted slot: float32 [M, bs-1, V] (slot k at index k-1).

    For tests and offline analysis on small vocabularies; training uses the
    chunked path (``losses.linear_kl_loss``).
    """
    h = replay_hidden(drafter, embed_tokens, record, mask_token_id, attention_backend)
    return h[:, 1:].float() @ lm_head_weight.float().t()
