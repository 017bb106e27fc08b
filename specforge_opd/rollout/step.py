"""The speculative draft -> verify -> accept -> advance step, written once (paper section 4.1-4.2; DESIGN.md sections 3 and 5).

``speculate`` rolls out a batch of rows against a *target* and a *drafter*:

- the target prefills every prompt and yields the first response token, so
  a_0 = prompt length;
- per block m the drafter proposes d_1..d_{bs-1} for slots 1..bs-1 from the
  context before the anchor a_m and slot 0 (the token at a_m);
- the target verifies ``[slot 0, d_1..d_{bs-1}]`` in one forward; its token at
  slot k-1 is compared with d_k (argmax at T=0, the row's seeded sample at T>0:
  DESIGN.md, sampling), the longest matching prefix r_m is accepted and the
  target's token at slot r_m is the bonus, so a_{m+1} = a_m + r_m + 1;
- a stop token or ``max_new_tokens`` ends a row; a block cut short keeps only
  the tokens kept as accepted (``a_M + r_M + 1 <= T``);
- the record of each row (``records.RolloutRecord``) holds the anchors, drafts,
  accepted counts, one feature row per position 0..T-2 (each from the forward
  that verified that position) and the teacher signal at drafted slots
  (temperature 1, unfiltered: DESIGN.md, teacher signal).

Batched and per-sequence driving are the same code: the in-process rollout
calls ``speculate`` once with B rows (``run_inline``), SGLang's verify mode once
per prompt with B = 1.

The interfaces (``Target``, ``Drafter`` and what they answer) are in
``interfaces``, the teacher signal of a verify pass in ``teacher``. Targets:
``inprocess.InProcessTarget`` (an HF model on a preallocated KV cache: the slot
layout, valid maps with holes and compaction live in it),
``sglang.verify_client.HTTPTarget`` (SGLang's ``/generate``) and
``sglang.speculate.LocalTarget`` (the same answers in-process, for the
stand-in server and tests), the last two on ``PerSequenceTarget`` here.
Drafters: ``drafters.CachedDFlashDrafter`` (the DFlash drafter on the
in-process target's slot layout, with its own cache of projected context
features), ``drafters.DFlashDrafter`` (no cache: one forward over the whole
context, what the HTTP path runs) and ``ngram.NgramDrafter`` (prompt lookup).
This module re-exports the moved names (``step.InProcessTarget`` and so on).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

# the moved implementations stay reachable here (``step.InProcessTarget`` ...): engine, sglang and tests import them so
from specforge_opd.rollout.drafters import CachedDFlashDrafter, DFlashDrafter  # noqa: F401
from specforge_opd.rollout.inprocess import COMPACT_BELOW, COMPACT_MIN_SLOTS, InProcessTarget  # noqa: F401
from specforge_opd.rollout.interfaces import (  # noqa: F401
    Draft,
    Drafter,
    DraftRequest,
    Prefilled,
    Target,
    TargetCaps,
    Verified,
    greedy_only_error,
)
from specforge_opd.rollout.records import RolloutRecord, Teacher
from specforge_opd.rollout.teacher import teacher_names, teacher_signal


# ---------------------------------------------------------------------------
# sampling (DESIGN.md, sampling)


def sample_seed(seed: int, sample_id: str, bits: int = 63) -> int:
    """The seed of one sample: ``bits`` bits of sha256("seed:sample_id"), so a sample draws the same
    tokens whatever batch, order or server decodes it (SGLang's ``sampling_seed`` takes 31 bits)."""
    h = hashlib.sha256(f"{int(seed)}:{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << bits) - 1)


def row_generator(seed: int, sample_id: str, device="cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded from (seed, sample_id) (``sample_seed``), so a row samples the same
    tokens whatever batch it is decoded in."""
    g = torch.Generator(device=device)
    g.manual_seed(sample_seed(seed, sample_id))
    return g


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution the decoder samples from: softmax(logits / T), then top-k and top-p filtering.

    Args:
        logits: float [..., V].
        temperature: > 0.
    Returns:
        float32 [..., V] probabilities summing to 1 over the kept tokens.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k and 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        csum = sorted_p.cumsum(-1)
        # keep a token when the mass before it is still below top_p (the first token always stays)
        keep_sorted = (csum - sorted_p) < top_p * csum[..., -1:]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def sample_tokens(
    logits: torch.Tensor, generators: Sequence[torch.Generator], temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Pick a token per position: argmax at T=0, else one draw per position from ``sampling_probs``.

    Args:
        logits: float [B, S, V]; row b draws with ``generators[b]`` (inverse-CDF sampling).
    Returns:
        int64 [B, S].
    """
    if temperature <= 0.0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    cdf = probs.cumsum(-1)
    out = torch.empty(probs.shape[:2], dtype=torch.long, device=logits.device)
    for b, g in enumerate(generators):
        u = torch.rand(probs.shape[1], generator=g, device=g.device).to(cdf.device) * cdf[b, :, -1]
        out[b] = torch.searchsorted(cdf[b], u.unsqueeze(-1)).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return out


def accepted_counts(drafts: torch.Tensor, target_tokens: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """r_m per row: the longest prefix of ``drafts`` equal to the target's own tokens (DESIGN.md, sampling).

    Args:
        drafts: int64 [B, K] (K = bs - 1).
        target_tokens: int64 [B, >= K]; column k is the target's token at verify slot k,
            i.e. the one drafted slot k + 1 must equal.
        lengths: int64 [B], proposal lengths when a drafter proposes fewer than K tokens
            (prompt lookup); the slots past a row's length are padding and never accepted.
    Returns:
        int64 [B] in 0..K.
    """
    acc = (drafts == target_tokens[:, : drafts.shape[1]]).long().cumprod(1).sum(1)
    if lengths is not None:
        acc = torch.minimum(acc, lengths.to(acc.device))
    return acc


# ---------------------------------------------------------------------------
# the step


@dataclass
class StepConfig:
    """The settings of a rollout (``config.RolloutConfig`` fields, and the target's stop tokens).

    ``teacher``: ``full`` | ``topk`` | ``token`` (DESIGN.md section 4, estimators);
    ``teacher_topk``: k of the ``topk`` form when the target gives logits;
    ``seed``: with the sample id, seeds each row's sampler (T > 0).
    """

    block_size: int
    max_new_tokens: int
    stop_token_ids: frozenset
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    teacher: str = "token"
    teacher_topk: int = 1
    seed: int = 0
    record_draft_logits: bool = False


@dataclass
class _Row:
    """Per-sequence bookkeeping while it decodes."""

    sample_id: str
    tokens: list
    prompt_len: int
    gen: Optional[torch.Generator]
    anchors: list = field(default_factory=list)
    drafts: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    features: list = field(default_factory=list)
    teacher: list = field(default_factory=list)  # one dict per block
    draft_logits: list = field(default_factory=list)
    finished: bool = False
    done: bool = False


def _append(row: _Row, new: list, cfg: StepConfig, block: Optional[int] = None) -> int:
    """Add verified tokens to a row, stopping at a stop token or the max_new_tokens budget.

    When the sequence ends inside a block, that block's accepted count is
    clipped to the tokens kept, so ``a_M + r_M + 1 <= T`` and every accepted
    slot has its token in ``input_ids``. Returns the number of tokens added.
    """
    room = cfg.max_new_tokens - (len(row.tokens) - row.prompt_len)
    added = 0
    for t in new[: max(room, 0)]:
        row.tokens.append(int(t))
        added += 1
        if int(t) in cfg.stop_token_ids:
            row.finished = True
            break
    row.done = row.finished or len(row.tokens) - row.prompt_len >= cfg.max_new_tokens
    if block is not None:
        # ``added`` tokens follow the anchor; a block cut short keeps only those as accepted
        row.accepted.append(min(block, added))
    return added


def _target_tokens(logits, tokens, gens, cfg: StepConfig) -> torch.Tensor:
    """The target's token per slot: sampled from ``logits`` with each row's generator, or as it gave them."""
    if logits is not None:
        return sample_tokens(logits, gens, cfg.temperature, cfg.top_p, cfg.top_k)
    return tokens


def _empty_teacher(name: str, caps: TargetCaps, cfg: StepConfig) -> torch.Tensor:
    """A teacher tensor with no blocks (a row whose first token ended it)."""
    bs = cfg.block_size
    if name == "teacher_hidden":
        return torch.zeros(0, bs - 1, caps.hidden_size or 0, dtype=caps.hidden_dtype or torch.float32)
    k = caps.topk if caps.topk is not None else min(cfg.teacher_topk, caps.vocab_size or cfg.teacher_topk)
    if name == "teacher_topk_ids":
        return torch.zeros(0, bs - 1, k, dtype=torch.long)
    if name == "teacher_topk_logprobs":
        return torch.zeros(0, bs - 1, k)
    return torch.zeros(0, bs - 1)


def _record(r: _Row, cfg: StepConfig, caps: TargetCaps, drafter_step: int) -> RolloutRecord:
    """A row's ``RolloutRecord``: features cut to positions 0..T-2, teacher stacked per block."""
    bs = cfg.block_size
    M = len(r.anchors)
    T = len(r.tokens)
    feats = torch.cat(r.features, dim=0)[: T - 1].cpu() if r.features else None
    names = teacher_names(cfg.teacher) if cfg.teacher in caps.teacher_forms else ()
    teacher = {name: torch.stack([t[name] for t in r.teacher]).cpu() if M else _empty_teacher(name, caps, cfg) for name in names}
    rec = RolloutRecord(
        sample_id=r.sample_id,
        input_ids=torch.tensor(r.tokens, dtype=torch.long),
        prompt_len=r.prompt_len,
        anchors=torch.tensor(r.anchors, dtype=torch.long),
        drafts=torch.stack(r.drafts).cpu() if M else torch.zeros(0, bs - 1, dtype=torch.long),
        accepted=torch.tensor(r.accepted, dtype=torch.long),
        features=feats,
        teacher=Teacher.of(**teacher),
        finished=r.finished,
        drafter_step=int(drafter_step),
    )
    if cfg.record_draft_logits:
        rec.extra["draft_logits"] = torch.stack(r.draft_logits).cpu() if M and r.draft_logits else None
    rec.validate()
    return rec


def _start_rows(indices: list, pre: Prefilled, prompts: list, rows: dict, cfg: StepConfig, caps: TargetCaps) -> list:
    """Rows for the prompts ``indices`` from their prefill: the first response token (a_0 = prompt length).

    Each new ``_Row`` goes into ``rows`` under its prompt index. Returns the rows' generators (None at T=0),
    in ``indices`` order. Raises ValueError when a target that states features returned no feature rows.
    """
    if caps.features and pre.rows is None:
        raise ValueError(f"{caps.name}: the prefill returned no feature rows")
    new = [_Row(prompts[i][0], list(prompts[i][1]), len(prompts[i][1]),
                row_generator(cfg.seed, prompts[i][0]) if cfg.temperature > 0 else None) for i in indices]
    first = _target_tokens(pre.logits, pre.tokens, [r.gen for r in new], cfg)[:, 0]
    for b, (i, r) in enumerate(zip(indices, new)):
        if pre.rows is not None:
            r.features.append(pre.rows[b])
        _append(r, [int(first[b])], cfg)
        rows[i] = r
    return [r.gen for r in new]


async def _turn_over(target: Target, slots: list, gens: list, queue: list, rows: dict, prompts: list,
                     cfg: StepConfig, stats: dict, finish: Callable[[int], None]) -> tuple:
    """Rows that ended leave the batch (``finish`` with their prompt index); the queue's next prompts take their
    places (``target.admit``), and once the queue is empty the rest are dropped (``target.keep``).

    A refilled row can end on its prefill token, hence the loop. ``slots`` (batch row -> prompt index) and
    ``gens`` (its generator) are updated in place where rows are refilled. Returns the new (slots, gens),
    empty when every row has ended.
    """
    while True:
        ended = [j for j, i in enumerate(slots) if rows[i].done]
        if not ended:
            break
        for j in ended:
            finish(slots[j])
        refill = ended[: len(queue)]
        if refill:
            ta = time.perf_counter()
            idx = [queue.pop() for _ in refill]
            new_gens = _start_rows(idx, await target.admit(refill, [list(prompts[i][1]) for i in idx]), prompts, rows, cfg,
                                   target.caps)
            for j, i, g in zip(refill, idx, new_gens):
                slots[j], gens[j] = i, g
            stats["admissions"] += len(refill)
            stats["t_prefill"] += time.perf_counter() - ta
        drop = set(ended[len(refill):])
        if drop:
            keep = [j for j in range(len(slots)) if j not in drop]
            slots = [slots[j] for j in keep]
            gens = [gens[j] for j in keep]
            if not slots:
                break
            target.keep(keep)
    return slots, gens


async def _draft_and_verify(target: Target, drafter: Drafter, live: list) -> tuple:
    """One block per live row: the drafter proposes d_1..d_{bs-1}, the target verifies ``[slot 0, d_1..d_{bs-1}]``
    at the row's anchor. Returns (``Draft``, ``Verified``, seconds drafting, seconds verifying)."""
    t1 = time.perf_counter()
    req = DraftRequest(
        tokens=[r.tokens for r in live],
        features=[r.features for r in live],
        anchors=torch.tensor([len(r.tokens) - 1 for r in live], dtype=torch.long),
        slot0=torch.tensor([r.tokens[-1] for r in live], dtype=torch.long),
    )
    d = await drafter.propose(req)
    t2 = time.perf_counter()
    block = torch.cat([req.slot0.to(d.tokens.device).unsqueeze(1), d.tokens], dim=1)
    v = await target.verify(req.tokens, block, req.anchors)
    return d, v, t2 - t1, time.perf_counter() - t2


def _accept(live: list, gens: list, d: Draft, v: Verified, cfg: StepConfig, caps: TargetCaps, teach: bool) -> tuple:
    """Accept a verified block per live row: the target's tokens (sampled with each row's generator at T > 0), the
    accepted count r, then the row's anchor, drafts (padding as -1), teacher, draft logits and the features of its
    r+1 accepted positions are recorded and its r accepted tokens plus the bonus appended.

    Returns (accepted counts int64 [B], tokens added). Raises ValueError when a target that states features
    returned too few feature rows.
    """
    post = _target_tokens(v.logits, v.tokens, gens, cfg)
    drafts = d.tokens.to(post.device)
    acc = accepted_counts(drafts, post, d.lengths)
    teacher = teacher_signal(v, drafts, cfg.teacher, cfg.teacher_topk) if teach else {}
    shown = drafts
    if d.lengths is not None:
        # padding is recorded as -1, as the offline prompt-lookup replay does
        pad = torch.arange(cfg.block_size - 1, device=drafts.device).unsqueeze(0) >= d.lengths.to(drafts.device).unsqueeze(1)
        shown = drafts.masked_fill(pad, -1)
    n_new = 0
    for j, r in enumerate(live):
        rj = int(acc[j])
        r.anchors.append(len(r.tokens) - 1)
        r.drafts.append(shown[j])
        r.teacher.append({k: t[j] for k, t in teacher.items()})
        if cfg.record_draft_logits and d.logits is not None:
            r.draft_logits.append(d.logits[j])
        if caps.features:
            if v.rows is None or v.rows[j].shape[0] < rj + 1:
                raise ValueError(
                    f"{r.sample_id}: verify pass at anchor {len(r.tokens) - 1} returned no feature rows for the {rj + 1} accepted positions"
                )
            r.features.append(v.rows[j][: rj + 1])
        new = drafts[j, :rj].tolist() + [int(post[j, rj])]
        n_new += _append(r, new, cfg, block=rj)
    return acc, n_new


async def speculate(
    target: Target,
    drafter: Drafter,
    prompts: list,
    cfg: StepConfig,
    *,
    drafter_step: int = 0,
    stats: Optional[dict] = None,
    progress: Optional[Callable[[int], None]] = None,
    batch_size: Optional[int] = None,
    on_record: Optional[Callable[[int, RolloutRecord], None]] = None,
) -> list:
    """Roll out rows: prefill, then draft -> verify -> accept -> advance until every row ends.

    With ``batch_size`` below the number of prompts the batch is continuous: the first
    ``batch_size`` prompts start together, and whenever rows end the next prompts of the
    queue are prefilled into their places (``target.admit``), so the batch stays full until
    the queue is empty; then finished rows leave it (``target.keep``). A row's tokens do not
    depend on its neighbours: each attends to its own slots with its own positions, and
    samples with its own generator.

    Args:
        target: a ``Target`` (its ``caps`` are checked first); continuous batching needs ``admit``.
        drafter: a ``Drafter`` with ``block_size == cfg.block_size``.
        prompts: [(sample_id, non-empty prompt ids)], one row each, in queue order.
        cfg: the rollout's settings.
        drafter_step: stored in every record (policy lag).
        stats: receives ``verify_steps``, ``batch_steps``, ``admissions``, ``t_prefill``
            (admissions included), ``t_draft``, ``t_verify``, ``t_other`` (added to what it holds).
        progress: called with the number of tokens each step added.
        batch_size: rows decoded at once (None: every prompt at once).
        on_record: ``fn(index, record)`` called as each row ends (index into ``prompts``);
            records handed to it are not kept, and the result is then empty.
    Returns:
        One ``RolloutRecord`` per prompt, in prompt order (empty with ``on_record``);
        ``features`` as the target returned them (float [T-1, D]) or None.
    Raises:
        ValueError: T > 0 on a greedy-only target (names ``rollout.temperature``); a target
            that states features but returned too few rows; continuous batching on a target
            without ``admit``; the drafter's own errors.
    """
    if cfg.temperature > 0 and target.caps.greedy_only:
        raise greedy_only_error(cfg.temperature, target.caps)
    stats = {} if stats is None else stats
    for key in ("verify_steps", "batch_steps", "admissions"):
        stats.setdefault(key, 0)
    for key in ("t_prefill", "t_draft", "t_verify", "t_other"):
        stats.setdefault(key, 0.0)
    caps = target.caps
    teach = cfg.teacher in caps.teacher_forms
    n = len(prompts)
    width = n if not batch_size else min(n, int(batch_size))
    if width < n and not hasattr(target, "admit"):
        raise ValueError(f"{caps.name} cannot refill finished rows (no admit): roll out with batch_size=None")
    records: list = [None] * n
    rows: dict = {}  # prompt index -> _Row while it decodes

    def finish(i: int) -> None:
        rec = _record(rows.pop(i), cfg, caps, drafter_step)
        if on_record is not None:
            on_record(i, rec)
        else:
            records[i] = rec

    t0 = time.perf_counter()
    slots = list(range(width))  # batch row -> prompt index
    gens = _start_rows(slots, await target.prefill([list(prompts[i][1]) for i in slots]), prompts, rows, cfg, caps)
    queue = list(range(width, n))[::-1]  # popped from the end: prompt order
    stats["t_prefill"] += time.perf_counter() - t0

    while True:
        slots, gens = await _turn_over(target, slots, gens, queue, rows, prompts, cfg, stats, finish)
        if not slots:
            break
        live = [rows[i] for i in slots]
        d, v, t_draft, t_verify = await _draft_and_verify(target, drafter, live)
        t3 = time.perf_counter()
        acc, n_new = _accept(live, gens, d, v, cfg, caps, teach)
        if progress is not None:
            progress(n_new)
        stats["verify_steps"] += len(live)
        stats["batch_steps"] += 1
        target.advance(acc)
        t4 = time.perf_counter()
        stats["t_draft"] += t_draft
        stats["t_verify"] += t_verify
        stats["t_other"] += t4 - t3
    return [] if on_record is not None else records


def run_inline(coro):
    """Run a coroutine that never suspends (the in-process target and drafters do no I/O) to its result.

    Unlike ``asyncio.run`` it also works where an event loop is already running (a notebook,
    the stand-in server). Raises RuntimeError if the coroutine does wait on something.
    """
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("an in-process rollout awaited I/O: drive it with asyncio.run instead of run_inline")


# ---------------------------------------------------------------------------
# targets that answer one sequence per request (HTTP, and its in-process stand-in)


@dataclass
class PrefillResult:
    """One prompt's prefill: first_token, the target's greedy token at position P; rows: float32 [P, D] features or None."""

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


class PerSequenceTarget:
    """A ``Target`` built from one request per row: subclasses answer ``prefill_one`` and ``verify_one``.

    Requests carry the whole sequence, so the target keeps no state (``advance`` and
    ``keep`` do nothing); the rows of a batch are asked concurrently. Greedy only:
    the answers are the target's greedy tokens and top-k log-probs, not a
    distribution a temperature-T sample could be drawn from exactly.
    """

    caps: TargetCaps

    async def prefill_one(self, prompt_ids: list) -> PrefillResult:
        raise NotImplementedError

    async def verify_one(self, seq_ids: list, drafts: list) -> VerifyResult:
        raise NotImplementedError

    async def prefill(self, prompts: list) -> Prefilled:
        res = await asyncio.gather(*(self.prefill_one(list(p)) for p in prompts))
        rows = [r.rows for r in res]
        return Prefilled(
            tokens=torch.tensor([[r.first_token] for r in res], dtype=torch.long),
            rows=None if any(x is None for x in rows) else rows,
        )

    async def verify(self, tokens: list, blocks: torch.Tensor, anchors: torch.Tensor) -> Verified:
        drafts = blocks[:, 1:].tolist()
        res = await asyncio.gather(*(self.verify_one(seq, d) for seq, d in zip(tokens, drafts)))
        rows = [r.rows for r in res]
        return Verified(
            tokens=torch.stack([r.predicted for r in res]).long(),
            draft_logprob=torch.stack([r.draft_logprob for r in res]),
            top_ids=torch.stack([r.top_ids for r in res]),
            top_logprobs=torch.stack([r.top_logprobs for r in res]),
            rows=None if any(x is None for x in rows) else rows,
        )

    def advance(self, accepted: torch.Tensor) -> None:
        pass

    def keep(self, rows: list) -> None:
        pass
