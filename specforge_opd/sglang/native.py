"""Native mode: SGLang runs DFLASH speculative decoding itself; a plugin reports every verify step.

Three parts (DESIGN.md section 5; the paper's authors recorded the same per-step
facts in their SGLang fork, bingyang-lei/Draft-OPD):

1. ``step_payloads``: a pure function from the tensors SGLang 0.5.23's
   ``DFlashWorkerV2.forward_batch_generation`` holds after a verify step (the
   drafted block ``_draft_block_tokens_buf[:bs]`` [B, bs] with slot 0 = the
   previous bonus token, ``result.accept_lens`` [B] = accepted + 1,
   ``batch.seq_lens`` [B] before the call = each request's committed length = the
   anchor, ``result.logits_output.next_token_logits`` [B*bs, V]) to one record per
   request: anchor, drafted block, accepted count, teacher log-probs of the drafted
   tokens.
2. ``register``: the plugin, loaded by SGLang through its ``sglang.srt.plugins``
   entry point (``specforge_opd_native = specforge_opd.sglang.native:register``).
   It wraps ``DFlashWorkerV2.forward_batch_generation`` (``HOOK_TARGETS``) and puts
   the payloads into ``logits_output.customized_info``; the scheduler appends one
   value per step to each request and the tokenizer manager returns them at the
   top level of ``meta_info``. A second hook marks our keys request-level in
   ``SchedulerOutputStreamer``, so a non-streaming response gets the whole list at
   its finish instead of slices cut by output-token offset at every early flush.
   Not run here (no SGLang on a CPU): ``tests/test_sglang_contract.py`` checks the
   targets against the released wheel's source, ``scripts/gpu_check_sglang_native.sh``
   runs them.
3. ``record_from_native`` and ``native_rollout_async``: the client that turns a
   response into a ``RolloutRecord`` without features (the trainer recomputes them,
   ``training.feature_source: target``).

Teacher hazards, and what is done about each:

* SGLang edits the verify logits in place before acceptance when a request in the
  batch sets penalties, ``logit_bias``, a grammar or a custom logit processor. Our
  requests set none (``contract.native_request`` refuses them); when another
  client's request brings them into a batch, the step's ``opd_draft_logprob`` is
  null and the client refuses the record for a log-prob teacher.
* With greedy batches and no ``return_logprob``, DFLASH may drop the verify logits
  (``_can_skip_verify_logits``) or keep only each rank's vocabulary shard at TP > 1.
  Native requests set ``return_logprob``, which keeps them, gathered over the
  whole vocabulary; a step that still lacks full-width logits reports null.
* Overlap scheduling: the CPU copy ``batch.seq_lens_cpu`` lags one step behind,
  so the anchor is read from the device tensor ``batch.seq_lens``; reading the
  values costs one device synchronisation per step, which is what the launcher's
  ``--disable-overlap-schedule`` makes explicit (overlap would gain nothing).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from specforge_opd.config import SGLangConfig
from specforge_opd.rollout.records import RolloutRecord, Teacher
from specforge_opd.sglang.contract import (
    NATIVE_STEP_FIELDS,
    ContractError,
    NativeStep,
    native_request,
    parse_native_response,
    request_timeout_s,
)
from specforge_opd.sglang.sizing import request_tokens

log = logging.getLogger(__name__)

#: What the plugin patches in SGLang 0.5.23 (checked against the wheel by tests/test_sglang_contract.py).
HOOK_TARGETS = {
    "verify_step": "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
    "request_level": (
        "sglang.srt.managers.scheduler_components.output_streamer."
        "SchedulerOutputStreamer.is_request_level_customized_info_key"
    ),
}

#: Rows of verify logits converted to float32 at once (a [64*16, 151936] block is 620 MB in float32).
LOGPROB_CHUNK_ROWS = 256


# ---------------------------------------------------------------------------
# 1. the pure conversion (runs inside SGLang's worker, and in the stand-in)


def draft_logprobs(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    *,
    block_size: int,
    vocab_size: Optional[int] = None,
    chunk_rows: int = LOGPROB_CHUNK_ROWS,
) -> torch.Tensor:
    """Teacher log-probs of the drafted tokens at temperature 1, unfiltered.

    Args:
        logits: float [B*bs, V'] or [B, bs, V']: the verify pass's logits; row k of a
            request predicts the token after slot k. V' may exceed ``vocab_size``
            (padded lm_head); the padding columns are ignored.
        drafts: int [B, bs-1]: the drafted tokens d_1..d_{bs-1}.

    Returns:
        float32 [B, bs-1]: log p(d_k | slot 0, d_<k), computed ``chunk_rows`` rows at a time.

    Raises:
        ValueError: shapes that do not fit ``block_size``, or logits narrower than the vocabulary.
    """
    B = drafts.shape[0]
    if logits.numel() == 0 or logits.reshape(-1, logits.shape[-1]).shape[0] != B * block_size:
        raise ValueError(f"verify logits of shape {tuple(logits.shape)} do not hold {B} requests x block {block_size} rows")
    width = logits.shape[-1]
    V = width if vocab_size is None else int(vocab_size)
    if width < V:
        raise ValueError(f"verify logits have {width} columns < vocabulary {V}: a tensor-parallel shard, not the full rows")
    rows = logits.reshape(B, block_size, width)[:, :-1, :V].reshape(-1, V)
    tok = drafts.reshape(-1).to(device=rows.device, dtype=torch.long)
    out = torch.empty(tok.shape[0], dtype=torch.float32, device=rows.device)
    for i in range(0, tok.shape[0], chunk_rows):
        x = rows[i : i + chunk_rows].float()
        out[i : i + chunk_rows] = x.gather(1, tok[i : i + chunk_rows, None])[:, 0] - torch.logsumexp(x, dim=-1)
    return out.reshape(B, block_size - 1)


def step_payloads(
    draft_block: torch.Tensor,
    commit_lens: torch.Tensor,
    anchors: torch.Tensor,
    logits: Optional[torch.Tensor],
    *,
    block_size: int,
    vocab_size: Optional[int] = None,
) -> list[dict]:
    """Per request, what one DFLASH verify step did.

    Args:
        draft_block: int [B, bs] or [B*bs]: slot 0 = the verified token at the anchor,
            slots 1..bs-1 = the drafter's tokens (``DFlashWorkerV2._draft_block_tokens_buf``).
        commit_lens: int [B]: tokens the step committed = accepted + 1 (SGLang's
            ``accept_lens``), before any stop-token truncation.
        anchors: int [B]: committed tokens per request before the step = the anchor
            (SGLang keeps the current token uncommitted).
        logits: float [B*bs, V'] or None: the unadjusted verify logits; None when the
            step had none (the log-probs are then reported as None).
        block_size: bs (``--speculative-num-draft-tokens``).

    Returns:
        One dict per request with ``NATIVE_STEP_FIELDS``: ``opd_anchor`` (int),
        ``opd_draft`` (bs-1 ints), ``opd_accepted`` (r in 0..bs-1), ``opd_draft_logprob``
        (bs-1 floats, or None).

    Raises:
        ValueError: shapes that do not fit ``block_size``, commit lengths outside 1..bs.
    """
    block = draft_block.reshape(-1, block_size)
    B = block.shape[0]
    if commit_lens.numel() != B or anchors.numel() != B:
        raise ValueError(f"accept_lens has {commit_lens.numel()} and seq_lens {anchors.numel()} entries, the verify batch has {B} requests")
    drafts = block[:, 1:]
    lp = None
    if logits is not None:
        lp = draft_logprobs(logits, drafts, block_size=block_size, vocab_size=vocab_size).tolist()
    acc = [int(c) - 1 for c in commit_lens.reshape(-1).tolist()]
    if any(not 0 <= a <= block_size - 1 for a in acc):
        raise ValueError(f"accept_lens {[a + 1 for a in acc]} outside 1..{block_size}")
    anchor_list = [int(a) for a in anchors.reshape(-1).tolist()]
    draft_list = drafts.tolist()
    return [
        {
            "opd_anchor": anchor_list[i],
            "opd_draft": [int(t) for t in draft_list[i]],
            "opd_accepted": acc[i],
            "opd_draft_logprob": None if lp is None else [float(x) for x in lp[i]],
        }
        for i in range(B)
    ]


def customized_info_of(payloads: list[dict]) -> dict:
    """``customized_info`` layout: key -> a list with one value per request of the batch, in batch order.

    SGLang's scheduler appends ``value[i]`` to request i's ``req.customized_info[key]``
    each step (``_maybe_collect_customized_info``): ``opd_anchor`` int, ``opd_draft``
    bs-1 ints, ``opd_accepted`` int, ``opd_draft_logprob`` bs-1 floats or None.
    """
    return {k: [p[k] for p in payloads] for k in NATIVE_STEP_FIELDS}


def is_request_level_key(key: str) -> bool:
    """Our keys are sent once, whole, when a non-streaming request finishes (never sliced by token offset)."""
    return key in NATIVE_STEP_FIELDS


def logits_adjusted(batch) -> bool:
    """Whether SGLang edits this batch's verify logits in place before acceptance.

    Mirrors the conditions of ``apply_dflash_verify_logits_adjustments`` and the
    grammar mask in 0.5.23: a custom logit processor, linear penalties (frequency,
    presence, repetition, min_new_tokens), ``logit_bias``, a vocabulary mask or a grammar.
    """
    if getattr(batch, "has_grammar", False):
        return True
    si = getattr(batch, "sampling_info", None)
    if si is None:
        return False
    penalizer = getattr(si, "penalizer_orchestrator", None)
    return bool(
        getattr(si, "has_custom_logit_processor", False)
        or getattr(si, "acc_linear_penalties", None) is not None
        or (penalizer is not None and getattr(penalizer, "is_required", False))
        or getattr(si, "logit_bias", None) is not None
        or getattr(si, "grammar_mask", None) is not None
    )


# ---------------------------------------------------------------------------
# 2. the SGLang plugin (imported only inside SGLang's processes)

_hook_failed_once = False


def _is_verify_step(batch) -> bool:
    mode = getattr(batch, "forward_mode", None)
    if batch is None or mode is None:
        return False
    return not (mode.is_extend() or getattr(batch, "is_extend_in_batch", False) or mode.is_idle())


def _vocab_size(worker) -> Optional[int]:
    try:
        return int(worker.model_runner.model_config.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return None


def _around_forward_batch_generation(original, self, *args, **kwargs):
    """AROUND hook of ``DFlashWorkerV2.forward_batch_generation``: report each verify step's records.

    Extend (prefill) and idle batches pass through untouched. The anchor is
    ``batch.seq_lens`` cloned before the call (on the device: under overlap
    scheduling the CPU copy lags a step). A failure here is logged once and the
    step carries no records, which the client reports; it never stops the server.
    """
    global _hook_failed_once
    batch = kwargs["batch"] if "batch" in kwargs else (args[0] if args else None)
    verify = _is_verify_step(batch)
    anchors = batch.seq_lens.detach().clone() if verify else None
    result = original(self, *args, **kwargs)
    if not verify:
        return result
    try:
        lo = getattr(result, "logits_output", None)
        accept_lens = getattr(result, "accept_lens", None)
        B = int(anchors.numel())
        if lo is None or accept_lens is None or B == 0:
            return result
        block_size = int(self.block_size)
        logits = getattr(lo, "next_token_logits", None)
        vocab = _vocab_size(self)
        if logits is not None and (logits_adjusted(batch) or (vocab is not None and logits.shape[-1] < vocab)):
            logits = None
        payloads = step_payloads(
            self._draft_block_tokens_buf[:B], accept_lens[:B], anchors, logits, block_size=block_size, vocab_size=vocab,
        )
        info = dict(getattr(lo, "customized_info", None) or {})
        info.update(customized_info_of(payloads))
        lo.customized_info = info
    except Exception:  # a shared server must keep serving; the client names the missing keys
        if not _hook_failed_once:
            log.exception("specforge_opd native plugin: recording a DFLASH verify step failed")
            _hook_failed_once = True
    return result


def _around_is_request_level(original, self, key):
    return is_request_level_key(key) or original(self, key)


def register() -> None:
    """SGLang general-plugin entry point: hook DFLASH verify steps and mark our keys request-level.

    SGLang only logs a hook it failed to apply ("Failed to apply hooks to ...") and
    serves on; the launcher scans the server log for that line in native mode.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGETS["verify_step"], _around_forward_batch_generation, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS["request_level"], _around_is_request_level, HookType.AROUND)


