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

from specforge_opd.teacher_form import TEACHER_FORMS, TeacherForm

#: The tensors each teacher form holds, by their ``RolloutRecord`` names (also the shard's tensor keys).
TEACHER_TENSORS: dict[str, tuple[str, ...]] = {
    "full": ("teacher_hidden",),
    "topk": ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_draft_logprob"),
    "token": ("teacher_draft_logprob",),
}
_TEACHER_NAMES = ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logprobs", "teacher_draft_logprob")


@dataclass(frozen=True, eq=False)
class Teacher:
    """One record's teacher signal in one form; index ``k-1`` along the second axis is drafted slot k.

    Attributes (M blocks, bs block size):
        form: ``full``, ``topk`` or ``token`` (``TEACHER_FORMS``).
        hidden: float [M, bs-1, H], ``full``: the target's final-norm hidden state at
            verify slots 0..bs-2; logits = lm_head(hidden).
        topk_ids: int64 [M, bs-1, k], ``topk``.
        topk_logprobs: float32 [M, bs-1, k], ``topk`` (temperature 1, unfiltered).
        draft_logprob: float32 [M, bs-1], ``topk`` and ``token``: log p(d_{m,k}) under the teacher.

    Raises:
        ValueError: an unknown form, or tensors other than exactly the form's.
    """

    form: TeacherForm
    hidden: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None
    draft_logprob: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.form not in TEACHER_FORMS:
            raise ValueError(f"teacher form {self.form!r}: expected one of {', '.join(TEACHER_FORMS)}")
        have = tuple(self.tensors())
        if have != TEACHER_TENSORS[self.form]:
            raise ValueError(f"the {self.form} teacher holds {', '.join(TEACHER_TENSORS[self.form])}; got {', '.join(have) or 'none'}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors present, by their record (and shard) names, in ``TEACHER_TENSORS`` order."""
        vals = (self.hidden, self.topk_ids, self.topk_logprobs, self.draft_logprob)
        return {name: t for name, t in zip(_TEACHER_NAMES, vals) if t is not None}

    @classmethod
    def of(cls, teacher_hidden: Optional[torch.Tensor] = None, teacher_topk_ids: Optional[torch.Tensor] = None,
           teacher_topk_logprobs: Optional[torch.Tensor] = None, teacher_draft_logprob: Optional[torch.Tensor] = None) -> Optional[Teacher]:
        """The teacher that the tensors given by their record names make; its form is the one holding exactly those.

        Returns None when every tensor is None.

        Raises:
            ValueError: the tensors given are no form's set.
        """
        given = {"teacher_hidden": teacher_hidden, "teacher_topk_ids": teacher_topk_ids,
                 "teacher_topk_logprobs": teacher_topk_logprobs, "teacher_draft_logprob": teacher_draft_logprob}
        names = tuple(n for n, t in given.items() if t is not None)
        if not names:
            return None
        form = next((f for f, want in TEACHER_TENSORS.items() if want == names), None)
        if form is None:
            raise ValueError(f"teacher tensors {', '.join(names)} are no teacher form's set: "
                             + "; ".join(f"{f}: {', '.join(want)}" for f, want in TEACHER_TENSORS.items()))
        return cls(form, teacher_hidden, teacher_topk_ids, teacher_topk_logprobs, teacher_draft_logprob)


@dataclass(init=False)
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
        teacher: the ``Teacher`` (its form and tensors), or None (trainer recomputes it).
            Read-only ``teacher_hidden``, ``teacher_topk_ids``, ``teacher_topk_logprobs``
            and ``teacher_draft_logprob`` give its tensors (None when absent). The
            constructor also takes those four as keywords and infers the form
            (``Teacher.of``); give them or ``teacher=``, not both.
        finished: True when the sequence ended with a stop token.
        drafter_step: optimizer step of the drafter that produced the rollout.

    Raises:
        ValueError: the teacher tensors are no form's set, or both ``teacher`` and tensors are given.
    """

    sample_id: str
    input_ids: torch.Tensor
    prompt_len: int
    anchors: torch.Tensor
    drafts: torch.Tensor
    accepted: torch.Tensor
    features: Optional[torch.Tensor] = None
    teacher: Optional[Teacher] = None
    finished: bool = False
    drafter_step: int = 0
    extra: dict = field(default_factory=dict)

    def __init__(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        prompt_len: int,
        anchors: torch.Tensor,
        drafts: torch.Tensor,
        accepted: torch.Tensor,
        features: Optional[torch.Tensor] = None,
        teacher_hidden: Optional[torch.Tensor] = None,
        teacher_topk_ids: Optional[torch.Tensor] = None,
        teacher_topk_logprobs: Optional[torch.Tensor] = None,
        teacher_draft_logprob: Optional[torch.Tensor] = None,
        finished: bool = False,
        drafter_step: int = 0,
        extra: Optional[dict] = None,
        *,
        teacher: Optional[Teacher] = None,
    ) -> None:
        loose = Teacher.of(teacher_hidden, teacher_topk_ids, teacher_topk_logprobs, teacher_draft_logprob)
        if teacher is not None and loose is not None:
            raise ValueError(f"{sample_id}: give teacher= or the teacher_* tensors, not both")
        self.sample_id = sample_id
        self.input_ids = input_ids
        self.prompt_len = prompt_len
        self.anchors = anchors
        self.drafts = drafts
        self.accepted = accepted
        self.features = features
        self.teacher = teacher if teacher is not None else loose
        self.finished = finished
        self.drafter_step = drafter_step
        self.extra = {} if extra is None else extra

    @property
    def teacher_hidden(self) -> Optional[torch.Tensor]:
        return None if self.teacher is None else self.teacher.hidden

    @property
    def teacher_topk_ids(self) -> Optional[torch.Tensor]:
        return None if self.teacher is None else self.teacher.topk_ids

    @property
    def teacher_topk_logprobs(self) -> Optional[torch.Tensor]:
        return None if self.teacher is None else self.teacher.topk_logprobs

    @property
    def teacher_draft_logprob(self) -> Optional[torch.Tensor]:
        return None if self.teacher is None else self.teacher.draft_logprob

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

    def teacher_form(self) -> Optional[TeacherForm]:
        return None if self.teacher is None else self.teacher.form

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
        for name, t in (self.teacher.tensors() if self.teacher is not None else {}).items():
            if tuple(t.shape[:2]) != (M, self.block_size - 1):
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
