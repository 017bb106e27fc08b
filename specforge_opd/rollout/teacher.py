"""The teacher signal at drafted slots from one verify pass, in the ``full``, ``topk`` or ``token`` form (DESIGN.md, teacher signal)."""

from __future__ import annotations

import torch

from specforge_opd.rollout.interfaces import Verified
from specforge_opd.rollout.records import TEACHER_TENSORS


def teacher_signal(v: Verified, drafts: torch.Tensor, form: str, topk: int) -> dict:
    """Teacher tensors at drafted slots 1..bs-1 from one verify pass (DESIGN.md, teacher signal).

    The output at verify slot k-1 is the teacher for d_k, at temperature 1 and
    unfiltered, whatever the rollout decodes at.

    Args:
        v: the verify pass of B blocks (``logits``/``hidden`` [B, bs, .] or the returned log-probs).
        drafts: int64 [B, bs-1], the drafted tokens (padding included).
        form: ``full`` -> ``teacher_hidden`` [B, bs-1, H]; ``topk`` -> ``teacher_topk_ids`` int64 and
            ``teacher_topk_logprobs`` float32 [B, bs-1, k] plus ``teacher_draft_logprob``;
            ``token`` -> ``teacher_draft_logprob`` float32 [B, bs-1].
        topk: k when computed from logits (clipped to the vocabulary).
    """
    if form == "full":
        return {"teacher_hidden": v.hidden[:, :-1]}
    if v.logits is not None:
        logp = torch.log_softmax(v.logits[:, :-1], dim=-1)
        out = {"teacher_draft_logprob": logp.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)}
        if form == "topk":
            k = min(topk, logp.shape[-1])
            top = torch.topk(logp, k, dim=-1)
            out["teacher_topk_ids"] = top.indices
            out["teacher_topk_logprobs"] = top.values
        return out
    out = {"teacher_draft_logprob": v.draft_logprob}
    if form == "topk":
        out["teacher_topk_ids"] = v.top_ids
        out["teacher_topk_logprobs"] = v.top_logprobs
    return out


def teacher_names(form: str) -> tuple:
    """The record fields a teacher form fills."""
    return TEACHER_TENSORS[form]
