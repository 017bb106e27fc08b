"""The DFlash drafters the speculative step drives: batched on the in-process target's slot layout with a
context cache (``CachedDFlashDrafter``), or one forward over the whole context per row (``DFlashDrafter``)."""

from __future__ import annotations

from typing import Optional

import torch

from specforge_opd.models.grouped_attention import grouped_attention
from specforge_opd.rollout.decode import HFCache
from specforge_opd.rollout.inprocess import InProcessTarget
from specforge_opd.rollout.interfaces import Draft, DraftRequest



class CachedDFlashDrafter:
    """The DFlash drafter on an ``InProcessTarget``'s slot layout, batched, with a cache of its context.

    Its cache holds the projected context features (DFlash attention keys/values of
    the target features) at the target's slot layout; the features of each target
    forward are fed to it at the next draft, as SpecForge's ``spec_generate`` does
    for one sequence. Each draft is one forward over the pending context slots and
    the block ``[slot 0, MASK...]`` (DESIGN.md, block layout); the cache keeps the
    context part only.

    Args:
        model: SpecForge ``DFlashDraftModel`` (``block_size``), eval mode.
        target: the ``InProcessTarget`` it drafts for (embedding and lm_head are the target's).
        mask_token_id: the MASK id of slots 1..bs-1.
    """

    def __init__(self, model, target: InProcessTarget, mask_token_id: int):
        self.model = model
        self.target = target
        self.block_size = int(model.block_size)
        self.mask_token_id = int(mask_token_id)
        self.dtype = next(model.parameters()).dtype
        self.cache = HFCache()
        target.slot_caches.append(self.cache)
        target.context_writers.append(self._write_context)

    @torch.no_grad()
    def _write_context(self, rows: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> None:
        """The projected context of admitted rows (features ``feats`` [k, P, D] at positions ``pos`` [k, P])
        into slots 0..P-1 of rows ``rows`` of this drafter's cache.

        A DFlash layer's context keys/values are its k/v projections of the projected target
        features alone (RoPE at their positions): neither the block nor the mask enters them.
        So one forward of the admitted rows with a MASK block computes exactly what the batch's
        own draft would have cached; the block's part is cropped.
        """
        t = self.target
        k, P = pos.shape
        bs = self.block_size
        noise_ids = torch.full((k, bs), self.mask_token_id, dtype=torch.long, device=t.device)
        blk_pos = pos[:, -1:] + 1 + torch.arange(bs, device=t.device)
        mask = valid.unsqueeze(1).unsqueeze(1).expand(k, 1, bs, P)
        mask = torch.cat([mask, torch.ones(k, 1, bs, bs, dtype=torch.bool, device=t.device)], dim=3)
        tmp = HFCache()
        with grouped_attention(self.model):
            self.model(
                position_ids=torch.cat([pos, blk_pos], dim=1),
                noise_embedding=t.model.model.embed_tokens(noise_ids).to(self.dtype),
                target_hidden=feats.to(self.dtype),
                attention_mask=mask,
                past_key_values=tmp.cache,
                use_cache=True,
            )
        tmp.crop(P)
        self.cache.write_rows(rows, tmp, P)

    async def propose(self, req: DraftRequest) -> Draft:
        """Returns the argmax of slots 1..bs-1 (int64 [B, bs-1]) and their logits (float32 [B, bs-1, V])."""
        t = self.target
        dev = t.device
        bs = self.block_size
        ctx_feats, ctx_pos = t.pending
        B = ctx_pos.shape[0]
        noise_ids = torch.full((B, bs), self.mask_token_id, dtype=torch.long, device=dev)
        noise_ids[:, 0] = req.slot0.to(dev)
        noise = t.model.model.embed_tokens(noise_ids)
        blk_pos = req.anchors.to(dev).unsqueeze(1) + torch.arange(bs, device=dev)
        S_d = self.cache.get_seq_length()
        # the drafter's cache lags the target's by the pending slots: it sees the target's whole valid map
        kv_valid = t.valid
        assert kv_valid.shape[1] == S_d + ctx_pos.shape[1], "drafter cache out of step with the target's slots"
        mask = kv_valid.unsqueeze(1).unsqueeze(1).expand(B, 1, bs, kv_valid.shape[1])
        mask = torch.cat([mask, torch.ones(B, 1, bs, bs, dtype=torch.bool, device=dev)], dim=3)
        with grouped_attention(self.model):  # the cache's keys read once per key/value head, not once per query head
            out = self.model(
                position_ids=torch.cat([ctx_pos, blk_pos], dim=1),
                noise_embedding=noise.to(self.dtype),
                target_hidden=ctx_feats.to(self.dtype),
                attention_mask=mask,
                past_key_values=self.cache.cache,
                use_cache=True,
            )
        self.cache.crop(S_d + ctx_feats.shape[1])
        logits = t.runner.logits(out[:, 1:]).float()
        return Draft(tokens=logits.argmax(-1), logits=logits)


class DFlashDrafter:
    """The DFlash drafter with the target's frozen embedding and lm_head (the drafter has neither), no cache.

    ``draft(context, slot0, anchor, prefix)``: one sequence; context float [a, n*H]
    (features of positions 0..a-1; ``prefix``, the tokens 0..a, is unused by DFlash);
    returns the bs-1 argmax tokens for slots 1..bs-1. One forward over context +
    block: the same function ``spec_generate`` computes with its cache. ``propose``
    drafts each row of a batch that way (the HTTP path: the target is remote and
    the features arrive as rows).

    Raises:
        ValueError: the context does not cover positions 0..a-1, or there is none (a target
            that returns no features).
    """

    def __init__(self, model, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module):
        self.model = model.eval()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = int(model.block_size)
        self.mask_token_id = int(model.mask_token_id)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def draft(self, context: torch.Tensor, slot0: int, anchor: int, prefix: Optional[list] = None) -> list:
        if context.shape[0] != anchor:
            raise ValueError(f"drafter context has {context.shape[0]} rows, anchor is {anchor}: features must cover 0..a-1")
        bs = self.block_size
        block = torch.full((1, bs), self.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = int(slot0)
        noise = self.embed_tokens(block).to(self.dtype)
        pos = torch.arange(anchor + bs, device=self.device).unsqueeze(0)
        hidden = self.model(
            target_hidden=context.to(self.device, self.dtype).unsqueeze(0),
            noise_embedding=noise,
            position_ids=pos,
            use_cache=False,
            is_causal=False,
        )
        logits = self.lm_head(hidden[:, 1:, :].to(self.lm_head.weight.dtype))
        return logits.argmax(-1)[0].tolist()

    async def propose(self, req: DraftRequest) -> Draft:
        out = []
        for j, toks in enumerate(req.tokens):
            if not req.features[j]:
                raise ValueError("the drafter needs context features: speculative rollout requires rollout.store_features or a feature-returning target")
            context = torch.cat(req.features[j], 0)
            out.append(self.draft(context, toks[-1], len(toks) - 1, prefix=list(toks)))
        return Draft(tokens=torch.tensor(out, dtype=torch.long).reshape(len(out), self.block_size - 1))
