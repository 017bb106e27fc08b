"""The model side of the SGLang 0.5.23 stand-in (``standin``): what each ``/generate`` form answers.

An in-process HF target (and, for native mode, a DFlash drafter) computes the
answers; where our integration depends on SGLang's behaviour it behaves as 0.5.23
does (``tests/test_sglang_contract.py`` checks each point against the wheel):

* stop sets: a request stops at its ``stop_token_ids`` and at the model's eos ids
  (``config.json`` | ``generation_config.json``, ``ModelConfig._get_hf_eos_token_id``)
  unless ``ignore_eos``;
* log-probs: ``input_token_logprobs[0]`` (position ``logprob_start_len``) is None
  whatever the start, and so is ``input_top_logprobs[0]``; ``input_top_logprobs`` is
  left out at ``top_logprobs_num`` 0;
* hidden states: a request asking for them on a server started without
  ``--enable-return-hidden-states`` (or aux capture, which implies it) is answered 400;
  id k of the aux layer ids returns HF ``hidden_states[k + 1]``, ascending, and the
  last layer's id is never captured (0.5.23 captures "before layer k + 1");
* sampling: ``sampling_seed`` is used only with ``--enable-deterministic-inference``;
  DFLASH's sampling verify draws its acceptance coins from the server's own generator;
* native mode: requests are decoded in batches (at most ``running_slots`` at once and
  as many as the KV pool holds at full length; the rest queue, and past
  ``max_queued_requests`` are answered 503), one batched verify step at a time, with
  per-request temperature; the plugin's ``native.step_payloads`` reads the batch's
  tensors as it does in SGLang's worker;
* ``bf16=True`` rounds the logits and hidden states to bfloat16, as a bf16 server's are.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Optional

import torch

from specforge_opd.sglang.contract import SGLANG_CAPTURE_OFFSET
from specforge_opd.sglang.native import is_request_level_key, request_tokens, step_payloads
from specforge_opd.sglang.speculate import LocalTarget, accepted_count

#: The version ``/server_info`` reports (a stand-in for 0.5.23).
STANDIN_VERSION = "0.5.23-standin"

#: SGLang 0.5.23's default of ``SGLANG_FORCE_STREAM_INTERVAL``.
DEFAULT_FORCE_STREAM_INTERVAL = 50

#: 0.5.23's message for hidden states asked of a server not started to return them.
NO_HIDDEN_STATES = ("The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
                    "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag.")


class StandinRequestError(ValueError):
    """A request the stand-in answers with an HTTP error, as 0.5.23 would (``status``: 400, 503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)


def model_eos_ids(model) -> set[int]:
    """eos ids of ``model.config`` | ``model.generation_config``: what 0.5.23 stops on besides the request's ids."""
    out: set[int] = set()
    for src in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, (list, tuple)):
            out.update(int(i) for i in v)
    return out


def _stops(sp: dict, eos: set[int]) -> set[int]:
    ids = set(int(t) for t in sp.get("stop_token_ids") or [])
    return ids if sp.get("ignore_eos") else ids | eos


def _sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen)[0])


