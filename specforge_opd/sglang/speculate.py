"""One sequence's speculative rollout, written against a target side that may be remote.

The loop is the paper's target-assisted rollout (section 4.1; DESIGN.md section 3):
the target prefills the prompt and yields the first response token (a_0 = prompt
length); then per block the drafter proposes the argmax of slots 1..bs-1 from the
context features before the anchor and slot 0, the target verifies
[slot 0, d_1..d_{bs-1}], r_m drafted tokens are accepted and one bonus token is
added (a_{m+1} = a_m + r_m + 1). Greedy only (temperature 0): SGLang returns top-k
log-probs, not the full distribution, so a temperature-T sample cannot be
reproduced exactly over HTTP.

A ``TargetSide`` answers ``prefill`` and ``verify``; ``LocalTarget`` runs an HF
model in-process (the stand-in server and tests), ``verify_client.HTTPTarget``
asks SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..records import RolloutRecord


@dataclass
class PrefillResult:
    """first_token: the target's greedy token at position P; rows: float32 [P, D] features of the prompt or None."""

    first_token: int
    rows: Optional[torch.Tensor]


@dataclass
class VerifyResult:
    """The verify pass of one block at anchor a (block size bs).

    Attributes:
        predicted: int64 [bs], the target's greedy token for positions a+1..a+bs
            (entry j from the output at slot j).
        draft_logprob: float32 [bs-1], log p(d_k) at drafted slot k (teacher, temperature 1).
        top_ids, top_logprobs: int64 / float32 [bs-1, k], the teacher's top-k at drafted slots.
        rows: float32 [bs, D] features of positions a..a+bs-1, or None.
    """

    predicted: torch.Tensor
    draft_logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    rows: Optional[torch.Tensor]


class TargetSide(Protocol):
    async def prefill(self, prompt_ids: list[int]) -> PrefillResult: ...

    async def verify(self, seq_ids: list[int], drafts: list[int]) -> VerifyResult: ...


class Drafter:
    """The DFlash drafter with the target's frozen embedding and lm_head (the drafter has neither).

    ``draft(context, slot0, anchor, prefix)``: context float [a, n*H] (features of positions
    0..a-1; ``prefix``, the tokens 0..a, is unused by DFlash), returns the bs-1 argmax tokens for slots 1..bs-1. No draft KV cache:
    one forward over context + block, the same function ``spec_generate`` computes
    with its cache.
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
    def draft(self, context: torch.Tensor, slot0: int, anchor: int, prefix: Optional[list[int]] = None) -> list[int]:
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


class LocalTarget:
    """An in-process HF target answering like SGLang's verify pass (full forward, no cache)."""

    def __init__(self, model, layer_ids: list[int], top_k: int, want_features: bool = True):
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        self.top_k = int(top_k)
        self.want_features = want_features
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def forward(self, ids: list[int]):
        """(logits float32 [n, V], features float32 [n, D] or None) of a full forward over ``ids``."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(x, output_hidden_states=self.want_features)
        feats = None
        if self.want_features:
            feats = torch.cat([out.hidden_states[k + 1][0] for k in self.layer_ids], dim=-1).float().cpu()
        return out.logits[0].float().cpu(), feats

    async def prefill(self, prompt_ids: list[int]) -> PrefillResult:
        logits, feats = self.forward(prompt_ids)
        return PrefillResult(int(logits[-1].argmax()), feats)

    async def verify(self, seq_ids: list[int], drafts: list[int]) -> VerifyResult:
        a = len(seq_ids) - 1
        logits, feats = self.forward(list(seq_ids) + list(drafts))
        return verify_result_from_logits(logits[a:], drafts, self.top_k, None if feats is None else feats[a:])


def verify_result_from_logits(block_logits: torch.Tensor, drafts: list[int], top_k: int, rows: Optional[torch.Tensor]) -> VerifyResult:
    """``block_logits`` float [bs, V]: the target's logits at slots 0..bs-1 of one verify pass."""
    lp = torch.log_softmax(block_logits.float(), dim=-1)
    d = torch.tensor(drafts, dtype=torch.long)
    top = lp[:-1].topk(max(top_k, 1), dim=-1)
    return VerifyResult(
        predicted=block_logits.argmax(-1).long(),
        draft_logprob=lp[:-1].gather(1, d[:, None])[:, 0],
        top_ids=top.indices[:, :top_k].long(),
        top_logprobs=top.values[:, :top_k].float(),
        rows=rows,
    )


