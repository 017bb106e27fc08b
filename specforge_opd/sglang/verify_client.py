"""Verify mode: our process drafts, a stock SGLang server verifies over HTTP (DESIGN.md section 5).

Each request carries the whole sequence, so a request is stateless: a server that
dies and restarts loses nothing but the KV cache, and in-flight sequences resume
with the retry. Many sequences are in flight at once (asyncio, ``sglang.max_in_flight``);
transient errors (connection refused or reset, timeouts, HTTP 5xx/429) are retried
with exponential backoff (``sglang.max_retries``, ``sglang.backoff_s``), a launched
server that died is restarted once. Everything else (HTTP 4xx, a malformed
response) fails at once with the field named (``contract.ContractError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Iterable, Optional

import aiohttp
import torch

from specforge_opd.config import SGLangConfig
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.rollout.step import PerSequenceTarget, greedy_only_error
from specforge_opd.sglang.contract import (
    ContractError,
    feature_columns,
    parse_generate_response,
    prefill_request,
    server_layer_ids,
    verify_request,
)
from specforge_opd.sglang.launcher import Endpoints, ServerError
from specforge_opd.sglang.sizing import request_concurrency
from specforge_opd.sglang.speculate import Drafter, PrefillResult, VerifyResult, speculate_sequence, verify_caps

log = logging.getLogger(__name__)

_RETRY_STATUS = {429, 500, 502, 503, 504}


class TransientError(RuntimeError):
    pass


class HTTPClient:
    """POSTs JSON to one of ``endpoints`` with retries, backoff and a per-request timeout."""

    def __init__(self, endpoints: Endpoints, cfg: SGLangConfig):
        self.endpoints = endpoints
        self.cfg = cfg
        self._session: Optional[aiohttp.ClientSession] = None
        self._restart_lock = asyncio.Lock()
        #: servers whose handling of ``sampling_seed`` was checked (``check_seed``)
        self._seed_checked: set[str] = set()

    async def check_seed(self, server: int, body: dict) -> None:
        """Warn once per server when ``body`` samples (temperature > 0) with a ``sampling_seed`` the server ignores.

        SGLang 0.5.23 reads ``sampling_seed`` only with ``--enable-deterministic-inference``
        (``SamplingBatchInfo.from_schedule_batch``); its ``/server_info`` reports the flag.
        Without it, sampled responses are neither reproducible nor resumable.
        """
        sp = body.get("sampling_params") or {}
        url = self.endpoints.url(server)
        if sp.get("sampling_seed") is None or float(sp.get("temperature", 1.0)) <= 0 or url in self._seed_checked:
            return
        self._seed_checked.add(url)
        try:
            async with self._session.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=10.0)) as r:
                info = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            info = None
        if not (isinstance(info, dict) and info.get("enable_deterministic_inference") is True):
            log.warning("SGLang server %s ignores sampling_seed (SGLang reads it only with --enable-deterministic-inference): "
                        "responses sampled at temperature %s are neither reproducible nor resumable; start the server "
                        "with --enable-deterministic-inference", url, sp.get("temperature"))

    async def __aenter__(self) -> "HTTPClient":
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, server: int, path: str, body: dict, timeout_s: Optional[float] = None) -> dict:
        """POST ``body`` to server ``server`` (round-robin index); returns the decoded JSON.

        ``timeout_s`` overrides ``sglang.request_timeout_s`` for this request (long
        generations: ``contract.request_timeout_s``).

        Raises:
            ServerError: retries exhausted, or the launched server died twice.
            ContractError: a 4xx answer or a body that is not JSON.
        """
        assert self._session is not None, "use `async with HTTPClient(...)`"
        await self.check_seed(server, body)
        delay = self.cfg.backoff_s
        last = None
        for attempt in range(self.cfg.max_retries + 1):
            url = self.endpoints.url(server) + path
            try:
                kw = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=float(timeout_s))}
                async with self._session.post(url, json=body, **kw) as resp:
                    text = await resp.text()
                    if resp.status in _RETRY_STATUS:
                        raise TransientError(f"HTTP {resp.status}: {text[:200]}")
                    if resp.status >= 400:
                        raise ContractError("<status>", f"HTTP {resp.status} from {url}: {text[:500]}", self.endpoints.version)
                    try:
                        import json

                        return json.loads(text)
                    except ValueError:
                        raise ContractError("<body>", f"not JSON: {text[:200]!r}", self.endpoints.version) from None
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, TransientError) as e:
                last = e
                log.warning("SGLang request to %s failed (%s: %s), attempt %d/%d", url, type(e).__name__, e, attempt + 1, self.cfg.max_retries + 1)
                if attempt == self.cfg.max_retries:
                    break
                async with self._restart_lock:
                    # restart in a thread: it blocks on /health for up to startup_timeout_s
                    ok = await asyncio.get_running_loop().run_in_executor(None, self.endpoints.recover, server)
                if not ok:
                    raise ServerError(f"SGLang server {url} died and was already restarted once; rerun the command to resume (written shards are kept)") from e
                await asyncio.sleep(delay)
                delay *= 2
        raise ServerError(
            f"SGLang server {self.endpoints.url(server)}: {self.cfg.max_retries + 1} attempts failed "
            f"(last: {type(last).__name__}: {last}); raise sglang.request_timeout_s (or timeout_per_token_s) or sglang.max_retries"
        )


class HTTPTarget(PerSequenceTarget):
    """A ``speculative.Target`` over SGLang's ``/generate`` (see ``contract``), one request per sequence.

    Capabilities: greedy only (the server returns its greedy token and top-k log-probs,
    ``speculate.GREEDY_REASON``), teacher forms ``topk`` and ``token``, features when
    ``feature_dim`` is set. Raises ``ContractError`` for an answer outside the contract,
    ``launcher.ServerError`` when the server cannot be reached.
    """

    def __init__(self, client: HTTPClient, server: int, *, top_k: int, feature_dim: Optional[int],
                 columns: Optional[torch.Tensor] = None):
        """``feature_dim``: width of the server's feature rows; ``columns``: the columns that give the
        drafter's (``contract.feature_columns``, for repeated layer ids), None to keep them all."""
        self.client = client
        self.server = server
        self.top_k = max(1, int(top_k))
        self.feature_dim = feature_dim
        self.columns = columns
        self.caps = verify_caps("SGLang verify mode", self.top_k, feature_dim is not None)

    def _ours(self, rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """float32 [n, server feature dim] -> [n, drafter feature dim] (repeated layers' columns repeated)."""
        return rows if rows is None or self.columns is None else rows[:, self.columns]

    async def prefill_one(self, prompt_ids: list[int]) -> PrefillResult:
        body = prefill_request(prompt_ids, want_hidden=self.feature_dim is not None)
        payload = await self.client.post(self.server, "/generate", body)
        r = parse_generate_response(
            payload, n_input=len(prompt_ids), logprob_start_len=body["logprob_start_len"], top_k=0,
            feature_dim=self.feature_dim, server_version=self.client.endpoints.version,
        )
        if r.hidden_rows is not None and r.cached_tokens:
            raise ContractError("meta_info.cached_tokens", f"{r.cached_tokens} on a prefill with logprob_start_len=0", self.client.endpoints.version)
        return PrefillResult(r.output_id, self._ours(r.hidden_rows))

    async def verify_one(self, seq_ids: list[int], drafts: list[int]) -> VerifyResult:
        a = len(seq_ids) - 1
        body = verify_request(seq_ids, drafts, top_k=self.top_k, want_hidden=self.feature_dim is not None)
        n = len(body["input_ids"])
        payload = await self.client.post(self.server, "/generate", body)
        r = parse_generate_response(
            payload, n_input=n, logprob_start_len=a, top_k=self.top_k,
            feature_dim=self.feature_dim, server_version=self.client.endpoints.version,
        )
        # entry j >= 1 of the logprob lists is position a + j, i.e. drafted slot j
        predicted = torch.cat([r.top_ids[1:, 0], torch.tensor([r.output_id])])
        rows = None
        if r.hidden_rows is not None:
            # rows start at the first uncached position c <= a; keep positions a..n-1
            rows = self._ours(r.hidden_rows[a - r.cached_tokens :])
        return VerifyResult(
            predicted=predicted.long(),
            draft_logprob=r.token_logprobs[1:],
            top_ids=r.top_ids[1:],
            top_logprobs=r.top_logprobs[1:],
            rows=rows,
        )


#: Bytes of JSON per feature float in a verify response (SGLang writes each float's repr; about 12-22 characters).
JSON_BYTES_PER_FLOAT = 20


def check_verify_feature_size(prompts: list[tuple[str, list[int]]], feature_dim: int, cfg: SGLangConfig) -> None:
    """Refuse a verify-mode rollout whose prefill would carry more than ``sglang.verify_max_feature_floats`` floats.

    A prefill returns the hidden states of every prompt position (the drafter's
    context) as JSON lists: prompt length x ``feature_dim`` (captured layers x
    hidden size, the server's width) floats. For Qwen3-8B, 5 layers and a
    2048-token prompt that is 42M floats, about 0.8 GB of JSON per request.

    Raises:
        ValueError: names the longest prompt, the size, the field and native mode as the fix.
    """
    if not prompts or feature_dim <= 0:
        return
    sid, ids = max(prompts, key=lambda p: len(p[1]))
    floats = len(ids) * int(feature_dim)
    if floats > cfg.verify_max_feature_floats:
        raise ValueError(
            f"{sid}: a verify-mode prefill of its {len(ids)} prompt tokens returns {len(ids)} x {feature_dim} = "
            f"{floats / 1e6:.1f}M feature floats as JSON (about {floats * JSON_BYTES_PER_FLOAT / 1e9:.1f} GB), over "
            f"sglang.verify_max_feature_floats={cfg.verify_max_feature_floats}; use rollout.backend sglang_native with "
            "training.feature_source target (the trainer recomputes the features), or raise the bound"
        )


async def verify_rollout_async(
    endpoints: Endpoints,
    drafter: Drafter,
    prompts: list[tuple[str, list[int]]],
    *,
    sglang_cfg: SGLangConfig,
    max_new_tokens: int,
    stop_token_ids: list[int],
    teacher: str,
    teacher_topk: int,
    feature_dim: int,
    drafter_step: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    layer_ids: Optional[list[int]] = None,
) -> list[RolloutRecord]:
    """Roll out ``prompts`` [(sample_id, prompt ids)] concurrently; records in prompt order.

    ``feature_dim`` = len(layer_ids) * hidden, the drafter's feature width; with
    ``layer_ids`` (the drafter's, as passed to ``launcher.server_args``) repeated
    ids are captured once by the server and repeated here.
    """
    columns, server_dim = None, feature_dim
    if layer_ids:
        hidden = feature_dim // len(layer_ids)
        columns = feature_columns(layer_ids, hidden)
        server_dim = len(server_layer_ids(layer_ids)) * hidden
    check_verify_feature_size(prompts, server_dim, sglang_cfg)

    async def one(client, i: int, sid: str, ids: list[int]) -> RolloutRecord:
        target = HTTPTarget(client, i, top_k=teacher_topk, feature_dim=server_dim, columns=columns)
        return await speculate_sequence(
            target, drafter, ids, sample_id=sid, max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids, teacher=teacher, store_features=True, drafter_step=drafter_step,
        )

    return await for_each_prompt(endpoints, sglang_cfg, prompts, one, progress)


class TokenBudget:
    """A weighted semaphore over a server's KV pool: ``acquire(n)`` waits until n tokens are free."""

    def __init__(self, total: int):
        self.total = int(total)
        self.free = int(total)
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.free >= n)
            self.free -= n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.free += n
            self._cond.notify_all()