class _NativeRequest:
    """One native request's state as the scheduler keeps it: output, per-step values, flushes."""

    def __init__(self, backend: "StandinBackend", body: dict):
        sp = body.get("sampling_params") or {}
        self.backend = backend
        self.prompt = [int(t) for t in body["input_ids"]]
        self.max_new = int(sp.get("max_new_tokens", 128))
        self.temperature = float(sp.get("temperature", 1.0))
        self.stops = _stops(sp, backend.eos_token_ids)
        self.cost = request_tokens(len(self.prompt), self.max_new, int(backend.block_size))
        self.out: list[int] = []  # req.output_ids (a verify step may overshoot the finish)
        self.finished_len: Optional[int] = None
        self.sent = 0
        self.retractions = 0
        self.steps = 0
        self.values: Optional[dict] = None  # req.customized_info: key -> one value per verify step
        self.meta_acc: dict = {}  # the tokenizer manager's accumulation, key -> list
        self.sent_ids: list[int] = []
        self.done = threading.Event()
        self.result: Optional[dict] = None
        self.error: Optional[BaseException] = None

    @property
    def finished(self) -> bool:
        return self.finished_len is not None

    def seq(self) -> list[int]:
        return self.prompt + self.out

    def append(self, new: list[int]) -> None:
        start = len(self.out)
        self.out.extend(new)
        for j in range(start, len(self.out)):
            if self.out[j] in self.stops or j + 1 >= self.max_new:
                self.finished_len = j + 1
                break
        if not self.finished and len(self.out) % self.backend.force_stream_interval == 0:
            self.backend.early_flushes += 1
            self.flush(False)

    def through_stop(self) -> list[int]:
        return self.out if self.finished_len is None else self.out[: self.finished_len]

    def flush(self, final: bool) -> None:
        ots = self.through_stop()
        off = self.sent
        if self.values is not None:
            for key, vals in self.values.items():
                if self.backend.request_level(key):
                    if not final:
                        continue
                    chunk = vals
                else:
                    chunk = vals[off : len(ots)]
                self.meta_acc.setdefault(key, []).extend(chunk)
        self.sent_ids.extend(ots[off:])
        self.sent = len(ots)

    def record(self, payload: dict) -> None:
        if self.values is None:
            self.values = {k: [] for k in payload}
        for k, v in payload.items():
            self.values[k].append(v)
        self.steps += 1

    def answer(self) -> dict:
        self.flush(True)
        ots = self.through_stop()
        last = ots[-1] if ots else None
        meta = {
            "id": "standin-native",
            "finish_reason": {"type": "stop", "matched": last} if last in self.stops else {"type": "length", "length": self.max_new},
            "prompt_tokens": len(self.prompt),
            "num_retractions": self.retractions,
            "completion_tokens": len(ots),
            "cached_tokens": 0,
        }
        if self.steps > 0:
            meta["spec_accept_length"] = len(ots) / self.steps
            meta["spec_verify_ct"] = self.steps
        meta.update(self.meta_acc)
        return {"output_ids": self.sent_ids, "meta_info": meta}


