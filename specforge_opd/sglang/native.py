"""Native mode: SGLang runs DFLASH speculative decoding itself; a plugin reports every verify step.

Three parts (DESIGN.md section 5; the paper's authors recorded the same per-step
facts in their SGLang fork, bingyang-lei/Draft-OPD):

1. ``verify_step_payloads``: a pure function from the tensors SGLang's DFLASH verify
   holds (``DFlashVerifyInput.draft_token`` [B*bs] with slot 0 = the current
   verified token, ``logits_output.next_token_logits`` [B*bs, V], ``batch.seq_lens``
   [B] = each request's committed length = the anchor) to one record per request:
   anchor, drafted block, accepted count, teacher log-probs of the drafted tokens.
2. ``register``: the plugin, loaded by SGLang through its ``sglang.srt.plugins``
   entry point (``specforge_opd_native = specforge_opd.sglang.native:register``);
   it wraps ``DFlashVerifyInput.verify`` with an AROUND hook and puts the payloads
   into ``logits_output.customized_info``, which SGLang forwards to ``meta_info``.
   Not run here (no SGLang on a CPU): ``scripts/gpu_check_sglang_native.sh`` checks it.
3. ``record_from_native`` and ``native_rollout_async``: the client that turns a
   response into a ``RolloutRecord`` without features (the trainer recomputes them,
   ``training.feature_source: target``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import SGLangConfig
from ..records import RolloutRecord
from .contract import NATIVE_STEP_FIELDS, ContractError, NativeStep, native_request, parse_native_response


# ---------------------------------------------------------------------------
# 1. the pure conversion (runs inside SGLang's worker, and in the stand-in)


def verify_step_payloads(
    draft_token: torch.Tensor,
    target_logits: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> list[dict]:
    """Per request, what one DFLASH verify step did.

    Args:
        draft_token: int64 [B*bs] or [B, bs]: slot 0 = the verified token at the
            anchor, slots 1..bs-1 = the drafter's tokens (SGLang's ``draft_token``).
        target_logits: float [B*bs, V] or [B, bs, V]: the target's verify-pass logits;
            row k predicts the token after slot k.
        seq_lens: int [B]: committed tokens per request before the step = the anchor
            (SGLang keeps the current token uncommitted).
        block_size: bs (``--speculative-num-draft-tokens``).

    Returns:
        One dict per request with ``NATIVE_STEP_FIELDS``: ``opd_anchor`` (int),
        ``opd_draft`` (bs-1 ints), ``opd_accepted`` (r in 0..bs-1: the drafted prefix
        equal to the target's argmax, counted before any stop-token truncation),
        ``opd_draft_logprob`` (bs-1 floats: log p(d_k | slot 0, d_<k) at temperature 1).

    Raises:
        ValueError: shapes that do not fit ``block_size``.
    """
    cand = draft_token.reshape(-1, block_size)
    B = cand.shape[0]
    logits = target_logits.reshape(B, block_size, -1).float()
    if seq_lens.numel() != B:
        raise ValueError(f"seq_lens has {seq_lens.numel()} entries, the verify batch has {B} requests")
    lp = torch.log_softmax(logits[:, :-1, :], dim=-1)
    drafts = cand[:, 1:].long()
    draft_lp = lp.gather(2, drafts[:, :, None])[:, :, 0]
    match = (drafts == logits[:, :-1, :].argmax(-1)).long()
    accepted = match.cumprod(dim=1).sum(dim=1)
    out = []
    for i in range(B):
        out.append(
            {
                "opd_anchor": int(seq_lens[i]),
                "opd_draft": [int(t) for t in drafts[i].tolist()],
                "opd_accepted": int(accepted[i]),
                "opd_draft_logprob": [float(x) for x in draft_lp[i].tolist()],
            }
        )
    return out


def customized_info_of(payloads: list[dict]) -> dict:
    """``customized_info`` layout: key -> one value per request in the batch."""
    return {k: [p[k] for p in payloads] for k in NATIVE_STEP_FIELDS}


# ---------------------------------------------------------------------------
# 2. the SGLang plugin (imported only inside SGLang's processes)

_VERIFY_TARGET = "sglang.srt.speculative.dflash_info.DFlashVerifyInput.verify"


def _around_verify(original, self, *args, **kwargs):
    batch = kwargs.get("batch")
    logits_output = kwargs.get("logits_output")
    payloads = None
    if batch is not None and logits_output is not None and not batch.forward_mode.is_idle():
        # before verify(): seq_lens still excludes this block, logits are untouched
        payloads = verify_step_payloads(
            self.draft_token.detach(),
            logits_output.next_token_logits.detach(),
            batch.seq_lens_cpu.clone() if getattr(batch, "seq_lens_cpu", None) is not None else batch.seq_lens.cpu(),
            int(self.draft_token_num),
        )
    result = original(self, *args, **kwargs)
    if payloads is not None:
        info = getattr(logits_output, "customized_info", None) or {}
        info.update(customized_info_of(payloads))
        logits_output.customized_info = info
    return result


def register() -> None:
    """SGLang general-plugin entry point: hook DFLASH verify to report per-step records.

    Needs ``--disable-overlap-schedule`` (the hook wraps the spec-v1 verify path);
    the launcher adds it in native mode.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_VERIFY_TARGET, _around_verify, HookType.AROUND)


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
) -> RolloutRecord:
    """Turn one native-mode response into a ``RolloutRecord`` without features.

    Checks the anchor recurrence (a_0 = prompt length, a_{m+1} = a_m + r_m + 1) and
    that every accepted draft is the token the output holds at its position.
    Teacher: ``token`` form (the drafted tokens' log-probs) when the plugin sent them
    and ``teacher`` is ``token`` or ``topk`` (top-k is not reported natively: the
    record carries the token form, the trainer recomputes the rest); ``full`` keeps
    none (the trainer recomputes it).

    Raises:
        ContractError: steps inconsistent with the output (field named).
    """
    P = len(prompt_ids)
    seq = [int(t) for t in prompt_ids] + [int(t) for t in output_ids]
    T = len(seq)
    prev = None
    for m, s in enumerate(steps):
        want = P if prev is None else prev.anchor + prev.accepted + 1
        if s.anchor != want:
            raise ContractError(f"meta_info.customized_info.opd_anchor[{m}]", f"{s.anchor} != expected {want} (a_0 = prompt length, a_m+1 = a_m + r_m + 1)", server_version)
        if s.anchor >= T:
            raise ContractError(f"meta_info.customized_info.opd_anchor[{m}]", f"{s.anchor} past the sequence end {T - 1}", server_version)
        for k in range(1, s.accepted + 1):
            if s.anchor + k < T and seq[s.anchor + k] != s.draft[k - 1]:
                raise ContractError(f"meta_info.customized_info.opd_draft[{m}]", f"accepted draft {k} = {s.draft[k - 1]} but output holds {seq[s.anchor + k]}", server_version)
        prev = s
    M = len(steps)
    rec = RolloutRecord(
        sample_id=sample_id,
        input_ids=torch.tensor(seq, dtype=torch.long),
        prompt_len=P,
        anchors=torch.tensor([s.anchor for s in steps], dtype=torch.long),
        drafts=torch.tensor([s.draft for s in steps], dtype=torch.long).reshape(M, block_size - 1),
        accepted=torch.tensor([s.accepted for s in steps], dtype=torch.long),
        finished=bool(seq[P:]) and seq[-1] in set(int(t) for t in stop_token_ids),
        drafter_step=drafter_step,
    )
    if teacher in ("token", "topk") and all(s.draft_logprob is not None for s in steps):
        rec.teacher_draft_logprob = torch.tensor([s.draft_logprob for s in steps], dtype=torch.float32).reshape(M, block_size - 1)
    rec.validate()
    return rec


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
) -> list[RolloutRecord]:
    """Send every prompt to SGLang's own DFLASH decoding; records (no features) in prompt order."""
    from .verify_client import for_each_prompt

    async def one(client, i: int, sid: str, ids: list[int]) -> RolloutRecord:
        body = native_request(ids, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids)
        payload = await client.post(i, "/generate", body)
        resp = parse_native_response(payload, block_size=block_size, server_version=endpoints.version)
        return record_from_native(
            sid, ids, resp.output_ids, resp.steps, block_size=block_size, teacher=teacher,
            stop_token_ids=stop_token_ids, drafter_step=drafter_step, server_version=endpoints.version,
        )

    return await for_each_prompt(endpoints, sglang_cfg, prompts, one, progress)
