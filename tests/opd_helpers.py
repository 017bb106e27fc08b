"""Test records for the OPD trainer, computed with the target directly (no rollout engine).

The teacher at slot k comes from a separate verify forward per block: the target
run on [context up to a_m, token at a_m, d_1..d_{bs-1}] and read at slot k-1
(DESIGN.md section 3). This is deliberately a different code path from
``replay.recompute_from_target`` (one forward with a block mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specforge_opd.models.adapter import extract_context_feature
from specforge_opd.rollout.records import RolloutRecord


@torch.no_grad()
def greedy_continue(target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompt.clone()
    for _ in range(n):
        nxt = target(ids.view(1, -1)).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1)])
    return ids


@torch.no_grad()
def make_record(
    target,
    layer_ids,
    *,
    seed: int,
    prompt_len: int = 5,
    response_len: int = 14,
    block_size: int = 4,
    form: str = "full",
    topk: int = 8,
    greedy: bool = True,
    vocab_hi: int = 90,
    sample_id: str | None = None,
    drafter_step: int = 0,
) -> RolloutRecord:
    """One record with real anchors, mixed accepted counts, and target-computed signal.

    ``greedy=True``: the response is the target's greedy continuation, so an
    accepted draft equals the teacher's argmax at its slot.
    """
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab_hi, (prompt_len,), generator=g)
    T = prompt_len + response_len
    ids = greedy_continue(target, prompt, response_len) if greedy else torch.cat([prompt, torch.randint(3, vocab_hi, (response_len,), generator=g)])
    anchors, accepted, drafts = [], [], []
    a = prompt_len
    while True:
        r = int(torch.randint(0, block_size, (1,), generator=g))
        r = min(r, T - 2 - a)  # the bonus token a + r + 1 must exist in the sequence
        if r < 0:
            break
        d = torch.randint(3, vocab_hi, (block_size - 1,), generator=g)
        d[:r] = ids[a + 1 : a + 1 + r]
        if r < block_size - 1 and d[r] == ids[a + r + 1]:
            d[r] = (d[r] + 1) % vocab_hi  # a rejected draft differs from the verified token
        anchors.append(a), accepted.append(r), drafts.append(d)
        a = a + r + 1
        if a > T - 2:
            break
    anchors_t, acc_t, drafts_t = torch.tensor(anchors), torch.tensor(accepted), torch.stack(drafts)
    out = target(ids[: T - 1].view(1, -1), output_hidden_states=True)
    feats = extract_context_feature(out.hidden_states, layer_ids)[0].float()
    M, n = len(anchors), block_size - 1
    th = torch.zeros(M, n, target.config.hidden_size)
    logp = torch.zeros(M, n, target.config.vocab_size)
    for m in range(M):
        am = anchors[m]
        inp = torch.cat([ids[: am + 1], drafts_t[m]]).view(1, -1)
        o = target(inp, output_hidden_states=True)
        th[m] = o.hidden_states[-1][0, am : am + n]
        logp[m] = F.log_softmax(o.logits[0, am : am + n].float(), -1)
    if form == "full":
        teacher = {"teacher_hidden": th}
    else:
        teacher = {"teacher_draft_logprob": logp.gather(-1, drafts_t.view(M, n, 1)).squeeze(-1)}
        if form == "topk":
            v, i = logp.topk(topk, -1)
            teacher.update(teacher_topk_ids=i, teacher_topk_logprobs=v)
    rec = RolloutRecord(
        sample_id=sample_id or f"s{seed}",
        input_ids=ids,
        prompt_len=prompt_len,
        anchors=anchors_t,
        drafts=drafts_t,
        accepted=acc_t,
        features=feats,
        drafter_step=drafter_step,
        **teacher,
    )
    rec.validate()
    return rec


def make_records(target, layer_ids, n: int, *, seed0: int = 100, **kw) -> list[RolloutRecord]:
    return [make_record(target, layer_ids, seed=seed0 + i, **kw) for i in range(n)]