class StandinBackend:
    """The model side of the stand-in: an HF target, optionally a DFlash drafter (native mode).

    Args:
        aux_layer_ids: the values of ``--return-aux-hidden-state-layer-ids`` (SGLang's
            ids: k returns HF ``hidden_states[k + 1]``).
        force_stream_interval: early-flush interval of non-streaming native responses
            (None: ``SGLANG_FORCE_STREAM_INTERVAL`` from the environment, else 50).
        request_level: which ``customized_info`` keys the server treats as request-level
            (what the plugin's hook makes SGLang answer; pass ``lambda k: False`` to
            emulate a server where that hook did not apply).
        retract_after_steps: retract each native request once after this many verify steps.
        pool_tokens: the KV pool (``--max-total-tokens``) ``/server_info`` reports and native decoding honours.
        running_slots: requests decoded at once (``--max-running-requests``; 0.5.23's DFLASH default is 48).
        max_queued_requests: native requests waiting past these are answered 503 (None: no limit).
        chunked_prefill_size: ``--chunked-prefill-size``: an extend longer than this runs in
            chunks, and 0.5.23 returns the hidden states of the last chunk only (None: no chunking).
        eos_token_ids: the model's eos ids (None: ``model_eos_ids(target)``).
        return_hidden_states: whether requests may ask for hidden states (None: when aux
            layer ids are set, as aux capture implies it in 0.5.23).
        deterministic: ``--enable-deterministic-inference`` (``sampling_seed`` is used).
        bf16: round logits and hidden states to bfloat16, as a bf16 server returns them.
        random_seed: seed of the server's own generator (DFLASH acceptance coins, unseeded sampling).
    """

    def __init__(self, target, *, aux_layer_ids: Optional[list[int]] = None, drafter=None, block_size: Optional[int] = None,
                 force_stream_interval: Optional[int] = None, request_level: Callable[[str], bool] = is_request_level_key,
                 retract_after_steps: Optional[int] = None, pool_tokens: int = 65536, running_slots: int = 48,
                 max_queued_requests: Optional[int] = None, chunked_prefill_size: Optional[int] = None,
                 eos_token_ids: Optional[set[int]] = None, return_hidden_states: Optional[bool] = None,
                 deterministic: bool = False, bf16: bool = False, random_seed: int = 0):
        self.chunked_prefill_size = chunked_prefill_size
        self.pool_tokens = int(pool_tokens)
        self.running_slots = int(running_slots)
        self.max_queued_requests = max_queued_requests
        self.target = target.eval()
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.num_layers = int(getattr(getattr(target.config, "text_config", target.config), "num_hidden_layers"))
        self.drafter = drafter
        self.block_size = block_size
        if force_stream_interval is None:
            force_stream_interval = int(os.environ.get("SGLANG_FORCE_STREAM_INTERVAL", DEFAULT_FORCE_STREAM_INTERVAL))
        self.force_stream_interval = int(force_stream_interval)
        self.request_level = request_level
        self.retract_after_steps = retract_after_steps
        self.eos_token_ids = set(model_eos_ids(target) if eos_token_ids is None else eos_token_ids)
        self.return_hidden_states = bool(self.aux_layer_ids) if return_hidden_states is None else bool(return_hidden_states)
        self.deterministic = bool(deterministic)
        self.bf16 = bool(bf16)
        self.generator = torch.Generator().manual_seed(int(random_seed))
        self.seen: list[tuple[int, ...]] = []
        #: largest cached_tokens answered (tests check the radix-cache emulation was exercised)
        self.max_cached = 0
        #: early flushes of native responses (tests check the flush emulation was exercised)
        self.early_flushes = 0
        #: sizes of the native verify batches run (tests check batching was exercised)
        self.batch_sizes: list[int] = []
        self.lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: list[_NativeRequest] = []
        self._running: list[_NativeRequest] = []
        self._scheduler: Optional[threading.Thread] = None
        layer_ids = list(getattr(getattr(drafter, "model", None), "target_layer_ids", None) or [])
        self._features = LocalTarget(self.target, layer_ids, top_k=1, want_features=bool(layer_ids)) if drafter is not None else None

    # -- helpers --------------------------------------------------------------

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float() if self.bf16 else x.float()

    def _logits(self, ids: list[int]) -> torch.Tensor:
        return self._round(self.target(torch.tensor([ids])).logits[0])

    def _sampling_generator(self, sp: dict) -> torch.Generator:
        seed = sp.get("sampling_seed")
        if self.deterministic:
            return torch.Generator().manual_seed(42 if seed is None else int(seed))
        return self.generator

    def server_info(self) -> dict:
        """``/server_info`` as 0.5.23 answers it: version, pool, running limit, and the resolved fields we read."""
        return {"version": STANDIN_VERSION, "standin": True, "max_total_num_tokens": self.pool_tokens,
                "max_running_requests": self.running_slots, "max_queued_requests": self.max_queued_requests,
                "internal_states": [{"effective_max_running_requests_per_dp": self.running_slots}],
                "enable_deterministic_inference": self.deterministic, "enable_mixed_chunk": False,
                "attn_dp_size": 1, "enable_dp_attention": False, "tp_size": 1}

    def cached_prefix(self, ids: list[int], cap: int) -> int:
        best = 0
        t = tuple(ids)
        for s in self.seen:
            n = 0
            for x, y in zip(s, t):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        self.seen.append(t)
        self.seen = self.seen[-512:]
        cached = max(0, min(best, cap))
        self.max_cached = max(self.max_cached, cached)
        return cached

    # -- verify form and plain generation ------------------------------------

    @torch.inference_mode()
    def generate_verify(self, body: dict) -> dict:
        """A verify-form request (one new token, input log-probs, hidden states); longer ones: ``generate_plain``.

        Raises:
            StandinRequestError: 400 for hidden states the server was not started to return.
        """
        if body.get("return_hidden_states") and not self.return_hidden_states:
            raise StandinRequestError(400, NO_HIDDEN_STATES)
        ids = [int(t) for t in body["input_ids"]]
        n = len(ids)
        sp = body.get("sampling_params") or {}
        if int(sp.get("max_new_tokens", 128)) > 1:
            return self.generate_plain(body)
        want_lp = bool(body.get("return_logprob"))
        start = int(body.get("logprob_start_len", -1)) if want_lp else -1
        if want_lp and start < 0:
            start = n - 1
        top_k = int(body.get("top_logprobs_num", 0) or 0)
        cap = n - 1 if not want_lp else min(n - 1, start)
        with self.lock:
            cached = self.cached_prefix(ids, cap)
        out = self.target(torch.tensor([ids]), output_hidden_states=True)
        logits = self._round(out.logits[0])
        lp = torch.log_softmax(logits, -1)
        nxt = int(logits[-1].argmax())
        meta = {
            "id": "standin",
            "prompt_tokens": n,
            "completion_tokens": 1,
            "cached_tokens": cached,
            "num_retractions": 0,
            "finish_reason": {"type": "length", "length": int(sp.get("max_new_tokens", 1))},
        }
        if want_lp:
            # entry 0 (position start) is None whatever the start: 0.5.23 prepends None and drops the last
            itl, itp = [[None, ids[start], None]], [None]
            for pos in range(start + 1, n):
                row = lp[pos - 1]
                itl.append([float(row[ids[pos]]), ids[pos], None])
                if top_k:
                    v, i = row.topk(top_k)
                    itp.append([[float(a), int(b), None] for a, b in zip(v, i)])
            meta["input_token_logprobs"] = itl
            if top_k:
                meta["input_top_logprobs"] = itp
            meta["output_token_logprobs"] = [[float(lp[-1, nxt]), nxt, None]]
        if body.get("return_hidden_states") and self.aux_layer_ids:
            # captured "before layer k + 1" inside the layer loop: ascending, and never for the last layer
            ks = [k for k in sorted(self.aux_layer_ids) if k + SGLANG_CAPTURE_OFFSET < self.num_layers]
            feats = self._round(torch.cat([out.hidden_states[k + SGLANG_CAPTURE_OFFSET][0] for k in ks], -1))
            first = cached
            c = self.chunked_prefill_size
            if c is not None and c > 0 and n - cached > c:
                # earlier chunks' hidden states are not stored (inflight_middle_chunks > 0): the last chunk's only
                first = n - ((n - cached - 1) % c + 1)
            meta["hidden_states"] = [feats[first:].tolist()]
        return {"output_ids": [nxt], "meta_info": meta}

    @torch.inference_mode()
    def generate_plain(self, body: dict) -> dict:
        """Decoding of ``max_new_tokens`` tokens (stops included), as a server without a draft does.

        Temperature 0: greedy; above: sampled at that temperature, from a generator seeded by
        ``sampling_seed`` only on a deterministic server (else the server's own).
        """
        ids = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        stops = _stops(sp, self.eos_token_ids)
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        gen = self._sampling_generator(sp)
        out: list[int] = []
        reason = "length"
        while len(out) < max_new:
            logits = self._logits(ids + out)[-1]
            if temperature > 0:
                with self.lock:
                    tok = _sample(torch.softmax(logits / temperature, -1), gen)
            else:
                tok = int(logits.argmax())
            out.append(tok)
            if tok in stops:
                reason = "stop"
                break
        meta = {"id": "standin-plain", "prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0,
                "num_retractions": 0, "finish_reason": {"type": reason}}
        return {"output_ids": out, "meta_info": meta}

    # -- native form: a batching scheduler -----------------------------------

    def generate_native(self, body: dict) -> dict:
        """DFLASH decoding of one request, batched with the others in flight (blocks until it finishes).

        Raises:
            StandinRequestError: 503 when ``max_queued_requests`` requests already wait.
        """
        req = _NativeRequest(self, body)
        with self._cond:
            if self.max_queued_requests is not None and len(self._waiting) + 1 > self.max_queued_requests:
                raise StandinRequestError(503, "The request queue is full.")
            self._waiting.append(req)
            if self._scheduler is None or not self._scheduler.is_alive():
                self._scheduler = threading.Thread(target=self._loop, daemon=True)
                self._scheduler.start()
            self._cond.notify_all()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    def _admit(self) -> list[_NativeRequest]:
        """Waiting requests that fit the running slots and the KV pool now, in arrival order."""
        new = []
        with self._cond:
            used = sum(r.cost for r in self._running)
            while self._waiting and len(self._running) < self.running_slots:
                r = self._waiting[0]
                if self._running and used + r.cost > self.pool_tokens:
                    break
                self._waiting.pop(0)
                self._running.append(r)
                used += r.cost
                new.append(r)
        return new

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running:
                    self._cond.wait(timeout=5.0)
                    if not self._waiting and not self._running:
                        self._scheduler = None
                        return
            try:
                with torch.inference_mode():
                    for r in self._admit():
                        r.append([int(self._logits(r.prompt)[-1].argmax())])  # the prefill's token
                    self._step([r for r in self._running if not r.finished])
            except BaseException as e:  # a stand-in bug: fail the requests, not the test run
                with self._cond:
                    for r in self._running:
                        r.error = e
                        r.done.set()
                    self._running = []
                continue
            with self._cond:
                for r in [r for r in self._running if r.finished]:
                    r.result = r.answer()
                    self._running.remove(r)
                    r.done.set()

    def _step(self, reqs: list[_NativeRequest]) -> None:
        """One batched DFLASH verify step over ``reqs`` (retractions re-prefill instead)."""
        bs = int(self.block_size)
        batch = []
        for r in reqs:
            if self.retract_after_steps is not None and r.steps == self.retract_after_steps and not r.retractions:
                # retraction: the request is re-prefilled, which emits one token outside any verify step
                r.retractions += 1
                r.append([int(self._logits(r.seq())[-1].argmax())])
            else:
                batch.append(r)
        if not batch:
            return
        blocks, anchors, rows = [], [], []
        for r in batch:
            seq = r.seq()
            a = len(seq) - 1
            _, feats = self._features.forward(seq)
            if feats is None:  # a test drafter that reads no features
                feats = torch.zeros(len(seq), 0)
            drafts = self.drafter.draft(feats[:a], seq[a], a, prefix=list(seq))
            blocks.append([seq[a]] + drafts)
            anchors.append(a)
            rows.append(self._logits(seq + drafts)[a : a + bs])
        logits = torch.cat(rows)  # [B * bs, V]: the verify batch's logits, request-major
        commits, bonus = [], []
        for i, r in enumerate(batch):
            lg, drafts = rows[i], blocks[i][1:]
            if r.temperature > 0:
                # SGLang's target-only chain sampling: accept d_k with probability p_k(d_k), coins from the server's generator
                probs = torch.softmax(lg / r.temperature, -1)
                coins = torch.rand(bs, generator=self.generator)
                acc = 0
                while acc < bs - 1 and float(coins[acc]) <= float(probs[acc, drafts[acc]]):
                    acc += 1
                nxt = _sample(probs[acc], self.generator)
            else:
                acc = accepted_count(drafts, lg.argmax(-1))
                nxt = int(lg[acc].argmax())
            commits.append(acc + 1)
            bonus.append(nxt)
        payloads = step_payloads(torch.tensor(blocks), torch.tensor(commits), torch.tensor(anchors), logits, block_size=bs)
        self.batch_sizes.append(len(batch))
        for i, r in enumerate(batch):
            r.record(payloads[i])
            r.append(blocks[i][1 : commits[i]] + [bonus[i]])
