"""Plain target decoding through SGLang's ``/generate``: the SFT stage's responses on a remote target.

``stages.rollout.response_generator`` hands ``sglang_generate`` to ``responses.generate_responses`` when
``rollout.backend`` names SGLang; the embedded target decodes in process instead.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from specforge_opd.config import SGLangConfig
from specforge_opd.rollout.step import sample_seed
from specforge_opd.sglang.contract import ContractError, request_timeout_s
from specforge_opd.sglang.launcher import Endpoints, ServerError
from specforge_opd.sglang.verify_client import for_each_prompt
from specforge_opd.stepkeys import SFTError


def sglang_generate(urls: list[str], prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int],
                    temperature: float, seed: int, timeout_s: float, max_in_flight: int = 32,
                    timeout_per_token_s: float = 0.05, max_retries: int = 2,
                    sample_ids: Optional[list[str]] = None) -> list[list[int]]:
    """Target decoding through SGLang's native ``/generate`` (``input_ids`` in, ``output_ids`` out).

    One request per prompt, at most ``max_in_flight`` in flight at once (SGLang
    batches the requests it holds by itself), spread round-robin over ``urls``.
    A request may take ``timeout_s + timeout_per_token_s * max_new_tokens``
    seconds; a transient failure (connection error, timeout, HTTP 5xx/429) is
    retried ``max_retries`` times with backoff, so one slow prompt no longer
    fails the whole set. Each request's ``sampling_seed`` is ``step.sample_seed(seed,
    sample id)`` (31 bits; ids default to the prompt index), as the embedded backend seeds
    each row, so prompts do not share one random stream. Returns the new tokens of each
    prompt, in prompt order.

    Raises:
        SFTError: no URL configured, a server unreachable after the retries, or a
            reply without ``output_ids``.
    """
    if not urls:
        raise SFTError("rollout.backend is sglang but sglang.urls is empty; start a server and list its URL")
    cfg = SGLangConfig(urls=list(urls), request_timeout_s=timeout_s, timeout_per_token_s=timeout_per_token_s,
                       max_in_flight=max_in_flight, max_retries=max_retries)
    timeout = request_timeout_s(cfg, max_new_tokens)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": list(stop_token_ids)}

    async def one(client, i: int, sid: str, ids: list[int]) -> list[int]:
        params = dict(sampling, sampling_seed=sample_seed(seed, sid, bits=31))
        reply = await client.post(i, "/generate", {"input_ids": ids, "sampling_params": params}, timeout_s=timeout)
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        if not isinstance(reply, dict) or "output_ids" not in reply:
            keys = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise SFTError(f"SGLang server {client.endpoints.url(i)} replied without output_ids (keys {keys})")
        return [int(t) for t in reply["output_ids"]]

    try:
        ids = [str(i) for i in range(len(prompts))] if sample_ids is None else [str(s) for s in sample_ids]
        return asyncio.run(for_each_prompt(Endpoints(list(urls)), cfg, [(s, list(p)) for s, p in zip(ids, prompts)], one))
    except (ServerError, ContractError) as e:
        raise SFTError(f"SGLang /generate failed: {e}") from e
