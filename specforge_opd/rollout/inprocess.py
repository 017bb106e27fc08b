"""The in-process target: an HF model in this process on a preallocated KV cache, verifying B rows at once.

It owns the slot layout the batched rollout runs on: per-row valid maps over shared cache slots
(left padding and rejected slots are holes), compaction of those holes, and continuous-batching
admission of new prompts into finished rows (``InProcessTarget``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specforge_opd.rollout.decode import TargetRunner, left_pad, prefill, step_mask
from specforge_opd.rollout.interfaces import Prefilled, TargetCaps, Verified
from specforge_opd.teacher_form import TEACHER_FORMS


#: Default compaction thresholds of ``InProcessTarget``: squeeze once the cache holds at least
#: ``COMPACT_MIN_SLOTS`` slots and its longest row's valid slots are below ``COMPACT_BELOW`` of
#: them. A squeeze costs one copy of the cache; holes cost attention on every step. Measured
#: (``benchmarks/bench_compaction.py``, 2-core AMD EPYC, fp32, thresholds interleaved because the
#: machine's speed drifts within a run): against 0.5, 0.95 runs plain generation with
#: continuous batching 1.12-1.14x faster and speculative rollouts at block 8 1.09-1.10x.
COMPACT_MIN_SLOTS = 64
COMPACT_BELOW = 0.95


class InProcessTarget:
    """An HF target in this process on ``decode.TargetRunner``'s preallocated KV cache, for B rows at once.

    Slot layout: the cache is shared by the batch and each row owns a boolean
    ``valid`` map over cache *slots*; every token carries its own position id.
    Prompts are left-padded (pad slots are holes). A verify step appends bs slots
    per row; ``advance`` crops the cache to the batch's longest accepted prefix
    and the slots a row rejected stay as masked holes. Holes are squeezed out
    (``_compact``) once the cache has ``compact_min_slots`` slots and its longest
    row holds fewer than ``compact_below`` of them: holes cost attention time,
    squeezing costs a copy, and it cannot go below the longest row. Every forward gets a 4-D boolean mask from that map, so each
    row sees exactly its own verified prefix: T=0 equals the target's greedy
    decoding up to numerical ties (DESIGN.md, numerical ties).

    Caches in ``slot_caches`` (the ``CachedDFlashDrafter``'s) share the slot
    layout: they are compacted and row-selected with the target's.

    Args:
        model: HF causal LM in eval mode (``.model.embed_tokens``, ``.lm_head``).
        layer_ids: decoder layers whose outputs are the context features (DESIGN.md,
            target layer ids); empty: no features.
        slack: cache slots to preallocate past the longest prompt (max_new_tokens + 2 blocks;
            holes grow it, doubling, until compaction).
        prefill_chunk: prompts go through the target in chunks of this many tokens.
    """

    def __init__(self, model, layer_ids: Sequence[int] = (), *, slack: int = 0, prefill_chunk: int = 256,
                 compact_min_slots: int = COMPACT_MIN_SLOTS, compact_below: float = COMPACT_BELOW):
        self.model = model
        self.runner = TargetRunner.of(model)
        self.device = next(model.parameters()).device
        self.layer_ids = [int(i) for i in layer_ids] or None
        self.slack = int(slack)
        self.prefill_chunk = int(prefill_chunk)
        self.compact_min_slots = compact_min_slots
        self.compact_below = compact_below
        w = model.lm_head.weight
        self.caps = TargetCaps(
            name="the in-process target", greedy_only=False, teacher_forms=TEACHER_FORMS, features=self.layer_ids is not None,
            vocab_size=int(w.shape[0]), hidden_size=int(w.shape[1]), hidden_dtype=w.dtype,
        )
        self.slot_caches: list = []
        #: ``fn(rows, feats [k, P, D], pos [k, P], valid [k, P])``: fill the context of admitted rows
        #: at slots 0..P-1 of each slot cache (``admit``); the ``CachedDFlashDrafter`` registers one.
        self.context_writers: list = []
        #: Compactions so far.
        self.compactions = 0
        self.cache = self.valid = self.pending = self._last = None

    async def prefill(self, prompts: list) -> Prefilled:
        ids, valid, pos = left_pad(prompts, self.device)
        self.cache = self.runner.new_cache(len(prompts), ids.shape[1] + self.slack)
        hidden, feats = prefill(self.runner, self.cache, ids, valid, pos, self.layer_ids, self.prefill_chunk)
        self.valid = valid
        #: Context slots the drafter's cache lacks: (features [B, c, D] or None, positions [B, c]).
        self.pending = (feats, pos)
        rows = None if feats is None else [feats[b, valid[b]] for b in range(len(prompts))]
        return Prefilled(logits=self.runner.logits(hidden).float(), rows=rows)

    async def verify(self, tokens: list, blocks: torch.Tensor, anchors: torch.Tensor) -> Verified:
        S0 = self.valid.shape[1]
        # squeezing shortens the cache to its longest row's valid slots, never below: so the test is on
        # that row, not on the valid fraction (rows of mixed lengths keep a low fraction for good), and
        # a squeeze leaves nothing to squeeze until holes build up in the longest row again
        if S0 >= self.compact_min_slots:
            width = int(self.valid.sum(1).max())
            if width < self.compact_below * S0:
                self.compactions += 1
                self._compact(width)
        blocks = blocks.to(self.device)
        block_pos = anchors.to(self.device).unsqueeze(1) + torch.arange(blocks.shape[1], device=self.device)
        S = self.valid.shape[1]
        mask = step_mask(self.valid, torch.ones_like(blocks, dtype=torch.bool))
        hidden, feats = self.runner.forward(blocks, block_pos, mask, self.cache, self.layer_ids)
        self._last = (S, feats, block_pos)
        return Verified(logits=self.runner.logits(hidden).float(), hidden=hidden, rows=feats)

    def advance(self, accepted: torch.Tensor) -> None:
        # keep the batch's longest accepted prefix; shorter rows get holes
        S, feats, block_pos = self._last
        acc = accepted.to(self.device)
        c = int(acc.max()) + 1
        self.cache.crop(S + c)
        self.valid = torch.cat([self.valid, torch.arange(c, device=self.device).unsqueeze(0) <= acc.unsqueeze(1)], dim=1)
        self.pending = (None if feats is None else feats[:, :c], block_pos[:, :c])

    def keep(self, rows: list) -> None:
        sel = torch.tensor(rows, device=self.device)
        self.cache.select_rows(sel)
        for c in self.slot_caches:
            c.select_rows(sel)
        self.valid = self.valid[sel]
        feats, pos = self.pending
        self.pending = (None if feats is None else feats[sel], pos[sel])

    async def admit(self, rows: list, prompts: list) -> Prefilled:
        """Continuous batching: prefill ``prompts`` into batch rows ``rows`` (rows whose sequences ended).

        The prompts are prefilled on their own (left-padded among themselves, no attention
        to the batch), then their keys/values are copied into slots 0..P-1 of their rows of
        the shared cache; the rest of those rows are holes. The drafter's context cache gets
        the same slots (``context_writers``), or, before its first draft, the pending context
        does. Where the cache is shorter than the prompts, hole slots are added in front of
        every row first. Each row attends to its own valid slots with its own positions, so
        a row's result does not depend on its neighbours (up to fp rounding).

        Args:
            rows: batch positions (ints) to refill, as many as ``prompts``.
            prompts: per row the prompt's token ids (non-empty lists).
        Returns:
            ``Prefilled`` for those rows, in ``rows`` order.
        """
        ids, valid, pos = left_pad(prompts, self.device)
        k, P = ids.shape
        tmp = self.runner.new_cache(k, P)
        hidden, feats = prefill(self.runner, tmp, ids, valid, pos, self.layer_ids, self.prefill_chunk)
        S = self.valid.shape[1]
        p_feats, p_pos = self.pending
        c = p_pos.shape[1]
        consumed = S - c  # slots the drafter's context cache already holds
        before_first_draft = consumed == 0 and bool(self.slot_caches)
        room = S if (before_first_draft or not self.slot_caches) else consumed
        if P > room:
            grow = P - room
            self.cache.pad_front(grow)
            for sc in self.slot_caches:
                sc.pad_front(grow)
            self.valid = torch.cat([self.valid.new_zeros(self.valid.shape[0], grow), self.valid], dim=1)
            if before_first_draft:  # the pending context is every slot: it grows with them
                p_pos = torch.cat([p_pos.new_zeros(p_pos.shape[0], grow), p_pos], dim=1)
                if p_feats is not None:
                    p_feats = torch.cat([p_feats.new_zeros(p_feats.shape[0], grow, p_feats.shape[2]), p_feats], dim=1)
            S += grow
        sel = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.write_rows(sel, tmp, P)
        new_valid = self.valid.new_zeros(k, S)
        new_valid[:, :P] = valid
        self.valid[sel] = new_valid
        if before_first_draft:
            p_pos = p_pos.clone()
            p_pos[sel, :P] = pos
            if p_feats is not None:
                p_feats = p_feats.clone()
                p_feats[sel, :P] = feats.to(p_feats.dtype)
        else:
            for write in self.context_writers:
                write(sel, feats, pos, valid)
        self.pending = (p_feats, p_pos)
        rows_out = None if feats is None else [feats[b, valid[b]] for b in range(k)]
        return Prefilled(logits=self.runner.logits(hidden).float(), rows=rows_out)

    def _compact(self, width: int) -> None:
        """Squeeze the holes out of every slot-layout cache, keeping each row's slot order; ``width``
        = the longest row's valid slots, the squeezed cache's length."""
        B, S = self.valid.shape
        # sort holes first, valid slots last, stable so the valid slots keep their order (left padding)
        key = self.valid.long() * (S + 1) + torch.arange(S, device=self.valid.device)
        order = key.argsort(dim=1)[:, S - width:]
        self.cache.gather_slots(order)
        for c in self.slot_caches:
            c.gather_slots(order)
        self.valid = torch.gather(self.valid, 1, order)