async def for_each_prompt(endpoints, sglang_cfg: SGLangConfig, prompts: list[tuple[str, list[int]]], fn, progress=None, *,
                          token_cost: Optional[Callable[[list[int]], int]] = None) -> list:
    """``await fn(client, i, sample_id, prompt_ids)`` for every prompt; results in prompt order.

    At most ``sglang.max_in_flight`` calls run at once over one ``HTTPClient``. With
    ``token_cost`` (KV-pool tokens a prompt's request may hold; native mode, whose
    requests decode for minutes), the requests on server ``i % n`` also hold at most
    its pool's tokens together (``endpoints.pool_tokens``) and number at most the
    requests it decodes at once (``endpoints.running_slots``: DFLASH's default is
    48), so none waits in SGLang's queue for a whole generation and times out.
    Shared by verify and native mode.

    Raises:
        ValueError: one request needs more tokens than its server's pool (names the fields).
    """
    sem = asyncio.Semaphore(sglang_cfg.max_in_flight)
    n = len(endpoints.urls)
    pools = list(getattr(endpoints, "pool_tokens", None) or [None] * n)
    budgets = [TokenBudget(p) if (token_cost is not None and p) else None for p in pools]
    slots = list(getattr(endpoints, "running_slots", None) or [None] * n)
    slot_sems = [asyncio.Semaphore(k) if (token_cost is not None and k) else None for k in slots]
    if token_cost is not None and prompts:
        longest = max(token_cost(ids) for _sid, ids in prompts)
        for j in range(n):
            log.info("SGLang server %s: KV pool %s tokens, running slots %s, longest request %d tokens: %d requests at "
                     "once", endpoints.url(j), pools[j], slots[j], longest,
                     request_concurrency(pools[j], longest, slots[j], sglang_cfg.max_in_flight))
        for i, (sid, ids) in enumerate(prompts):
            b = budgets[i % n]
            if b is not None and token_cost(ids) > b.total:
                raise ValueError(
                    f"{sid}: one request needs {token_cost(ids)} KV tokens (prompt {len(ids)} + rollout.max_new_tokens + two "
                    f"blocks) but server {endpoints.url(i)} holds {b.total}; raise sglang.max_total_tokens or lower "
                    "rollout.max_new_tokens"
                )
    async with HTTPClient(endpoints, sglang_cfg) as client:

        async def one(i: int, sid: str, ids: list[int]):
            b = budgets[i % n]
            cost = token_cost(ids) if b is not None else 0
            # the server's slots first (a FIFO semaphore: a request waiting for its server holds no global
            # slot), then a global slot, then KV tokens (so at most max_in_flight requests wait on the budget,
            # whose release wakes every waiter)
            async with slot_sems[i % n] or contextlib.nullcontext(), sem:
                if b is not None:
                    await b.acquire(cost)
                try:
                    out = await fn(client, i, sid, ids)
                finally:
                    if b is not None:
                        await b.release(cost)
            if progress is not None:
                progress(1)
            return out

        return list(await asyncio.gather(*(one(i, sid, ids) for i, (sid, ids) in enumerate(prompts))))


