"""One sequence's speculative rollout against a target side that may be remote.

The step is ``speculative.speculate`` (draft, verify, accept r_m plus one bonus
token, advance a_{m+1} = a_m + r_m + 1: paper section 4.1; DESIGN.md section 3),
driven here with a batch of one row. Greedy only (temperature 0): SGLang returns
top-k log-probs, not the full distribution, so a temperature-T sample cannot be
reproduced exactly over HTTP.

Target sides answer one request per sequence (``speculative.PerSequenceTarget``):
``LocalTarget`` runs an HF model in-process (the stand-in server and tests),
``verify_client.HTTPTarget`` asks SGLang. ``Drafter`` is the DFlash drafter
without a cache (``speculative.DFlashDrafter``).
"""

from __future__ import annotations

from typing import Optional

import torch

from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.rollout.step import (
    DFlashDrafter,
    PerSequenceTarget,
    PrefillResult,
    StepConfig,
    TargetCaps,
    VerifyResult,
    accepted_counts,
    speculate,
)

#: The per-sequence DFlash drafter (one forward over context + block, no cache).
Drafter = DFlashDrafter
#: Any target ``speculate_sequence`` drives (``speculative.Target``).
TargetSide = PerSequenceTarget

#: Why verify over SGLang's /generate cannot sample at T > 0 (quoted in the one-line error).
GREEDY_REASON = "the server returns top-k log-probs, not the full distribution to sample from"


def verify_caps(name: str, top_k: int, features: bool) -> TargetCaps:
    """Capabilities of a target that answers like SGLang's verify pass: greedy tokens, top-k log-probs, features if asked."""
    return TargetCaps(name=name, greedy_only=True, greedy_reason=GREEDY_REASON, teacher_forms=("topk", "token"),
                      features=bool(features), topk=int(top_k))


class LocalTarget(PerSequenceTarget):
    """An in-process HF target answering like SGLang's verify pass (full forward per request, no cache).

    Args:
        model: HF causal LM, eval mode.
        layer_ids: decoder layers whose outputs are the features (HF ``hidden_states[k + 1]``).
        top_k: width of the top-k teacher returned.
        want_features: return feature rows (float32 [n, len(layer_ids) * H]).
    """

    def __init__(self, model, layer_ids: list[int], top_k: int, want_features: bool = True):
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        self.top_k = int(top_k)
        self.want_features = want_features
        self.device = next(model.parameters()).device
        self.caps = verify_caps("the local verify target", self.top_k, want_features)

    @torch.inference_mode()
    def forward(self, ids: list[int]):
        """(logits float32 [n, V], features float32 [n, D] or None) of a full forward over ``ids``."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(x, output_hidden_states=self.want_features)
        feats = None
        if self.want_features:
            feats = torch.cat([out.hidden_states[k + 1][0] for k in self.layer_ids], dim=-1).float().cpu()
        return out.logits[0].float().cpu(), feats

    async def prefill_one(self, prompt_ids: list[int]) -> PrefillResult:
        logits, feats = self.forward(prompt_ids)
        return PrefillResult(int(logits[-1].argmax()), feats)

    async def verify_one(self, seq_ids: list[int], drafts: list[int]) -> VerifyResult:
        a = len(seq_ids) - 1
        logits, feats = self.forward(list(seq_ids) + list(drafts))
        return verify_result_from_logits(logits[a:], drafts, self.top_k, None if feats is None else feats[a:])


def verify_result_from_logits(block_logits: torch.Tensor, drafts: list[int], top_k: int, rows: Optional[torch.Tensor]) -> VerifyResult:
    """A ``VerifyResult`` from ``block_logits`` float [bs, V], the target's logits at slots 0..bs-1 of one verify pass."""
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
    """r_m of one block: the longest prefix of ``drafts`` equal to the target's greedy tokens
    ``predicted`` (int64 [>= len(drafts)]); ``speculative.accepted_counts`` for one row."""
    if not drafts:
        return 0
    return int(accepted_counts(torch.tensor([list(drafts)], dtype=torch.long), predicted.long().view(1, -1))[0])


async def speculate_sequence(
    target: TargetSide,
    drafter,
    prompt_ids: list[int],
    *,
    sample_id: str,
    max_new_tokens: int,
    stop_token_ids: list[int],
    teacher: str,
    store_features: bool,
    drafter_step: int = 0,
) -> RolloutRecord:
    """Roll out one sequence at temperature 0; returns its ``RolloutRecord`` (see ``specforge_opd.rollout.records``).

    ``speculative.speculate`` with one row: the response stops after the first stop
    token or at ``max_new_tokens``, a block cut short keeps only the tokens kept as
    accepted; ``features`` rows (float32 [T-1, D]) cover positions 0..T-2, each from
    the verify pass that accepted it (dropped when ``store_features`` is off).

    Args:
        target: a ``speculative.Target`` (``HTTPTarget``, ``LocalTarget``, or ``InProcessTarget``).
        drafter: a ``speculative.Drafter`` (``Drafter``, ``ngram.NgramDrafter``).
        teacher: ``topk`` | ``token`` (``full`` records none over a verify target: the trainer recomputes it).
    Raises:
        ContractError (from the target side); ValueError for an empty prompt or a drafter
        without the context features it needs.
    """
    if not prompt_ids:
        raise ValueError(f"{sample_id}: empty prompt")
    cfg = StepConfig(block_size=int(drafter.block_size), max_new_tokens=int(max_new_tokens),
                     stop_token_ids=frozenset(int(t) for t in stop_token_ids), temperature=0.0, teacher=teacher)
    rec = (await speculate(target, drafter, [(sample_id, [int(t) for t in prompt_ids])], cfg, drafter_step=drafter_step))[0]
    if not store_features:
        rec.features = None
    return rec
