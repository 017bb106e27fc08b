"""Target-assisted speculative rollout with anchor recording (paper section 4.2; DESIGN.md sections 2-3).

``SpeculativeEngine`` decodes a batch of prompts with the current DFlash drafter
and the in-process target and records what the OPD trainer needs
(``specforge_opd.rollout.records.RolloutRecord``). The step itself (draft, verify,
accept r_m plus one bonus token, advance a_{m+1} = a_m + r_m + 1, records) is
``speculative.speculate``, shared with SGLang's verify mode; the engine drives
it once per batch with ``speculative.InProcessTarget`` (the target on a
preallocated KV cache, with the per-row valid maps, holes and compaction) and
``speculative.CachedDFlashDrafter`` (the drafter's cache of projected context
features at the same slot layout). The random-anchor ablation re-drafts and
re-verifies the finished records (``_random_anchors``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from specforge_opd.config import RolloutConfig
from specforge_opd.errors import UserError
from specforge_opd.models.adapter import create_dflash_sdpa_mask, extract_context_feature
from specforge_opd.models.drafter import check_compatible
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.decode import TargetRunner
from specforge_opd.rollout.records import RolloutRecord, Teacher
from specforge_opd.rollout.step import (
    COMPACT_BELOW,
    COMPACT_MIN_SLOTS,
    CachedDFlashDrafter,
    Draft,
    DraftRequest,
    Drafter,
    InProcessTarget,
    StepConfig,
    Verified,
    accepted_counts,
    row_generator,
    run_inline,
    sample_tokens,
    speculate,
    teacher_signal,
)

log = logging.getLogger(__name__)


class RolloutError(UserError, ValueError):
    """Bad rollout input (empty prompt, prompt too long, drafter/target mismatch); the message says the fix."""


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of items grouped into batches of similar length (stable sort by length, then chunks).

    Left padding makes every row of a batch pay for its longest prompt, in the
    prefill and in every step's attention; batching similar lengths removes most
    of it. Sampling is seeded per sample id, so a row's tokens do not depend on
    its batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


# ---------------------------------------------------------------------------
# one-forward helpers (random anchors, tests, trainers that recompute)


def queue_order(lengths: Sequence[int], batch_size: Optional[int], window_batches: int = 4) -> list[int]:
    """The order a continuous batch takes prompts in: windows of ``window_batches * batch_size``
    consecutive prompts, each longest first.

    Rows of similar length share the cache with fewer hole slots (attention reads every slot
    of the batch), and longest first means an admitted prompt usually fits the slots already
    there. The window keeps the order close to the prompts' own, which writers that emit in
    prompt order (``shards.InOrderShards``) need to hold few finished rows.
    Returns indices into ``lengths``; None or a batch as large as the list: the given order.
    """
    n = len(lengths)
    if not batch_size or batch_size >= n:
        return list(range(n))
    w = max(1, int(window_batches) * int(batch_size))
    out: list[int] = []
    for s in range(0, n, w):
        out += sorted(range(s, min(n, s + w)), key=lambda i: (-lengths[i], i))
    return out


@torch.no_grad()
def target_forward(target, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache, layer_ids):
    """One target forward returning (final-norm hidden [B, q, H], context features [B, q, n*H]).

    Features are HF ``hidden_states[k + 1]`` for k in ``layer_ids``, concatenated
    in id order (DESIGN.md, target layer ids). ``attention_mask`` is a 4-D bool
    mask (True = attend) that transformers uses as given.
    """
    out = target.model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=cache is not None,
        output_hidden_states=True,
    )
    return out.last_hidden_state, extract_context_feature(out.hidden_states, layer_ids)


@torch.no_grad()
def verify_blocks(target, input_ids: torch.Tensor, anchors: torch.Tensor, block_tokens: torch.Tensor, layer_ids):
    """Verify M blocks of one sequence in one target forward (block attention mask).

    The context is ``input_ids[:T-1]`` (positions 0..T-2, causal); block m holds
    ``block_tokens[m] = [token at a_m, d_1..d_{bs-1}]`` at positions a_m..a_m+bs-1
    and sees the context strictly before a_m plus its own earlier slots, exactly
    what an incremental verify step at anchor a_m sees.

    Args:
        input_ids: int64 [T]; anchors: int64 [M] in 0..T-1; block_tokens: int64 [M, bs].
    Returns:
        (context features [T-1, n*H], block final-norm hidden [M, bs, H]).
    """
    dev = next(target.parameters()).device
    T = int(input_ids.numel())
    M, bs = block_tokens.shape
    S = T - 1
    ids = torch.cat([input_ids[:S], block_tokens.reshape(-1)]).to(dev).unsqueeze(0)
    offs = torch.arange(bs, device=dev)
    pos = torch.cat([torch.arange(S, device=dev), (anchors.to(dev).unsqueeze(1) + offs).reshape(-1)]).unsqueeze(0)
    Q = S + M * bs
    mask = torch.zeros(Q, Q, dtype=torch.bool, device=dev)
    mask[:S, :S] = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    blk = torch.arange(M * bs, device=dev) // bs
    anc = anchors.to(dev)[blk]
    mask[S:, :S] = torch.arange(S, device=dev).unsqueeze(0) < anc.unsqueeze(1)
    same = blk.unsqueeze(1) == blk.unsqueeze(0)
    mask[S:, S:] = same & torch.ones(M * bs, M * bs, dtype=torch.bool, device=dev).tril()
    hidden, feats = target_forward(target, ids, pos, mask.view(1, 1, Q, Q), None, layer_ids)
    return feats[0, :S], hidden[0, S:].view(M, bs, -1)


@torch.no_grad()
def draft_blocks(drafter, target, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The drafter's logits for every block of one sequence in one forward (the trainer's replay layout).

    Context = ``features`` rows (positions 0..T-2); block m's input is
    ``[input_ids[a_m], MASK...]`` at positions a_m..a_m+bs-1 and it sees context
    rows < a_m (SpecForge ``create_dflash_sdpa_mask``). Slot k predicts position a_m + k.

    Args:
        input_ids: int64 [T]; features: [T-1, n*H]; anchors: int64 [M].
    Returns:
        float32 logits [M, bs-1, V] for slots 1..bs-1.
    """
    dev = next(target.parameters()).device
    bs = int(drafter.block_size)
    S = int(features.shape[0])
    M = int(anchors.numel())
    anchors = anchors.to(dev)
    noise_ids = torch.full((M, bs), int(mask_token_id), dtype=torch.long, device=dev)
    noise_ids[:, 0] = input_ids.to(dev)[anchors]
    noise = target.model.embed_tokens(noise_ids.view(1, -1))
    pos = torch.cat([torch.arange(S, device=dev), (anchors.unsqueeze(1) + torch.arange(bs, device=dev)).view(-1)]).unsqueeze(0)
    mask = create_dflash_sdpa_mask(anchors.view(1, M), torch.ones(1, M, dtype=torch.bool, device=dev), S, bs, dev)
    ddtype = next(drafter.parameters()).dtype
    out = drafter(
        position_ids=pos,
        noise_embedding=noise.to(ddtype),
        target_hidden=features.to(dev, ddtype).unsqueeze(0),
        attention_mask=mask,
    )
    out = out.view(M, bs, -1)[:, 1:]
    return target.lm_head(out.to(target.lm_head.weight.dtype)).float()


