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

Targets (``Target``): ``InProcessTarget`` here (an HF model on a preallocated
KV cache: the slot layout, valid maps with holes and compaction live in it),
``sglang.verify_client.HTTPTarget`` (SGLang's ``/generate``) and
``sglang.speculate.LocalTarget`` (the same answers in-process, for the
stand-in server and tests). Drafters (``Drafter``): ``CachedDFlashDrafter``
(the DFlash drafter on the in-process target's slot layout, with its own cache
of projected context features), ``DFlashDrafter`` (no cache: one forward over
the whole context, what the HTTP path runs) and ``ngram.NgramDrafter``
(prompt lookup).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from specforge_opd.models.grouped_attention import grouped_attention
from specforge_opd.rollout.decode import HFCache, TargetRunner, left_pad, prefill, step_mask
from specforge_opd.rollout.records import TEACHER_TENSORS, RolloutRecord, Teacher
from specforge_opd.teacher_form import TEACHER_FORMS


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
# the interfaces


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
    bs = cfg.block_size
    teach = cfg.teacher in caps.teacher_forms
    n = len(prompts)
    width = n if not batch_size else min(n, int(batch_size))
    if width < n and not hasattr(target, "admit"):
        raise ValueError(f"{caps.name} cannot refill finished rows (no admit): roll out with batch_size=None")
    records: list = [None] * n
    rows: dict = {}  # prompt index -> _Row while it decodes

    def start(indices: list, pre: Prefilled) -> list:
        """Rows for the prompts ``indices`` from their prefill: the first response token (a_0 = prompt length)."""
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

    def finish(i: int) -> None:
        rec = _record(rows.pop(i), cfg, caps, drafter_step)
        if on_record is not None:
            on_record(i, rec)
        else:
            records[i] = rec

    t0 = time.perf_counter()
    slots = list(range(width))  # batch row -> prompt index
    gens = start(slots, await target.prefill([list(prompts[i][1]) for i in slots]))
    queue = list(range(width, n))[::-1]  # popped from the end: prompt order
    stats["t_prefill"] += time.perf_counter() - t0

    while True:
        # rows that ended leave; the queue's next prompts take their places (a refilled row can end
        # on its prefill token, hence the loop)
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
                new_gens = start(idx, await target.admit(refill, [list(prompts[i][1]) for i in idx]))
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
        if not slots:
            break
        live = [rows[i] for i in slots]
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
        t3 = time.perf_counter()
        post = _target_tokens(v.logits, v.tokens, gens, cfg)
        drafts = d.tokens.to(post.device)
        acc = accepted_counts(drafts, post, d.lengths)
        teacher = teacher_signal(v, drafts, cfg.teacher, cfg.teacher_topk) if teach else {}
        shown = drafts
        if d.lengths is not None:
            # padding is recorded as -1, as the offline prompt-lookup replay does
            pad = torch.arange(bs - 1, device=drafts.device).unsqueeze(0) >= d.lengths.to(drafts.device).unsqueeze(1)
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
        if progress is not None:
            progress(n_new)
        stats["verify_steps"] += len(live)
        stats["batch_steps"] += 1
        target.advance(acc)
        t4 = time.perf_counter()
        stats["t_draft"] += t2 - t1
        stats["t_verify"] += t3 - t2
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
# the in-process target


#: Default compaction thresholds of ``InProcessTarget``: squeeze once the cache holds at least
#: ``COMPACT_MIN_SLOTS`` slots and its longest row's valid slots are below ``COMPACT_BELOW`` of
#: them. A squeeze costs one copy of the cache; holes cost attention on every step. Measured
#: (``benchmarks/bench_compaction.py``, 2-core AMD EPYC, fp32, thresholds interleaved because the
#: machine's speed drifts within a run): against 0.5, 0.95 runs plain generation with
#: continuous batching 1.12-1.14x faster and speculative rollouts at block 8 1.09-1.10x.
COMPACT_MIN_SLOTS = 64
COMPACT_BELOW = 0.95


class InProcessTarget:
    """An HF target in this process on ``decode.TargetRunner``'s preallocated KV cache, for B rows at once.

    Slot layout: the cache is shared by the batch and each row owns a boolean
    ``valid`` map over cache *slots*; every token carries its own position id.
    Prompts are left-padded (pad slots are holes). A verify step appends bs slots
    per row; ``advance`` crops the cache to the batch's longest accepted prefix
    and the slots a row rejected stay as masked holes. Holes are squeezed out
    (``_compact``) once the cache has ``compact_min_slots`` slots and its longest
    row holds fewer than ``compact_below`` of them: holes cost attention time,
    squeezing costs a copy, and it cannot go below the longest row. Every forward gets a 4-D boolean mask from that map, so each
    row sees exactly its own verified prefix: T=0 equals the target's greedy
    decoding up to numerical ties (DESIGN.md, numerical ties).

    Caches in ``slot_caches`` (the ``CachedDFlashDrafter``'s) share the slot
    layout: they are compacted and row-selected with the target's.

    Args:
        model: HF causal LM in eval mode (``.model.embed_tokens``, ``.lm_head``).
        layer_ids: decoder layers whose outputs are the context features (DESIGN.md,
            target layer ids); empty: no features.
        slack: cache slots to preallocate past the longest prompt (max_new_tokens + 2 blocks;
            holes grow it, doubling, until compaction).
        prefill_chunk: prompts go through the target in chunks of this many tokens.
    """

    def __init__(self, model, layer_ids: Sequence[int] = (), *, slack: int = 0, prefill_chunk: int = 256,
                 compact_min_slots: int = COMPACT_MIN_SLOTS, compact_below: float = COMPACT_BELOW):
        self.model = model
        self.runner = TargetRunner.of(model)
        self.device = next(model.parameters()).device
        self.layer_ids = [int(i) for i in layer_ids] or None
        self.slack = int(slack)
        self.prefill_chunk = int(prefill_chunk)
        self.compact_min_slots = compact_min_slots
        self.compact_below = compact_below
        w = model.lm_head.weight
        self.caps = TargetCaps(
            name="the in-process target", greedy_only=False, teacher_forms=TEACHER_FORMS, features=self.layer_ids is not None,
            vocab_size=int(w.shape[0]), hidden_size=int(w.shape[1]), hidden_dtype=w.dtype,
        )
        self.slot_caches: list = []
        #: ``fn(rows, feats [k, P, D], pos [k, P], valid [k, P])``: fill the context of admitted rows
        #: at slots 0..P-1 of each slot cache (``admit``); the ``CachedDFlashDrafter`` registers one.
        self.context_writers: list = []
        #: Compactions so far.
        self.compactions = 0
        self.cache = self.valid = self.pending = self._last = None

    async def prefill(self, prompts: list) -> Prefilled:
        ids, valid, pos = left_pad(prompts, self.device)
        self.cache = self.runner.new_cache(len(prompts), ids.shape[1] + self.slack)
        hidden, feats = prefill(self.runner, self.cache, ids, valid, pos, self.layer_ids, self.prefill_chunk)
        self.valid = valid
        #: Context slots the drafter's cache lacks: (features [B, c, D] or None, positions [B, c]).
        self.pending = (feats, pos)
        rows = None if feats is None else [feats[b, valid[b]] for b in range(len(prompts))]
        return Prefilled(logits=self.runner.logits(hidden).float(), rows=rows)

    async def verify(self, tokens: list, blocks: torch.Tensor, anchors: torch.Tensor) -> Verified:
        S0 = self.valid.shape[1]
        # squeezing shortens the cache to its longest row's valid slots, never below: so the test is on
        # that row, not on the valid fraction (rows of mixed lengths keep a low fraction for good), and
        # a squeeze leaves nothing to squeeze until holes build up in the longest row again
        if S0 >= self.compact_min_slots:
            width = int(self.valid.sum(1).max())
            if width < self.compact_below * S0:
                self.compactions += 1
                self._compact(width)
        blocks = blocks.to(self.device)
        block_pos = anchors.to(self.device).unsqueeze(1) + torch.arange(blocks.shape[1], device=self.device)
        S = self.valid.shape[1]
        mask = step_mask(self.valid, torch.ones_like(blocks, dtype=torch.bool))
        hidden, feats = self.runner.forward(blocks, block_pos, mask, self.cache, self.layer_ids)
        self._last = (S, feats, block_pos)
        return Verified(logits=self.runner.logits(hidden).float(), hidden=hidden, rows=feats)

    def advance(self, accepted: torch.Tensor) -> None:
        # keep the batch's longest accepted prefix; shorter rows get holes
        S, feats, block_pos = self._last
        acc = accepted.to(self.device)
        c = int(acc.max()) + 1
        self.cache.crop(S + c)
        self.valid = torch.cat([self.valid, torch.arange(c, device=self.device).unsqueeze(0) <= acc.unsqueeze(1)], dim=1)
        self.pending = (None if feats is None else feats[:, :c], block_pos[:, :c])

    def keep(self, rows: list) -> None:
        sel = torch.tensor(rows, device=self.device)
        self.cache.select_rows(sel)
        for c in self.slot_caches:
            c.select_rows(sel)
        self.valid = self.valid[sel]
        feats, pos = self.pending
        self.pending = (None if feats is None else feats[sel], pos[sel])

    async def admit(self, rows: list, prompts: list) -> Prefilled:
        """Continuous batching: prefill ``prompts`` into batch rows ``rows`` (rows whose sequences ended).

        The prompts are prefilled on their own (left-padded among themselves, no attention
        to the batch), then their keys/values are copied into slots 0..P-1 of their rows of
        the shared cache; the rest of those rows are holes. The drafter's context cache gets
        the same slots (``context_writers``), or, before its first draft, the pending context
        does. Where the cache is shorter than the prompts, hole slots are added in front of
        every row first. Each row attends to its own valid slots with its own positions, so
        a row's result does not depend on its neighbours (up to fp rounding).

        Args:
            rows: batch positions (ints) to refill, as many as ``prompts``.
            prompts: per row the prompt's token ids (non-empty lists).
        Returns:
            ``Prefilled`` for those rows, in ``rows`` order.
        """
        ids, valid, pos = left_pad(prompts, self.device)
        k, P = ids.shape
        tmp = self.runner.new_cache(k, P)
        hidden, feats = prefill(self.runner, tmp, ids, valid, pos, self.layer_ids, self.prefill_chunk)
        S = self.valid.shape[1]
        p_feats, p_pos = self.pending
        c = p_pos.shape[1]
        consumed = S - c  # slots the drafter's context cache already holds
        before_first_draft = consumed == 0 and bool(self.slot_caches)
        room = S if (before_first_draft or not self.slot_caches) else consumed
        if P > room:
            grow = P - room
            self.cache.pad_front(grow)
            for sc in self.slot_caches:
                sc.pad_front(grow)
            self.valid = torch.cat([self.valid.new_zeros(self.valid.shape[0], grow), self.valid], dim=1)
            if before_first_draft:  # the pending context is every slot: it grows with them
                p_pos = torch.cat([p_pos.new_zeros(p_pos.shape[0], grow), p_pos], dim=1)
                if p_feats is not None:
                    p_feats = torch.cat([p_feats.new_zeros(p_feats.shape[0], grow, p_feats.shape[2]), p_feats], dim=1)
            S += grow
        sel = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.write_rows(sel, tmp, P)
        new_valid = self.valid.new_zeros(k, S)
        new_valid[:, :P] = valid
        self.valid[sel] = new_valid
        if before_first_draft:
            p_pos = p_pos.clone()
            p_pos[sel, :P] = pos
            if p_feats is not None:
                p_feats = p_feats.clone()
                p_feats[sel, :P] = feats.to(p_feats.dtype)
        else:
            for write in self.context_writers:
                write(sel, feats, pos, valid)
        self.pending = (p_feats, p_pos)
        rows_out = None if feats is None else [feats[b, valid[b]] for b in range(k)]
        return Prefilled(logits=self.runner.logits(hidden).float(), rows=rows_out)

    def _compact(self, width: int) -> None:
        """Squeeze the holes out of every slot-layout cache, keeping each row's slot order; ``width``
        = the longest row's valid slots, the squeezed cache's length."""
        B, S = self.valid.shape
        # sort holes first, valid slots last, stable so the valid slots keep their order (left padding)
        key = self.valid.long() * (S + 1) + torch.arange(S, device=self.valid.device)
        order = key.argsort(dim=1)[:, S - width:]
        self.cache.gather_slots(order)
        for c in self.slot_caches:
            c.gather_slots(order)
        self.valid = torch.gather(self.valid, 1, order)


# ---------------------------------------------------------------------------
# the DFlash drafters


class CachedDFlashDrafter:
    """The DFlash drafter on an ``InProcessTarget``'s slot layout, batched, with a cache of its context.

    Its cache holds the projected context features (DFlash attention keys/values of
    the target features) at the target's slot layout; the features of each target
    forward are fed to it at the next draft, as SpecForge's ``spec_generate`` does
    for one sequence. Each draft is one forward over the pending context slots and
    the block ``[slot 0, MASK...]`` (DESIGN.md, block layout); the cache keeps the
    context part only.

    Args:
        model: SpecForge ``DFlashDraftModel`` (``block_size``), eval mode.
        target: the ``InProcessTarget`` it drafts for (embedding and lm_head are the target's).
        mask_token_id: the MASK id of slots 1..bs-1.
    """

    def __init__(self, model, target: InProcessTarget, mask_token_id: int):
        self.model = model
        self.target = target
        self.block_size = int(model.block_size)
        self.mask_token_id = int(mask_token_id)
        self.dtype = next(model.parameters()).dtype
        self.cache = HFCache()
        target.slot_caches.append(self.cache)
        target.context_writers.append(self._write_context)

    @torch.no_grad()
    def _write_context(self, rows: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> None:
        """The projected context of admitted rows (features ``feats`` [k, P, D] at positions ``pos`` [k, P])
        into slots 0..P-1 of rows ``rows`` of this drafter's cache.

        A DFlash layer's context keys/values are its k/v projections of the projected target
        features alone (RoPE at their positions): neither the block nor the mask enters them.
        So one forward of the admitted rows with a MASK block computes exactly what the batch's
        own draft would have cached; the block's part is cropped.
        """
        t = self.target
        k, P = pos.shape
        bs = self.block_size
        noise_ids = torch.full((k, bs), self.mask_token_id, dtype=torch.long, device=t.device)
        blk_pos = pos[:, -1:] + 1 + torch.arange(bs, device=t.device)
        mask = valid.unsqueeze(1).unsqueeze(1).expand(k, 1, bs, P)
        mask = torch.cat([mask, torch.ones(k, 1, bs, bs, dtype=torch.bool, device=t.device)], dim=3)
        tmp = HFCache()
        with grouped_attention(self.model):
            self.model(
                position_ids=torch.cat([pos, blk_pos], dim=1),
                noise_embedding=t.model.model.embed_tokens(noise_ids).to(self.dtype),
                target_hidden=feats.to(self.dtype),
                attention_mask=mask,
                past_key_values=tmp.cache,
                use_cache=True,
            )
        tmp.crop(P)
        self.cache.write_rows(rows, tmp, P)

    async def propose(self, req: DraftRequest) -> Draft:
        """Returns the argmax of slots 1..bs-1 (int64 [B, bs-1]) and their logits (float32 [B, bs-1, V])."""
        t = self.target
        dev = t.device
        bs = self.block_size
        ctx_feats, ctx_pos = t.pending
        B = ctx_pos.shape[0]
        noise_ids = torch.full((B, bs), self.mask_token_id, dtype=torch.long, device=dev)
        noise_ids[:, 0] = req.slot0.to(dev)
        noise = t.model.model.embed_tokens(noise_ids)
        blk_pos = req.anchors.to(dev).unsqueeze(1) + torch.arange(bs, device=dev)
        S_d = self.cache.get_seq_length()
        # the drafter's cache lags the target's by the pending slots: it sees the target's whole valid map
        kv_valid = t.valid
        assert kv_valid.shape[1] == S_d + ctx_pos.shape[1], "drafter cache out of step with the target's slots"
        mask = kv_valid.unsqueeze(1).unsqueeze(1).expand(B, 1, bs, kv_valid.shape[1])
        mask = torch.cat([mask, torch.ones(B, 1, bs, bs, dtype=torch.bool, device=dev)], dim=3)
        with grouped_attention(self.model):  # the cache's keys read once per key/value head, not once per query head
            out = self.model(
                position_ids=torch.cat([ctx_pos, blk_pos], dim=1),
                noise_embedding=noise.to(self.dtype),
                target_hidden=ctx_feats.to(self.dtype),
                attention_mask=mask,
                past_key_values=self.cache.cache,
                use_cache=True,
            )
        self.cache.crop(S_d + ctx_feats.shape[1])
        logits = t.runner.logits(out[:, 1:]).float()
        return Draft(tokens=logits.argmax(-1), logits=logits)


class DFlashDrafter:
    """The DFlash drafter with the target's frozen embedding and lm_head (the drafter has neither), no cache.

    ``draft(context, slot0, anchor, prefix)``: one sequence; context float [a, n*H]
    (features of positions 0..a-1; ``prefix``, the tokens 0..a, is unused by DFlash);
    returns the bs-1 argmax tokens for slots 1..bs-1. One forward over context +
    block: the same function ``spec_generate`` computes with its cache. ``propose``
    drafts each row of a batch that way (the HTTP path: the target is remote and
    the features arrive as rows).

    Raises:
        ValueError: the context does not cover positions 0..a-1, or there is none (a target
            that returns no features).
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
    def draft(self, context: torch.Tensor, slot0: int, anchor: int, prefix: Optional[list] = None) -> list:
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

    async def propose(self, req: DraftRequest) -> Draft:
        out = []
        for j, toks in enumerate(req.tokens):
            if not req.features[j]:
                raise ValueError("the drafter needs context features: speculative rollout requires rollout.store_features or a feature-returning target")
            context = torch.cat(req.features[j], 0)
            out.append(self.draft(context, toks[-1], len(toks) - 1, prefix=list(toks)))
        return Draft(tokens=torch.tensor(out, dtype=torch.long).reshape(len(out), self.block_size - 1))


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
