"""Prompt-lookup drafting: the baseline that needs no training (every evaluation table's ``ngram`` row).

The drafter proposes, for a block at anchor a, the tokens that followed the
last earlier occurrence of the sequence's last n tokens (n from ``max_ngram``
down to 1, the longest match wins), up to ``block_size - 1`` of them. Scored by
the same exact offline replay and pooled tau as the DFlash drafters
(``evaluate``): at T=0 the verified output is the target's greedy trajectory,
so r_m is the longest prefix of the proposal equal to the trajectory after the
anchor, clipped to the tokens the trajectory has, and a_{m+1} = a_m + r_m + 1
(DESIGN.md, anchors and tau).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.rollout.step import Draft

#: Name of the prompt-lookup row in evaluation tables.
NGRAM_NAME = "prompt lookup (ngram)"


def propose(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the last earlier occurrence of the last n tokens of ``tokens``.

    Args:
        tokens: the sequence so far (prompt and verified tokens; its last token is slot 0).
        k: how many tokens to propose (``block_size - 1``).
        max_ngram: longest suffix tried first; then shorter ones down to 1.
    Returns:
        The proposal (possibly shorter than k, or empty when no suffix recurs).
    Raises:
        ValueError: ``max_ngram`` < 1.
    """
    if max_ngram < 1:
        raise ValueError(f"eval.ngram_max={max_ngram}: must be at least 1")
    T = len(tokens)
    for n in range(min(max_ngram, T - 1), 0, -1):
        suffix = list(tokens[T - n:])
        # latest earlier start i < T - n whose n tokens equal the suffix
        for i in range(T - n - 1, -1, -1):
            if list(tokens[i:i + n]) == suffix:
                return list(tokens[i + n:i + n + k])
    return []


def ngram_offline_tau(trajectories, block_size: int, sample_ids: Optional[list[str]] = None,
                      max_ngram: int = 3) -> list[RolloutRecord]:
    """Replay prompt-lookup drafting at T=0 against cached greedy trajectories (``replay.TrajectoryCache``).

    Args:
        trajectories: objects with ``input_ids`` (int64 [E]), ``prompt_len`` and ``finished``.
        block_size: slots per block (``block_size - 1`` proposed tokens), as the DFlash drafter's.
    Returns:
        One RolloutRecord per trajectory (anchors [M], accepted [M], drafts [M, bs-1] with -1
        where nothing was proposed); pool with ``records.tau_of``.
    """
    sample_ids = sample_ids or [str(i) for i in range(len(trajectories))]
    k = int(block_size) - 1
    out = []
    for tr, sid in zip(trajectories, sample_ids):
        ids = tr.input_ids.tolist()
        E, a = len(ids), int(tr.prompt_len)
        anchors, drafts, accepted = [], [], []
        while a < E - 1:
            prop = propose(ids[: a + 1], k, max_ngram)
            limit = min(k, E - 1 - a)
            r = 0
            while r < min(len(prop), limit) and prop[r] == ids[a + 1 + r]:
                r += 1
            anchors.append(a)
            drafts.append(prop + [-1] * (k - len(prop)))
            accepted.append(r)
            a += r + 1
        out.append(
            RolloutRecord(
                sample_id=sid,
                input_ids=tr.input_ids.clone(),
                prompt_len=int(tr.prompt_len),
                anchors=torch.tensor(anchors, dtype=torch.long),
                drafts=torch.tensor(drafts, dtype=torch.long) if anchors else torch.zeros((0, k), dtype=torch.long),
                accepted=torch.tensor(accepted, dtype=torch.long),
                finished=bool(tr.finished),
                extra={"offline": True, "drafter": "ngram"},
            )
        )
    return out


class NgramDrafter:
    """Prompt lookup as a ``speculative.Drafter``: per row, ``propose`` on the sequence so far.

    A proposal shorter than bs-1 tokens is padded with ``pad_token_id`` (a valid id the
    target can verify) and its length reported, so the step never accepts padding
    (``speculative.accepted_counts``); records show the padding as -1, as
    ``ngram_offline_tau`` does.

    Args:
        block_size: slots per block (bs-1 proposed tokens), as the DFlash drafter's.
        max_ngram: longest suffix tried first (``eval.ngram_max``).
        pad_token_id: the id sent to the target in padded slots.
    Raises:
        ValueError: ``max_ngram`` < 1 (at the first draft).
    """

    def __init__(self, block_size: int, max_ngram: int = 3, pad_token_id: int = 0):
        self.block_size = int(block_size)
        self.max_ngram = int(max_ngram)
        self.pad_token_id = int(pad_token_id)

    async def propose(self, req):
        """``req``: a ``speculative.DraftRequest``; returns a ``speculative.Draft`` (tokens int64 [B, bs-1] on the CPU, lengths int64 [B])."""
        k = self.block_size - 1
        props = [propose(toks, k, self.max_ngram) for toks in req.tokens]
        tokens = torch.tensor([p + [self.pad_token_id] * (k - len(p)) for p in props], dtype=torch.long).reshape(len(props), k)
        return Draft(tokens=tokens, lengths=torch.tensor([len(p) for p in props], dtype=torch.long))