# ---------------------------------------------------------------------------
# the engine


class SpeculativeEngine:
    """Batched target-assisted speculative decoding that records a ``RolloutRecord`` per prompt.

    Args:
        target_model: HF causal LM (``.model`` with ``embed_tokens``, ``.lm_head``), eval mode.
        drafter: SpecForge ``DFlashDraftModel`` (block_size, target_layer_ids, mask_token_id in its config).
        rcfg: ``RolloutConfig`` (max_new_tokens, temperature, top_p, top_k, teacher, teacher_topk,
            anchors, store_features, seed).
        stop_token_ids: a sequence ends right after producing one of these.
        mask_token_id: the id the run expects the drafter to use (checked against its config).
        max_context: prompt + max_new_tokens limit in tokens (``target.max_context``); None = the
            target's ``max_position_embeddings``.
        too_long: ``error`` | ``truncate_left`` (keep the prompt's last tokens) | ``skip`` (the
            prompt's id goes to ``self.skipped``; ``generate`` returns records for the rest).
        record_draft_logits: also keep the drafter's logits [M, bs-1, V] in ``record.extra``
            (tests and debugging; not written to shards).
        prefill_chunk: prompts go through the target in chunks of this many tokens
            (``target.prefill_chunk``).

    Raises:
        RolloutError / ``drafter.DrafterError``: drafter and target do not fit (hidden size,
        target layers, vocabulary, mask token), before any decoding.
    """

    def __init__(
        self,
        target_model,
        drafter,
        rcfg: RolloutConfig,
        *,
        stop_token_ids: Sequence[int],
        mask_token_id: int,
        max_context: Optional[int] = None,
        too_long: str = "error",
        record_draft_logits: bool = False,
        prefill_chunk: int = 256,
    ):
        check_compatible(drafter.config, target_model.config, expected_mask_token_id=int(mask_token_id))
        if getattr(drafter, "sliding_window", None) is not None:
            raise RolloutError("drafters with sliding-window layers are not supported by the embedded rollout; use full_attention layers")
        if too_long not in ("error", "truncate_left", "skip"):
            raise RolloutError(f"target.too_long={too_long!r}: use error, truncate_left or skip")
        self.target = target_model.eval()
        self.drafter = drafter.eval()
        self.rcfg = rcfg
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(drafter.block_size)
        self.layer_ids = [int(i) for i in drafter.config.dflash_config["target_layer_ids"]]
        tcfg = getattr(target_model.config, "text_config", target_model.config)
        self.max_context = int(max_context or getattr(tcfg, "max_position_embeddings", 1 << 30))
        self.too_long = too_long
        self.record_draft_logits = record_draft_logits
        self.prefill_chunk = int(prefill_chunk)
        #: The target's forward on a preallocated KV cache (``decode.TargetRunner``), built once here.
        self.runner = TargetRunner.of(target_model)
        self.device = next(target_model.parameters()).device
        self.skipped: list[str] = []
        #: Squeeze cache holes once the cache has ``compact_min_slots`` slots and its longest row
        #: holds fewer than ``compact_below`` of them (holes cost attention time, squeezing a copy).
        self.compact_min_slots = COMPACT_MIN_SLOTS
        self.compact_below = COMPACT_BELOW
        #: Counters of the last ``generate`` call (verify steps, generated tokens, seconds per phase).
        self.stats: dict = {}

    # -- input checks ------------------------------------------------------

    def _prepare_prompts(self, prompts, sample_ids):
        budget = self.max_context - self.rcfg.max_new_tokens
        if budget <= 0:
            raise RolloutError(
                f"rollout.max_new_tokens={self.rcfg.max_new_tokens} leaves no room for a prompt in "
                f"target.max_context={self.max_context}; lower max_new_tokens or raise max_context"
            )
        kept = []
        self.skipped = []
        for i, p in enumerate(prompts):
            sid = str(sample_ids[i]) if sample_ids is not None else str(i)
            p = [int(t) for t in (p.tolist() if torch.is_tensor(p) else p)]
            if not p:
                raise RolloutError(f"prompt {sid!r} is empty: every prompt needs at least one token (check the chat rendering)")
            if len(p) > budget:
                if self.too_long == "error":
                    raise RolloutError(
                        f"prompt {sid!r} has {len(p)} tokens, more than target.max_context - rollout.max_new_tokens = "
                        f"{budget}; set target.too_long=truncate_left or skip, or shorten it"
                    )
                if self.too_long == "skip":
                    self.skipped.append(sid)
                    continue
                p = p[-budget:]
            kept.append((sid, p))
        return kept

    # -- the drafter, and the loop ---------------------------------------------

    def make_drafter(self, target: InProcessTarget) -> Drafter:
        """The drafter ``generate`` drafts with: the DFlash drafter on ``target``'s slot layout.

        Override to plug in another ``speculative.Drafter`` (the tests' oracle drafters wrap this one).
        """
        return CachedDFlashDrafter(self.drafter, target, self.mask_token_id)

    def step_config(self) -> StepConfig:
        """The rollout's settings as the shared step reads them."""
        rc = self.rcfg
        return StepConfig(
            block_size=self.block_size, max_new_tokens=rc.max_new_tokens, stop_token_ids=frozenset(self.stop_token_ids),
            temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k, teacher=rc.teacher, teacher_topk=rc.teacher_topk,
            seed=rc.seed, record_draft_logits=self.record_draft_logits,
        )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sample_ids: Optional[Sequence[str]] = None, drafter_step: int = 0, *,
                 batch_size: Optional[int] = None, on_record: Optional[Callable[[RolloutRecord], None]] = None) -> list[RolloutRecord]:
        """Roll out every prompt; returns one ``RolloutRecord`` per kept prompt, in input order.

        Args:
            prompts: token id lists (no padding), one per prompt.
            sample_ids: ids stored in the records (default "0", "1", ...); they also seed
                each row's sampler, so a row's sample does not depend on its batch.
            drafter_step: stored in every record (policy lag bookkeeping).
            batch_size: rows decoded at once, continuously refilled as rows end
                (``step.speculate``), the prompts taken in ``queue_order``; None: all
                prompts in one batch.
            on_record: called with each record as its row ends (finish order); the records
                are then not kept and the result is empty (the streaming writers use it).
        Returns:
            Records with ``features`` [T-1, n*H] in the target's dtype (None when
            ``rollout.store_features`` is off) and the ``rollout.teacher`` form's tensors.
            ``self.stats`` then holds ``verify_steps``, ``batch_steps``, ``admissions``,
            ``completion_tokens``, ``t_prefill``, ``t_draft``, ``t_verify``, ``t_other``,
            ``seconds`` and ``compactions`` (cache squeezes).
        Raises:
            RolloutError: an empty prompt, or a prompt over the context limit with ``too_long=error``.
        """
        import time

        kept = self._prepare_prompts(prompts, sample_ids)
        self.stats = {"verify_steps": 0, "completion_tokens": 0, "t_prefill": 0.0, "t_draft": 0.0, "t_verify": 0.0, "t_other": 0.0}
        if not kept:
            return []
        rc = self.rcfg
        B = len(kept)
        t0 = time.perf_counter()
        # room for the prompt, every token and a block of drafts; the holes that verify steps leave
        # grow it (doubling, rare) until compaction squeezes them
        target = InProcessTarget(
            self.target, self.layer_ids, slack=rc.max_new_tokens + 2 * self.block_size, prefill_chunk=self.prefill_chunk,
            compact_min_slots=self.compact_min_slots, compact_below=self.compact_below,
        )
        drafter = self.make_drafter(target)
        # an inner bar: hidden in a log, where the caller's bar over sequences reports
        progress = progress_bar(B * rc.max_new_tokens, "rollout tokens", "tok", disable=B * rc.max_new_tokens < 512,
                                log=False, leave=False)
        out: list = [None] * B

        def emit(i: int, rec: RolloutRecord) -> None:
            if rc.anchors == "random":
                rec = self._random_anchors(rec)
            if not rc.store_features:
                rec.features = None
            self.stats["completion_tokens"] += rec.completion_tokens
            if on_record is not None:
                on_record(rec)
            else:
                out[i] = rec

        order = queue_order([len(p) for _, p in kept], batch_size)
        try:
            run_inline(speculate(target, drafter, [kept[i] for i in order], self.step_config(), drafter_step=drafter_step,
                                 stats=self.stats, progress=progress.update, batch_size=batch_size,
                                 on_record=lambda j, rec: emit(order[j], rec)))
        finally:
            progress.close()
        self.stats["compactions"] = target.compactions
        self.stats["seconds"] = time.perf_counter() - t0
        return [] if on_record is not None else out

    @torch.no_grad()
    def _random_anchors(self, rec: RolloutRecord) -> RolloutRecord:
        """The random-anchor ablation: redraft and reverify M blocks at uniform positions of the response.

        Anchors are drawn without replacement from [prompt_len, T-1] (seeded by
        rollout.seed and the sample id); drafts come from the drafter's one-forward
        replay layout, acceptance and teacher from one target forward over all
        blocks (``verify_blocks``); the acceptance rule is the rollout's (argmax at T=0,
        the target's seeded sample at T>0). ``extra['anchors'] = 'random'``.
        """
        M = rec.num_blocks
        T = int(rec.input_ids.numel())
        if M == 0:
            return rec
        g = row_generator(self.rcfg.seed + 1, rec.sample_id)
        cand = torch.arange(rec.prompt_len, T)
        anchors = cand[torch.randperm(cand.numel(), generator=g)[:M]].sort().values
        dlogits = draft_blocks(self.drafter, self.target, rec.input_ids, rec.features, anchors, self.mask_token_id)
        drafts = dlogits.argmax(-1).cpu()
        block = torch.cat([rec.input_ids[anchors].unsqueeze(1), drafts], dim=1)
        _, hidden = verify_blocks(self.target, rec.input_ids, anchors, block, self.layer_ids)
        logits = self.target.lm_head(hidden).float()
        post = sample_tokens(logits, [row_generator(self.rcfg.seed + 2, rec.sample_id)] * M, self.rcfg.temperature, self.rcfg.top_p, self.rcfg.top_k).cpu()
        acc = accepted_counts(drafts, post)
        teacher = teacher_signal(Verified(logits=logits, hidden=hidden), drafts.to(logits.device), self.rcfg.teacher, self.rcfg.teacher_topk)
        rec.anchors, rec.drafts, rec.accepted = anchors, drafts, acc
        rec.teacher = Teacher.of(**{k: v.cpu() for k, v in teacher.items()})
        rec.extra["anchors"] = "random"
        if self.record_draft_logits:
            rec.extra["draft_logits"] = dlogits.cpu()
        rec.validate()
        return rec