# ---------------------------------------------------------------------------
# 3. the client


def record_from_native(
    sample_id: str,
    prompt_ids: list[int],
    output_ids: list[int],
    steps: list[NativeStep],
    *,
    block_size: int,
    teacher: str,
    stop_token_ids: list[int],
    drafter_step: int = 0,
    server_version: Optional[str] = None,
    num_retractions: int = 0,
) -> RolloutRecord:
    """Turn one native-mode response into a ``RolloutRecord`` without features.

    Checks the anchor recurrence (a_0 = prompt length, a_{m+1} = a_m + r_m + 1) and
    that every accepted draft is the token the output holds at its position.
    The last block's accepted count is clipped to the tokens the output keeps after
    its anchor (a stop token or max_new_tokens inside the block). A retracted request (``num_retractions`` > 0) was re-prefilled, which emitted a
    token outside any verify step and shifted the next anchor by one: the record
    ends at the last block before that (``finished`` False), which keeps every
    block exact. Teacher: the ``token`` form (the drafted tokens' log-probs) when
    ``teacher`` is ``token`` or ``topk`` (top-k is not reported natively: the record
    carries the token form, the trainer recomputes the rest); ``full`` keeps none
    (the trainer recomputes it).

    Raises:
        ContractError: steps inconsistent with the output, or a step without log-probs
            when the teacher needs them (field named).
    """
    P = len(prompt_ids)
    seq = [int(t) for t in prompt_ids] + [int(t) for t in output_ids]
    kept = list(steps)
    cut = None  # sequence length to keep when a retraction broke the recurrence
    prev = None
    for m, s in enumerate(steps):
        want = P if prev is None else prev.anchor + prev.accepted + 1
        if s.anchor != want:
            if num_retractions > 0 and want < s.anchor <= want + num_retractions:
                kept, cut = list(steps[:m]), want + 1
                break
            raise ContractError(f"meta_info.opd_anchor[{m}]", f"{s.anchor} != expected {want} (a_0 = prompt length, a_m+1 = a_m + r_m + 1)", server_version)
        if s.anchor >= len(seq):
            raise ContractError(f"meta_info.opd_anchor[{m}]", f"{s.anchor} past the sequence end {len(seq) - 1}", server_version)
        for k in range(1, s.accepted + 1):
            if s.anchor + k < len(seq) and seq[s.anchor + k] != s.draft[k - 1]:
                raise ContractError(f"meta_info.opd_draft[{m}]", f"accepted draft {k} = {s.draft[k - 1]} but output holds {seq[s.anchor + k]}", server_version)
        prev = s
    if cut is None:
        end = (prev.anchor + prev.accepted + 1) if prev is not None else P
        if len(seq) - 1 > end:
            if num_retractions == 0:
                raise ContractError("output_ids", f"{len(seq) - 1 - end} tokens past the last verify step's bonus token at position {end}", server_version)
            cut = end + 1
    if cut is not None:
        seq = seq[:cut]
    M = len(kept)
    stops = set(int(t) for t in stop_token_ids)
    rec = RolloutRecord(
        sample_id=sample_id,
        input_ids=torch.tensor(seq, dtype=torch.long),
        prompt_len=P,
        anchors=torch.tensor([s.anchor for s in kept], dtype=torch.long),
        drafts=torch.tensor([s.draft for s in kept], dtype=torch.long).reshape(M, block_size - 1),
        # a block the finish cut short keeps only the tokens kept as accepted (a_M + r_M + 1 <= T), as every
        # other backend's records do (``speculative.speculate``)
        accepted=torch.tensor([min(s.accepted, len(seq) - 1 - s.anchor) for s in kept], dtype=torch.long),
        finished=cut is None and bool(seq[P:]) and seq[-1] in stops,
        drafter_step=drafter_step,
    )
    if teacher in ("token", "topk"):
        missing = [m for m, s in enumerate(kept) if s.draft_logprob is None]
        if missing:
            raise ContractError(
                f"meta_info.opd_draft_logprob[{missing[0]}]",
                f"null at {len(missing)} of {M} steps: the verify logits were adjusted in place (penalties, logit_bias, a "
                "grammar or a custom logit processor of a request batched with ours) or not gathered; roll out on a "
                "server no other client uses, or set rollout.teacher=full with training.feature_source=target",
                server_version,
            )
        logp = torch.tensor([s.draft_logprob for s in kept], dtype=torch.float32).reshape(M, block_size - 1)
        rec.teacher = Teacher("token", draft_logprob=logp)
    rec.validate()
    return rec


