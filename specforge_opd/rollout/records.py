"""What one speculative rollout records per sequence (paper section 4.2; DESIGN.md section 3).

The in-memory contract between the rollout engine (writer), the shard format
(``specforge_opd.rollout.shards``) and the OPD trainer (reader). Conventions:

* ``block_size`` (bs) slots per block; slot 0 holds the token at the anchor,
  slots 1..bs-1 are drafted. The paper's K = bs - 1.
* ``anchors[m]`` = a_m, the absolute index (prompt included) of slot 0's token;
  a_0 = prompt_len; a_{m+1} = a_m + accepted[m] + 1 (real anchors).
* ``drafts[m, k-1]`` = d_{m,k}, the drafter's token for slot k, predicting the
  token at position a_m + k.
* ``accepted[m]`` = r_m in 0..bs-1: the drafted prefix the verify step accepted.
  The last block may be cut by a stop token or ``max_new_tokens``: its r_M is then
  clipped to the tokens kept, so a_M + r_M + 1 <= T always holds (= T when the
  sequence ends on an accepted draft, = T - 1 when it ends on the bonus token) and
  every accepted slot's token is in ``input_ids``.
* Teacher signal at drafted slot k comes from the verify pass of block m, the
  target's output at slot k-1 (conditioned on [slot 0, d_1..d_{k-1}]); index
  ``k-1`` along the second axis of every teacher tensor. Entry r_m (slot r_m+1)
  is conditioned on accepted tokens only: it is also the bonus distribution.
* ``features`` rows are positions 0..T-2 of ``input_ids`` (the final token is
  never fed to the target): shape [T-1, n_layers * hidden], layer order =
  ``target_layer_ids`` order, layer k = HF ``hidden_states[k + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from specforge_opd.teacher_form import TEACHER_FORMS  # noqa: F401  (re-exported: the record's forms)


@dataclass
class RolloutRecord:
    """One rolled-out sequence.

    Attributes (dtypes as stored):
        sample_id: the prompt's id (``PromptRecord.id``).
        input_ids: int64 [T], prompt + verified response.
        prompt_len: number of prompt tokens (= anchors[0] for real anchors).
        anchors: int64 [M].
        drafts: int64 [M, bs-1].
        accepted: int64 [M], values in 0..bs-1.
        features: float [T-1, n*H] or None (trainer recomputes, ``feature_source: target``).
        teacher_hidden: float [M, bs-1, H], ``full`` form: the target's final-norm
            hidden state at verify slots 0..bs-2; logits = lm_head(teacher_hidden).
        teacher_topk_ids: int64 [M, bs-1, k], ``topk`` form.
        teacher_topk_logprobs: float32 [M, bs-1, k], ``topk`` form (temperature 1, unfiltered).
        teacher_draft_logprob: float32 [M, bs-1]: log p(d_{m,k}) under the teacher;
            present for ``topk`` and ``token`` forms.
        finished: True when the sequence ended with a stop token.
        drafter_step: optimizer step of the drafter that produced the rollout.
    """

    sample_id: str
    input_ids: torch.Tensor
    prompt_len: int
    anchors: torch.Tensor
    drafts: torch.Tensor
    accepted: torch.Tensor
    features: Optional[torch.Tensor] = None
    teacher_hidden: Optional[torch.Tensor] = None
    teacher_topk_ids: Optional[torch.Tensor] = None
    teacher_topk_logprobs: Optional[torch.Tensor] = None
    teacher_draft_logprob: Optional[torch.Tensor] = None
    finished: bool = False
    drafter_step: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.numel())

    @property
    def block_size(self) -> int:
        return int(self.drafts.shape[1]) + 1

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, the prefill token included (SGLang's convention)."""
        return int(self.input_ids.numel()) - int(self.prompt_len)

    def teacher_form(self) -> Optional[str]:
        if self.teacher_hidden is not None:
            return "full"
        if self.teacher_topk_ids is not None:
            return "topk"
        if self.teacher_draft_logprob is not None:
            return "token"
        return None

    def validate(self) -> None:
        """Check shapes and the anchor recurrence; raise ValueError naming the field."""
        T = int(self.input_ids.numel())
        M = self.num_blocks
        if self.drafts.dim() != 2 or self.drafts.shape[0] != M:
            raise ValueError(f"{self.sample_id}: drafts shape {tuple(self.drafts.shape)} != [M={M}, bs-1]")
        if self.accepted.shape != (M,):
            raise ValueError(f"{self.sample_id}: accepted shape {tuple(self.accepted.shape)} != [{M}]")
        if M and (int(self.accepted.min()) < 0 or int(self.accepted.max()) > self.block_size - 1):
            raise ValueError(f"{self.sample_id}: accepted counts outside 0..{self.block_size - 1}")
        if M and (int(self.anchors.min()) < 0 or int(self.anchors.max()) > T - 1):
            raise ValueError(f"{self.sample_id}: anchors outside 0..T-1={T - 1}")
        if self.features is not None and self.features.shape[0] != T - 1:
            raise ValueError(f"{self.sample_id}: features rows {self.features.shape[0]} != T-1={T - 1}")
        for name in ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logprobs", "teacher_draft_logprob"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape[:2]) != (M, self.block_size - 1):
                raise ValueError(f"{self.sample_id}: {name} shape {tuple(t.shape)} != [M={M}, bs-1={self.block_size - 1}, ...]")


def tau_of(records: list[RolloutRecord]) -> float:
    """Pooled accepted length: total completion tokens / total verify steps (DESIGN.md, tau).

    The prefill token counts as a completion token; each verify step yields
    r_m + 1 tokens. Equals SGLang's ``spec_accept_length`` pooled over requests.
    Returns 0.0 when there are no verify steps.
    """
    steps = sum(r.num_blocks for r in records)
    toks = sum(r.completion_tokens for r in records)
    return toks / steps if steps else 0.0


def accepted_histogram(records: list[RolloutRecord], block_size: int) -> list[int]:
    """Counts of verify steps by accepted length r_m + 1 (index 1..bs; index 0 unused)."""
    hist = [0] * (block_size + 1)
    for r in records:
        for a in r.accepted.tolist():
            hist[int(a) + 1] += 1
    return hist