def check_verify_settings(temperature: float, teacher: str, feature_source: str) -> None:
    """Raise ``ValueError`` naming the field for a setting verify mode cannot honour."""
    if temperature != 0.0:
        raise greedy_only_error(temperature, verify_caps("SGLang verify mode", 1, True))
    if teacher == "full" and feature_source != "target":
        raise ValueError(
            "rollout.teacher=full: SGLang's verify response carries log-probs, not the target's final hidden states; "
            "use rollout.teacher=topk or token, or training.feature_source=target (the trainer recomputes it)"
        )


def verify_rollout_to_shards(
    endpoints: Endpoints,
    drafter: Drafter,
    prompts: list[tuple[str, list[int]]],
    *,
    sglang_cfg: SGLangConfig,
    sequences_per_shard: int,
    write_shard: Callable[[list[RolloutRecord]], object],
    done_ids: Iterable[str] = (),
    **kw,
) -> int:
    """Roll out the prompts not in ``done_ids``, ``sequences_per_shard`` at a time, writing each group.

    ``write_shard`` must be atomic (``shards.ShardWriter.write``); a crash keeps every
    shard written before it, and passing the written sample ids as ``done_ids``
    resumes. Returns the number of sequences rolled out.
    """
    done = set(done_ids)
    todo = [(sid, ids) for sid, ids in prompts if sid not in done]
    n = 0
    with progress_bar(len(todo), "rollout (SGLang verify)", "seq") as bar:
        for start in range(0, len(todo), sequences_per_shard):
            group = todo[start : start + sequences_per_shard]
            recs = asyncio.run(verify_rollout_async(endpoints, drafter, group, sglang_cfg=sglang_cfg, progress=bar.update, **kw))
            write_shard(recs)
            n += len(recs)
    return n