#: Said once per native rollout at temperature > 0.
NOT_REPRODUCIBLE = (
    "rollout.temperature=%s through SGLang native mode is not reproducible: DFLASH's sampling verify draws its "
    "acceptance coins with torch.rand, which no sampling_seed reaches (not even with --enable-deterministic-inference), "
    "so a rerun or a resumed run samples other rollouts; use rollout.temperature 0 where rollouts must repeat"
)


async def native_rollout_async(
    endpoints,
    prompts: list[tuple[str, list[int]]],
    *,
    sglang_cfg: SGLangConfig,
    block_size: int,
    max_new_tokens: int,
    stop_token_ids: list[int],
    teacher: str,
    temperature: float = 0.0,
    drafter_step: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    stats: Optional[dict] = None,
) -> list[RolloutRecord]:
    """Send every prompt to SGLang's own DFLASH decoding; records (no features) in prompt order.

    In flight: at most ``sglang.max_in_flight`` requests, and per server at most as
    many as its KV pool holds at full length (``request_tokens`` each), so no request
    waits in SGLang's queue past its timeout or gets retracted. The timeout grows
    with ``max_new_tokens`` (``contract.request_timeout_s``). ``stats``, when given,
    receives ``retracted`` (records cut at a retraction).
    """
    # lazy: SGLang loads this module as a plugin, and verify_client would pull aiohttp into it
    from specforge_opd.sglang.verify_client import for_each_prompt

    if temperature > 0:
        log.warning(NOT_REPRODUCIBLE, temperature)
    timeout = request_timeout_s(sglang_cfg, max_new_tokens)
    counts = {"retracted": 0}

    async def one(client, i: int, sid: str, ids: list[int]) -> RolloutRecord:
        body = native_request(ids, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids)
        payload = await client.post(i, "/generate", body, timeout_s=timeout)
        resp = parse_native_response(payload, block_size=block_size, server_version=endpoints.version)
        rec = record_from_native(
            sid, ids, resp.output_ids, resp.steps, block_size=block_size, teacher=teacher,
            stop_token_ids=stop_token_ids, drafter_step=drafter_step, server_version=endpoints.version,
            num_retractions=resp.num_retractions,
        )
        if resp.num_retractions:
            counts["retracted"] += 1
        return rec

    out = await for_each_prompt(
        endpoints, sglang_cfg, prompts, one, progress,
        token_cost=lambda ids: request_tokens(len(ids), max_new_tokens, block_size),
    )
    if counts["retracted"]:
        log.warning("%d native rollouts were retracted by SGLang under KV pressure and end early; lower sglang.max_in_flight "
                    "or raise the pool (sglang.max_total_tokens / mem_fraction_static)", counts["retracted"])
    if stats is not None:
        stats.update(counts)
    return out