def accepted_count(drafts: list[int], predicted: torch.Tensor) -> int:
    """r_m: the longest prefix of drafts equal to the target's greedy tokens (DESIGN.md, sampling)."""
    r = 0
    for k, tok in enumerate(drafts):
        if int(predicted[k]) != int(tok):
            break
        r += 1
    return r


async def speculate_sequence(
    target: TargetSide,
    drafter: Drafter,
    prompt_ids: list[int],
    *,
    sample_id: str,
    max_new_tokens: int,
    stop_token_ids: list[int],
    teacher: str,
    store_features: bool,
    drafter_step: int = 0,
) -> RolloutRecord:
    """Roll out one sequence; returns its ``RolloutRecord`` (see ``specforge_opd.records``).

    Truncation: the response stops after the first stop token or at
    ``max_new_tokens`` (tokens past either are dropped from ``input_ids``, the
    block's ``accepted`` count is kept as verified). ``features`` rows cover
    positions 0..T-2, one row per position, each taken from the verify pass that
    accepted that position (so each accepted token contributes exactly one row).

    Raises:
        ContractError (from the target side), ValueError for an empty prompt.
    """
    if not prompt_ids:
        raise ValueError(f"{sample_id}: empty prompt")
    P = len(prompt_ids)
    stops = set(int(t) for t in stop_token_ids)
    pre = await target.prefill(list(prompt_ids))
    seq = list(prompt_ids) + [pre.first_token]
    feat_rows: list[torch.Tensor] = [pre.rows] if store_features else []
    anchors, drafts_all, accepted, d_lp, t_ids, t_lps = [], [], [], [], [], []
    finished = pre.first_token in stops
    while not finished and len(seq) - P < max_new_tokens:
        a = len(seq) - 1
        context = torch.cat(feat_rows, 0) if store_features else None
        if context is None:
            raise ValueError("the drafter needs context features: speculative rollout requires rollout.store_features or a feature-returning target")
        drafts = drafter.draft(context, seq[a], a, prefix=list(seq))
        v = await target.verify(seq, drafts)
        r = accepted_count(drafts, v.predicted)
        new = drafts[:r] + [int(v.predicted[r])]
        anchors.append(a)
        drafts_all.append(drafts)
        accepted.append(r)
        d_lp.append(v.draft_logprob)
        t_ids.append(v.top_ids)
        t_lps.append(v.top_logprobs)
        if store_features:
            if v.rows is None or v.rows.shape[0] < r + 1:
                raise ValueError(f"{sample_id}: verify pass at anchor {a} returned no feature rows for the {r + 1} accepted positions")
            feat_rows.append(v.rows[: r + 1])
        for tok in new:
            seq.append(tok)
            if tok in stops:
                finished = True
                break
            if len(seq) - P >= max_new_tokens:
                break
    T = len(seq)
    bs = drafter.block_size
    M = len(anchors)
    rec = RolloutRecord(
        sample_id=sample_id,
        input_ids=torch.tensor(seq, dtype=torch.long),
        prompt_len=P,
        anchors=torch.tensor(anchors, dtype=torch.long),
        drafts=torch.tensor(drafts_all, dtype=torch.long).reshape(M, bs - 1),
        accepted=torch.tensor(accepted, dtype=torch.long),
        finished=finished,
        drafter_step=drafter_step,
    )
    if store_features:
        rec.features = torch.cat(feat_rows, 0)[: T - 1].float()
    if teacher in ("topk", "token"):
        rec.teacher_draft_logprob = torch.stack(d_lp).float() if M else torch.zeros(0, bs - 1)
    if teacher == "topk":
        k = t_ids[0].shape[-1] if M else 0
        rec.teacher_topk_ids = torch.stack(t_ids).long() if M else torch.zeros(0, bs - 1, k, dtype=torch.long)
        rec.teacher_topk_logprobs = torch.stack(t_lps).float() if M else torch.zeros(0, bs - 1, k)
    rec.validate()
    return rec
