"""Shared pieces of the SGLang tests: an oracle drafter with varied accepted counts, greedy reference."""

from __future__ import annotations

import random

import torch

from specforge_opd.sglang.speculate import Drafter


class OracleDrafter(Drafter):
    """Proposes the target's own greedy tokens for a random number of slots, then wrong ones.

    A random tiny drafter accepts almost nothing; this one exercises every accepted
    count 0..bs-1 (so feature-row slicing and the anchor recurrence are tested).
    """

    def __init__(self, target, block_size: int, seed: int = 0):
        self.target = target
        self.block_size = block_size
        self.seed = seed

    @torch.inference_mode()
    def draft(self, context, slot0, anchor, prefix=None):
        assert context.shape[0] == anchor and prefix is not None and prefix[anchor] == slot0
        ids = list(prefix[: anchor + 1])
        # seeded by the prefix, not by call order: concurrent sequences must draft as sequential ones do
        n_good = random.Random(hash((self.seed, tuple(ids)))).randint(0, self.block_size - 1)
        out = []
        V = self.target.config.vocab_size
        for k in range(self.block_size - 1):
            nxt = int(self.target(torch.tensor([ids])).logits[0, -1].argmax())
            tok = nxt if k < n_good else (nxt + 1 + k) % V
            out.append(tok)
            ids.append(tok)
        return out


@torch.inference_mode()
def greedy_reference(target, prompt, max_new_tokens, stops):
    """Plain greedy decoding (full forward per token) and the top-2 logit gap at each step."""
    ids = list(prompt)
    gaps = []
    for _ in range(max_new_tokens):
        logits = target(torch.tensor([ids])).logits[0, -1]
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        ids.append(tok)
        if tok in stops:
            break
    return ids, gaps