# ---------------------------------------------------------------------------
# plain decoding (the lossless reference and the speedup baseline)


class _NoDrafter:
    """Proposes nothing: each block is slot 0 alone, so the verify step is a decode step (plain decoding)."""

    block_size = 1

    async def propose(self, req: DraftRequest) -> Draft:
        return Draft(tokens=torch.zeros(len(req.tokens), 0, dtype=torch.long))


@torch.no_grad()
def autoregressive_generate(
    target_model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    sample_ids: Optional[Sequence[str]] = None,
    stats: Optional[dict] = None,
    prefill_chunk: int = 256,
    batch_size: Optional[int] = None,
    compact_below: float = COMPACT_BELOW,
) -> list[list[int]]:
    """Token-by-token decoding: the speculative step with a block of one slot and nothing drafted.

    Runs ``step.speculate`` on the in-process target (preallocated KV cache, left-padded
    prompts, explicit positions) with a drafter that proposes nothing, so plain and
    speculative decoding share one loop, one cache layout and continuous batching: with
    ``batch_size`` below the number of prompts, rows that end are refilled with the next
    prompts (``queue_order``); once the queue is empty they leave the batch. Sampling uses the same
    per-row generators as ``SpeculativeEngine`` (seeded by ``seed`` and the sample id,
    default "0", "1", ...). Prompts are prefilled in chunks of ``prefill_chunk`` tokens.

    Returns:
        per prompt, the generated tokens only (at most ``max_new_tokens``, ending
        at the first stop token), in input order.
    ``stats``, when given, receives ``t_prefill`` (admissions included), ``t_decode`` (seconds),
    ``decode_steps`` (batch forwards after the prefill), ``decode_tokens`` (tokens those
    forwards produced, rows summed), ``admissions`` (rows refilled) and ``compactions``.
    ``compact_below``: ``InProcessTarget``'s compaction threshold (holes cost attention,
    squeezing them a copy of the cache; the tokens do not depend on it).

    Raises:
        RolloutError: an empty prompt.
    """
    B = len(prompts)
    if B == 0:
        return []
    sids = [str(s) for s in sample_ids] if sample_ids is not None else [str(i) for i in range(B)]
    for sid, p in zip(sids, prompts):
        if len(p) == 0:
            raise RolloutError(f"prompt {sid!r} is empty: every prompt needs at least one token")
    if max_new_tokens <= 0:
        if stats is not None:
            stats.update(t_prefill=0.0, t_decode=0.0, decode_steps=0, decode_tokens=0, admissions=0, compactions=0)
        return [[] for _ in range(B)]
    cfg = StepConfig(block_size=1, max_new_tokens=int(max_new_tokens), stop_token_ids=frozenset(int(t) for t in stop_token_ids),
                     temperature=temperature, top_p=top_p, top_k=top_k, teacher="none", seed=seed)
    target = InProcessTarget(target_model, (), slack=max_new_tokens + 2, prefill_chunk=prefill_chunk,
                             compact_below=compact_below)
    st: dict = {}
    order = queue_order([len(p) for p in prompts], batch_size)
    outs: list = [None] * B

    def emit(j: int, rec) -> None:
        outs[order[j]] = rec.input_ids[rec.prompt_len:].tolist()

    run_inline(speculate(target, _NoDrafter(), [(sids[i], [int(t) for t in prompts[i]]) for i in order], cfg,
                         stats=st, batch_size=batch_size, on_record=emit))
    if stats is not None:
        stats.update(t_prefill=st["t_prefill"], t_decode=st["t_draft"] + st["t_verify"] + st["t_other"],
                     decode_steps=st["batch_steps"], decode_tokens=st["verify_steps"], admissions=st["admissions"],
                     compactions=target.compactions)
    return outs

