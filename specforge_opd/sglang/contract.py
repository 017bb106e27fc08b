"""The HTTP contract with SGLang: every request and response field both modes use.

Read from the ``sglang==0.5.23`` wheel (``tests/test_sglang_contract.py`` reads
the same wheel's source in CI and names whatever moved): its ``/generate`` API
(``managers/io_struct.py: GenerateReqInput``), the ``meta_info`` its tokenizer
manager builds (``managers/tokenizer_manager.py``), the scheduler's output
streamer (``managers/scheduler_components/output_streamer.py``) and the DFLASH
worker (``speculative/dflash_worker_v2.py: DFlashWorkerV2``). The GPU check
scripts (``scripts/gpu_check_sglang*.sh``) confirm the parts a CPU cannot.

Verify mode, one verify step of block m at anchor a (DESIGN.md section 3):

* request ``input_ids`` = the sequence up to and including slot 0 (positions 0..a)
  followed by the drafted tokens d_1..d_{bs-1}; ``sampling_params`` greedy, one new
  token; ``return_logprob`` with ``logprob_start_len = a`` and ``top_logprobs_num = k``;
  ``return_hidden_states`` when features are wanted (server flags
  ``--enable-return-hidden-states --enable-return-aux-hidden-states
  --return-aux-hidden-state-layer-ids IDS --speculative-algorithm DFLASH``: 0.5.23
  refuses aux capture unless an algorithm names the capture convention, and resets
  the algorithm to none itself when no draft path is given).
* response ``meta_info.input_token_logprobs[j]`` = [logprob, token id, text] of the
  input token at position a + j given the positions before it, so entry k (k >= 1)
  is log p(d_k | slot 0, d_<k): the teacher's draft log-prob. ``input_top_logprobs[k]``
  is the teacher's top-k at drafted slot k; entry 0 (position a) is not used.
  ``output_ids[0]`` is the target's argmax after the last drafted token.
* ``meta_info.cached_tokens`` = c, the prefix served from SGLang's radix cache: its
  positions are not recomputed, so ``meta_info.hidden_states[0]`` holds rows for
  positions c..len-1 only. SGLang caps the reused prefix at ``logprob_start_len``,
  so c <= a and the accepted positions a..a+r_m always come back.

Native mode: a plain ``/generate`` to a server running DFLASH with the plugin of
``specforge_opd.sglang.native``. The plugin's per-verify-step values land at the
top level of ``meta_info`` (the tokenizer manager sets ``meta_info[key]`` for each
``customized_info`` key), one entry per verify step for each key of
``NATIVE_STEP_FIELDS``; ``meta_info.spec_verify_ct`` is the step count, omitted
by SGLang when a request finished without any verify step.

Every parse function raises ``ContractError`` naming the field and the server version.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from specforge_opd.errors import UserError

#: The SGLang release the contract was read from (older ones lack DFLASH or aux hidden states).
MIN_SGLANG_VERSION = "0.5.23"

#: SGLang's model code captures aux hidden states "before layer i" and adds this
#: offset itself (``layers_to_capture = [k + 1 for k in layer_ids]`` in its qwen3,
#: qwen3_moe and llama models), so layer id k comes back as the output of decoder
#: layer k, HF ``hidden_states[k + 1]``. We pass our ids unchanged; the stand-in
#: server applies the same offset so that a second shift on our side shows.
SGLANG_CAPTURE_OFFSET = 1

#: Keys the native plugin writes per verify step into ``customized_info``.
NATIVE_STEP_FIELDS = ("opd_anchor", "opd_draft", "opd_accepted", "opd_draft_logprob")

#: Sampling parameters that edit the verify logits in place before acceptance
#: (``apply_dflash_verify_logits_adjustments``, the grammar mask): a request
#: setting them would record an adjusted teacher, so native requests refuse them.
LOGIT_EDITING_SAMPLING_PARAMS = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "custom_params": None,
}


class ContractError(UserError, ValueError):
    """A request or response breaks the contract; names the field, the problem and the server version."""

    def __init__(self, field: str, problem: str, server_version: Optional[str] = None):
        self.field = field
        self.server_version = server_version
        ver = server_version or "unknown"
        super().__init__(
            f"SGLang response field `{field}`: {problem} (server version {ver}; the contract was read from "
            f"SGLang {MIN_SGLANG_VERSION}, see specforge_opd/sglang/contract.py)"
        )


def version_tuple(v: str) -> tuple[int, ...]:
    """``"0.5.23.post1"`` -> (0, 5, 23); non-numeric parts end the tuple."""
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits or digits != part[: len(digits)]:
            if digits:
                out.append(int(digits))
            break
        out.append(int(digits))
    return tuple(out)


def server_layer_ids(target_layer_ids: list[int], num_target_layers: Optional[int] = None) -> list[int]:
    """Ids to pass to ``--return-aux-hidden-state-layer-ids`` for our ``target_layer_ids``: the same ids, each
    once, ascending.

    Our layer k is the output of decoder layer k (HF ``hidden_states[k + 1]``).
    SGLang's DFLASH capture convention adds the +1 itself (``SGLANG_CAPTURE_OFFSET``),
    so adding it here too would train on ``hidden_states[k + 2]`` with every
    shape still fitting. SGLang's models capture inside their layer loop
    (``if i in self.layers_to_capture``), so the returned features are
    concatenated in ascending layer order whatever order the ids are given in;
    and SGLang refuses a repeated id, which small targets' drafters can have
    (``[1, 1]``). ``feature_columns`` maps the server's columns back to ours.

    Raises:
        ValueError: a negative id, or, with ``num_target_layers``, the last decoder
            layer: its output is never captured, because the capture runs before
            layer k + 1, which does not exist.
    """
    ids = sorted(set(int(k) for k in target_layer_ids))
    if any(k < 0 for k in ids):
        raise ValueError(f"draft target_layer_ids {ids}: SGLang needs non-negative layer ids")
    if num_target_layers is not None and any(k >= num_target_layers - 1 for k in ids):
        raise ValueError(
            f"draft target_layer_ids {ids}: SGLang captures the output of layer k before layer k+1, so the last "
            f"layer ({num_target_layers - 1}) and beyond cannot be captured; choose ids below {num_target_layers - 1}"
        )
    return ids


def feature_columns(target_layer_ids: list[int], hidden: int) -> Optional[torch.Tensor]:
    """Columns of the server's features (``server_layer_ids`` order) that give ours, [n_layers * hidden] int64.

    None when the ids are distinct and ascending (the server's columns are ours).
    """
    ids = [int(k) for k in target_layer_ids]
    uniq = server_layer_ids(ids)
    if uniq == ids:
        return None
    pos = {k: j for j, k in enumerate(uniq)}
    return torch.cat([torch.arange(pos[k] * hidden, (pos[k] + 1) * hidden) for k in ids])


def request_timeout_s(cfg, max_new_tokens: int) -> float:
    """Per-request timeout: ``sglang.request_timeout_s`` plus ``sglang.timeout_per_token_s`` per new token.

    A 4096-token native rollout decodes for minutes; a flat timeout sized for a
    one-token verify step would time it out and retry it from scratch.
    """
    return float(cfg.request_timeout_s) + float(cfg.timeout_per_token_s) * max(0, int(max_new_tokens))


# ---------------------------------------------------------------------------
# requests


def prefill_request(prompt_ids: list[int], *, want_hidden: bool) -> dict:
    """The first request of a sequence: the prompt, one greedy token, features of the prompt.

    ``return_logprob`` with ``logprob_start_len = 0`` keeps SGLang from serving any
    prefix from its radix cache (another sequence may share the prompt), so the
    hidden states of every prompt position come back.
    """
    return {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 0,
        "return_hidden_states": bool(want_hidden),
    }


def verify_request(seq_ids: list[int], drafts: list[int], *, top_k: int, want_hidden: bool) -> dict:
    """One verify step: ``seq_ids`` ends with slot 0 (at anchor len(seq_ids)-1), then the drafts."""
    anchor = len(seq_ids) - 1
    return {
        "input_ids": [int(t) for t in seq_ids] + [int(t) for t in drafts],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": anchor,
        "top_logprobs_num": int(top_k),
        "return_hidden_states": bool(want_hidden),
    }


def native_request(
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_token_ids: list[int],
    extra_sampling: Optional[dict] = None,
) -> dict:
    """A native-mode request: SGLang decodes with DFLASH and the plugin reports every verify step.

    ``return_logprob`` is set on purpose: it keeps DFLASH's
    ``_can_skip_verify_logits`` False, so the verify logits the plugin reads are
    present and gathered over the whole vocabulary at any tensor-parallel size
    (without it, greedy batches at TP > 1 keep only each rank's vocabulary shard
    or drop the logits). The output log-probs it adds are one float per token.

    Raises:
        ValueError: ``extra_sampling`` sets a parameter that edits the verify logits
            before acceptance (``LOGIT_EDITING_SAMPLING_PARAMS``): the teacher would be
            the adjusted distribution, not the target's.
    """
    sp = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "stop_token_ids": [int(t) for t in stop_token_ids],
    }
    for k, v in (extra_sampling or {}).items():
        if k in LOGIT_EDITING_SAMPLING_PARAMS and v != LOGIT_EDITING_SAMPLING_PARAMS[k]:
            raise ValueError(
                f"sampling parameter {k}={v!r}: SGLang applies it to the verify logits in place before acceptance, "
                "so the recorded teacher would not be the target's distribution; native rollouts refuse it"
            )
        sp[k] = v
    return {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
    }

# ---------------------------------------------------------------------------
# responses


@dataclass
class GenerateResponse:
    """A checked verify-mode response.

    Attributes:
        output_id: the target's greedy token after the last input position.
        token_logprobs: float32 [L] log-prob of input positions start..n-1 (entry 0 may be nan).
        top_ids: int64 [L, k], top_logprobs: float32 [L, k] (None without ``return_logprob``).
        cached_tokens: prefix length served from the radix cache.
        hidden_rows: float32 [n - cached_tokens, feature_dim] or None.
    """

    output_id: int
    cached_tokens: int
    token_logprobs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None
    hidden_rows: Optional[torch.Tensor] = None


def _meta(payload: Any, version: Optional[str]) -> dict:
    if isinstance(payload, list):
        if len(payload) != 1:
            raise ContractError("<body>", f"expected one result, got a list of {len(payload)}", version)
        payload = payload[0]
    if not isinstance(payload, dict):
        raise ContractError("<body>", f"expected a JSON object, got {type(payload).__name__}", version)
    meta = payload.get("meta_info")
    if not isinstance(meta, dict):
        raise ContractError("meta_info", "missing or not an object", version)
    return meta


def _int(meta: dict, key: str, version: Optional[str], default: Optional[int] = None) -> int:
    v = meta.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ContractError(f"meta_info.{key}", f"expected an integer, got {v!r}", version)
    return int(v)


def _output_id(payload: dict, meta: dict, version: Optional[str]) -> int:
    out = payload.get("output_ids")
    if isinstance(out, list) and out:
        return int(out[0])
    otl = meta.get("output_token_logprobs")
    if isinstance(otl, list) and otl and isinstance(otl[0], (list, tuple)) and len(otl[0]) >= 2:
        return int(otl[0][1])
    raise ContractError("output_ids", "missing or empty (start SGLang with --skip-tokenizer-init or request return_logprob)", version)


def _entry(e: Any, field: str, version: Optional[str]) -> tuple[float, int]:
    if not isinstance(e, (list, tuple)) or len(e) < 2:
        raise ContractError(field, f"expected [logprob, token_id, text], got {e!r}", version)
    lp = float("nan") if e[0] is None else float(e[0])
    return lp, int(e[1])


def parse_generate_response(
    payload: Any,
    *,
    n_input: int,
    logprob_start_len: Optional[int],
    top_k: int,
    feature_dim: Optional[int],
    server_version: Optional[str] = None,
) -> GenerateResponse:
    """Check and convert a ``/generate`` response of ``prefill_request`` or ``verify_request``.

    Args:
        n_input: number of input ids sent.
        logprob_start_len: as sent (None: no logprobs requested).
        top_k: ``top_logprobs_num`` as sent.
        feature_dim: n_layers * hidden when hidden states were requested, else None.

    Raises:
        ContractError: a missing field, a wrong length or width, a non-finite value.
    """
    v = server_version
    if isinstance(payload, list) and len(payload) == 1:
        payload = payload[0]
    meta = _meta(payload, v)
    out = GenerateResponse(output_id=_output_id(payload, meta, v), cached_tokens=_int(meta, "cached_tokens", v, 0))
    if not 0 <= out.cached_tokens < n_input:
        raise ContractError("meta_info.cached_tokens", f"{out.cached_tokens} outside 0..{n_input - 1}", v)
    if logprob_start_len is not None:
        L = n_input - logprob_start_len
        if out.cached_tokens > logprob_start_len:
            raise ContractError(
                "meta_info.cached_tokens",
                f"{out.cached_tokens} > logprob_start_len {logprob_start_len}: the server reused a prefix past the "
                "positions whose log-probs were requested",
                v,
            )
        itl = meta.get("input_token_logprobs")
        if not isinstance(itl, list) or len(itl) != L:
            got = len(itl) if isinstance(itl, list) else type(itl).__name__
            raise ContractError("meta_info.input_token_logprobs", f"expected {L} entries (positions {logprob_start_len}..{n_input - 1}), got {got}", v)
        itp = meta.get("input_top_logprobs") if top_k > 0 else [[] for _ in range(L)]
        if not isinstance(itp, list) or len(itp) != L:
            got = len(itp) if isinstance(itp, list) else type(itp).__name__
            raise ContractError("meta_info.input_top_logprobs", f"expected {L} entries, got {got}", v)
        lps, ids, tops = [], [], []
        for j, (e, row) in enumerate(zip(itl, itp)):
            lp, _tok = _entry(e, f"meta_info.input_token_logprobs[{j}]", v)
            lps.append(lp)
            if j == 0 and not row:
                # position logprob_start_len itself: SGLang may omit it; it is never used
                ids.append([0] * top_k)
                tops.append([float("nan")] * top_k)
                continue
            if not isinstance(row, list) or len(row) != top_k:
                got = len(row) if isinstance(row, list) else row
                raise ContractError(f"meta_info.input_top_logprobs[{j}]", f"expected {top_k} entries (top_logprobs_num), got {got!r}", v)
            pairs = [_entry(x, f"meta_info.input_top_logprobs[{j}]", v) for x in row]
            ids.append([p[1] for p in pairs])
            tops.append([p[0] for p in pairs])
        out.token_logprobs = torch.tensor(lps, dtype=torch.float32)
        out.top_ids = torch.tensor(ids, dtype=torch.int64)
        out.top_logprobs = torch.tensor(tops, dtype=torch.float32)
        body = out.top_logprobs[1:]
        if body.numel() and not torch.isfinite(body).all():
            raise ContractError("meta_info.input_top_logprobs", "non-finite log-probs at drafted slots", v)
        if top_k > 0 and L > 1 and not torch.isfinite(out.token_logprobs[1:]).all():
            raise ContractError("meta_info.input_token_logprobs", "non-finite log-probs at drafted slots", v)
    if feature_dim is not None:
        hs = meta.get("hidden_states")
        if not isinstance(hs, list) or not hs:
            raise ContractError("meta_info.hidden_states", "missing (start SGLang with --enable-return-hidden-states and --enable-return-aux-hidden-states)", v)
        rows = hs[0]
        n_rows = n_input - out.cached_tokens
        try:
            t = torch.tensor(rows, dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise ContractError("meta_info.hidden_states[0]", f"not a numeric matrix ({e})", v) from None
        if t.dim() == 2 and t.shape[1] == feature_dim and 0 < t.shape[0] < n_rows:
            raise ContractError(
                "meta_info.hidden_states[0]",
                f"{t.shape[0]} rows < input {n_input} - cached {out.cached_tokens} = {n_rows}: SGLang keeps the hidden "
                "states of a request's last prefill chunk only, so an extend longer than its --chunked-prefill-size "
                "(2048 to 8192 by GPU memory unless set) loses the rows of the earlier chunks; add "
                "'--chunked-prefill-size', 'N' to sglang.extra_args with N above the longest prompt + "
                "rollout.max_new_tokens",
                v,
            )
        if t.dim() != 2 or tuple(t.shape) != (n_rows, feature_dim):
            raise ContractError(
                "meta_info.hidden_states[0]",
                f"shape {tuple(t.shape)} != [input {n_input} - cached {out.cached_tokens} = {n_rows}, "
                f"n_layers * hidden = {feature_dim}] (check --return-aux-hidden-state-layer-ids)",
                v,
            )
        if not torch.isfinite(t).all():
            raise ContractError("meta_info.hidden_states[0]", "non-finite values", v)
        out.hidden_rows = t
    return out



@dataclass
class NativeStep:
    """One verify step as the native plugin reports it (SGLang's own DFLASH decoding).

    Attributes:
        anchor: position of slot 0 (the previous bonus token) in prompt + output.
        draft: the bs-1 drafted token ids d_1..d_{bs-1}.
        accepted: r in 0..bs-1, the drafts SGLang accepted (its ``accept_lens`` - 1).
        draft_logprob: bs-1 floats, the teacher's log p(d_k | slot 0, d_<k) at
            temperature 1; None when the plugin could not read unadjusted verify
            logits for that step (see ``native.step_payloads``).
    """

    anchor: int
    draft: list[int]
    accepted: int
    draft_logprob: Optional[list[float]]


@dataclass
class NativeResponse:
    """A checked native-mode response: the response tokens, one ``NativeStep`` per verify step.

    ``num_retractions``: how often SGLang retracted the request under KV-cache
    pressure; each retraction re-prefills it, which emits one token outside any
    verify step (``native.record_from_native`` cuts the record there).
    """

    output_ids: list[int]
    steps: list[NativeStep]
    finish_reason: Optional[str]
    spec_verify_ct: int
    num_retractions: int = 0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_native_response(payload: Any, *, block_size: int, server_version: Optional[str] = None) -> NativeResponse:
    """Check a native-mode response: ``output_ids`` and one entry per verify step under each plugin key.

    ``meta_info[key]`` for each key of ``NATIVE_STEP_FIELDS`` is a list with one
    entry per verify step (entries may arrive JSON-encoded, as strings).
    ``meta_info.spec_verify_ct`` is absent when the request finished without a
    verify step (its first token a stop token, or ``max_new_tokens`` 1): zero steps.

    Raises:
        ContractError: missing plugin keys (the server runs without the plugin, or
            its hooks failed to apply), fewer entries than ``spec_verify_ct`` (the
            server flushed the response early and cut the values by token offset),
            output tokens past the first with no verify step (no DFLASH), drafts of
            the wrong width.
    """
    v = server_version
    if isinstance(payload, list) and len(payload) == 1:
        payload = payload[0]
    meta = _meta(payload, v)
    out_ids = payload.get("output_ids")
    if not isinstance(out_ids, list):
        raise ContractError("output_ids", "missing (start SGLang with --skip-tokenizer-init)", v)
    n_steps = _int(meta, "spec_verify_ct", v, 0)
    retractions = _int(meta, "num_retractions", v, 0)
    if n_steps == 0 and len(out_ids) > 1 + retractions:
        raise ContractError(
            "meta_info.spec_verify_ct",
            f"absent or 0 with {len(out_ids)} output tokens: the server did not decode speculatively "
            "(start it with --speculative-algorithm DFLASH --speculative-draft-model-path DIR)",
            v,
        )
    cols = {}
    for key in NATIVE_STEP_FIELDS:
        col = meta.get(key)
        if n_steps == 0:
            # a zero-step request batched with others may still carry empty or None-padded values
            cols[key] = []
            continue
        if col is None:
            if key == "opd_draft_logprob":
                cols[key] = [None] * n_steps
                continue
            raise ContractError(
                f"meta_info.{key}",
                f"missing with spec_verify_ct {n_steps}: the server does not run the specforge_opd native plugin "
                "(install the plugin into SGLang's environment, allow `specforge_opd_native` in SGLANG_PLUGINS, and "
                "look for 'Failed to apply hooks' in the server log)",
                v,
            )
        if not isinstance(col, list):
            raise ContractError(f"meta_info.{key}", f"not a list (got {type(col).__name__})", v)
        col = [json.loads(x) if isinstance(x, str) else x for x in col]
        if len(col) != n_steps:
            raise ContractError(
                f"meta_info.{key}",
                f"{len(col)} entries != spec_verify_ct {n_steps}: either per-step values were cut when the server "
                "flushed the response early (SGLANG_FORCE_STREAM_INTERVAL; the plugin marks its keys request-level so "
                "that they arrive whole at the finish: check that its hook on SchedulerOutputStreamer applied), or the "
                "plugin's verify hook failed at some steps (look for 'recording a DFLASH verify step failed' in the "
                "server log)",
                v,
            )
        cols[key] = col
    steps = []
    for i in range(n_steps):
        draft = cols["opd_draft"][i]
        if not isinstance(draft, list) or len(draft) != block_size - 1 or not all(_is_int(t) and t >= 0 for t in draft):
            raise ContractError(f"meta_info.opd_draft[{i}]", f"expected {block_size - 1} tokens (block_size - 1, non-negative integers), got {draft!r}", v)
        lp = cols["opd_draft_logprob"][i]
        if lp is not None:
            if not isinstance(lp, list) or len(lp) != block_size - 1:
                raise ContractError(f"meta_info.opd_draft_logprob[{i}]", f"expected {block_size - 1} finite floats or null, got {lp!r}", v)
            bad = next((k for k, x in enumerate(lp) if not _is_finite_number(x)), None)
            if bad is not None:
                raise ContractError(
                    f"meta_info.opd_draft_logprob[{i}][{bad}]",
                    f"{lp[bad]!r} is not a finite float: a non-finite teacher log-prob (SGLang's JSON encoder writes -inf "
                    "and nan as null); set rollout.teacher=full with training.feature_source=target to recompute the teacher",
                    v,
                )
        acc = cols["opd_accepted"][i]
        if not isinstance(acc, int) or isinstance(acc, bool) or not 0 <= acc <= block_size - 1:
            raise ContractError(f"meta_info.opd_accepted[{i}]", f"expected an integer in 0..{block_size - 1}, got {acc!r}", v)
        anchor = cols["opd_anchor"][i]
        if not isinstance(anchor, int) or isinstance(anchor, bool) or anchor < 0:
            raise ContractError(f"meta_info.opd_anchor[{i}]", f"expected a non-negative integer, got {anchor!r}", v)
        steps.append(NativeStep(anchor, [int(t) for t in draft], acc, None if lp is None else [float(x) for x in lp]))
    fr = meta.get("finish_reason")
    reason = fr.get("type") if isinstance(fr, dict) else (fr if isinstance(fr, str) else None)
    return NativeResponse([int(t) for t in out_ids], steps, reason, n_steps, retractions)


def parse_server_info(payload: Any) -> str:
    """The server version from ``/server_info`` (``version``); "unknown" when absent."""
    if isinstance(payload, dict) and isinstance(payload.get("version"), str):
        return payload["version"]
    return "unknown"


def parse_pool_tokens(payload: Any) -> Optional[int]:
    """The KV pool size in tokens from ``/server_info`` (``max_total_num_tokens``, scheduler info); None when absent."""
    if not isinstance(payload, dict):
        return None
    for src in (payload, *(payload.get("internal_states") or [])):
        if isinstance(src, dict):
            n = src.get("max_total_num_tokens")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return None


def parse_running_slots(payload: Any) -> Optional[int]:
    """Requests the server decodes at once, from ``/server_info``; None when absent.

    0.5.23 reports the scheduler's effective limit per data-parallel rank in
    ``internal_states[*].effective_max_running_requests_per_dp`` (summed over the
    ranks) and the resolved ``max_running_requests`` at the top level (DFLASH resets
    it to 48 unless set); requests past it wait in SGLang's queue.
    """
    if not isinstance(payload, dict):
        return None
    per_dp = [s.get("effective_max_running_requests_per_dp") for s in (payload.get("internal_states") or []) if isinstance(s, dict)]
    if per_dp and all(_is_int(n) and n > 0 for n in per_dp):
        return int(sum(per_dp))
    n = payload.get("max_running_requests")
    return int(n) if _is_int(n) and n > 0 else None
