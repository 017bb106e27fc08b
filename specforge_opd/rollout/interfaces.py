"""The contracts of the speculative step (``step.speculate``): what a target and a drafter are asked and answer.

``Target`` (prefill, verify, advance, keep) with its ``TargetCaps`` and answers ``Prefilled`` /
``Verified``; ``Drafter`` with its ``DraftRequest`` and ``Draft``. The implementations live elsewhere:
``inprocess.InProcessTarget``, ``step.PerSequenceTarget`` (``sglang.verify_client.HTTPTarget``,
``sglang.speculate.LocalTarget``), ``drafters.CachedDFlashDrafter`` / ``DFlashDrafter`` and
``eval.ngram.NgramDrafter``. This module imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass(frozen=True)
class TargetCaps:
    """What a target can give, stated up front so a bad setting fails before any work.

    Attributes:
        name: how error messages name the backend (``"SGLang verify mode"``).
        greedy_only: the target returns its own greedy tokens, not a distribution to sample
            from, so ``rollout.temperature`` must be 0.
        greedy_reason: why (quoted in the error).
        teacher_forms: the ``rollout.teacher`` forms it can record; another form records
            no teacher (the trainer recomputes it, ``training.feature_source=target``).
        features: it returns context features of the requested layers.
        vocab_size, hidden_size, hidden_dtype: shapes of empty teacher tensors (a row
            whose first token ends it); None where the target does not know them.
        topk: width of the top-k teacher it returns (remote targets fix it per request);
            None: ``rollout.teacher_topk`` clipped to the vocabulary.
    """

    name: str
    greedy_only: bool
    teacher_forms: tuple
    features: bool
    greedy_reason: str = ""
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    hidden_dtype: Optional[torch.dtype] = None
    topk: Optional[int] = None


def greedy_only_error(temperature: float, caps: TargetCaps) -> ValueError:
    """The one-line error for T > 0 on a greedy-only target, naming the setting."""
    return ValueError(
        f"rollout.temperature={temperature}: {caps.name} is greedy only ({caps.greedy_reason}); "
        "set rollout.temperature=0 or use rollout.backend=embedded"
    )


@dataclass
class Prefilled:
    """The target's answer to a prefill of B prompts.

    Exactly one of ``logits`` / ``tokens`` is set.

    Attributes:
        logits: float32 [B, 1, V] at each prompt's last position (the step samples the first token).
        tokens: int64 [B, 1], the target's own (greedy) first token.
        rows: per row float [P_b, D] features of the prompt positions, or None.
    """

    logits: Optional[torch.Tensor] = None
    tokens: Optional[torch.Tensor] = None
    rows: Optional[list] = None


@dataclass
class Verified:
    """The target's answer to a verify pass of B blocks ``[slot 0, d_1..d_{bs-1}]``.

    Exactly one of ``logits`` / ``tokens`` is set; the teacher comes from ``logits`` (and
    ``hidden``) when set, else from the log-probs the target returned.

    Attributes:
        logits: float32 [B, bs, V] at slots 0..bs-1 (slot k predicts position a + k + 1).
        hidden: [B, bs, H] final-norm hidden states at the slots (the ``full`` teacher), or None.
        tokens: int64 [B, bs], the target's greedy token at each slot.
        draft_logprob: float32 [B, bs-1], log p(d_k) at drafted slot k (from slot k-1).
        top_ids, top_logprobs: int64 / float32 [B, bs-1, k], the teacher's top k at drafted slots.
        rows: per row float [>= r+1, D] features of positions a..a+bs-1 (indexable by row), or None.
    """

    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    tokens: Optional[torch.Tensor] = None
    draft_logprob: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None
    rows: Optional[object] = None


class Target(Protocol):
    """A target the step drives: "verify these blocks for these rows; give me logits or log-probs, and
    features if asked", plus prefill. Rows are the batch's rows in order; ``keep`` drops finished ones.

    A stateful target (``InProcessTarget``: a KV cache) learns from ``advance`` how many slots of
    the last verify pass each row kept; a stateless one (HTTP: every request carries the whole
    sequence) ignores ``advance`` and ``keep``.
    """

    caps: TargetCaps

    async def prefill(self, prompts: list) -> Prefilled:
        """``prompts``: per row the prompt's token ids (non-empty lists)."""
        ...

    async def verify(self, tokens: list, blocks: torch.Tensor, anchors: torch.Tensor) -> Verified:
        """``tokens``: per row the sequence so far (positions 0..a); ``blocks`` int64 [B, bs]; ``anchors`` int64 [B]."""
        ...

    def advance(self, accepted: torch.Tensor) -> None:
        """Row b kept slots 0..accepted[b] of the last verify pass (int64 [B])."""
        ...

    def keep(self, rows: list) -> None:
        """Keep only these rows (indices into the current batch, in order)."""
        ...


@dataclass
class DraftRequest:
    """What a drafter sees for B rows about to be verified.

    Attributes:
        tokens: per row the sequence so far, positions 0..a (its last token is slot 0).
        features: per row the list of feature tensors of positions 0..a-1 in order
            (concatenate for the context), empty when the target returns none.
        anchors: int64 [B] (= len(tokens[b]) - 1); slot0: int64 [B] (= tokens[b][-1]).
    """

    tokens: list
    features: list
    anchors: torch.Tensor
    slot0: torch.Tensor


@dataclass
class Draft:
    """A drafter's proposal for B blocks.

    Attributes:
        tokens: int64 [B, bs-1], valid token ids (padding included).
        lengths: int64 [B] proposed tokens per row when fewer than bs-1 (prompt lookup);
            slots past it are padding, never accepted and recorded as -1. None: all bs-1.
        logits: float32 [B, bs-1, V] the drafter's logits, or None (kept with
            ``record_draft_logits``).
    """

    tokens: torch.Tensor
    lengths: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class Drafter(Protocol):
    """Proposes bs-1 tokens per row (``block_size`` = bs)."""

    block_size: int

    async def propose(self, req: DraftRequest) -> Draft: ...
