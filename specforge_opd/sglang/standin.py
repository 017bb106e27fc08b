"""A stand-in for an SGLang 0.5.23 server, for tests: the same JSON, answered by an in-process HF target.

SGLang cannot run on a CPU, so the tests start this instead (same command-line
flags; unknown ones are ignored). It binds 127.0.0.1 only. Where our integration
depends on SGLang's behaviour, it behaves as 0.5.23 does (each point is checked
against the released wheel's source by ``tests/test_sglang_contract.py``):

* start-up: ``--enable-return-aux-hidden-states`` is refused unless
  ``--speculative-algorithm`` is EAGLE3, DFLASH or DSPARK, and refused with a
  draft path; the algorithm is then reset to none (a verify server, no drafting);
* aux hidden states: id k of ``--return-aux-hidden-state-layer-ids`` returns HF
  ``hidden_states[k + 1]``: the server applies the +1 itself
  (``contract.SGLANG_CAPTURE_OFFSET``), so a client that shifts too shows it; the
  layers come back concatenated in ascending order, whatever order the ids were given in;
* ``POST /generate`` in verify form (``contract.verify_request``/``prefill_request``):
  top-k input log-probs, ``cached_tokens`` from an emulated radix cache (capped at
  ``logprob_start_len`` as SGLang does);
* plain generation (``max_new_tokens`` > 1 on a server without a draft): greedy
  decoding; a batch of prompts (``input_ids`` as a list of lists) answers a list;
* native form, when started with ``--speculative-algorithm DFLASH`` and a draft
  path: DFLASH decoding in-process (greedy), each verify step's values made by
  the plugin's own ``native.step_payloads`` from SGLang-shaped tensors and
  accumulated per request as the scheduler does; the response is flushed early
  whenever ``len(output_ids) % SGLANG_FORCE_STREAM_INTERVAL == 0`` (default 50),
  each flush carrying the values ``[send_offset:len(output_ids)]`` of keys that
  are not request-level (request-level keys, as the plugin marks ours, arrive
  whole at the finish); the tokenizer side puts every key at the top level of
  ``meta_info``, accumulated over flushes; ``spec_verify_ct`` (and
  ``spec_accept_length``) are omitted when a request had no verify step.

Fault injection for tests: ``--standin-die-after N`` exits the process on the N-th
``/generate`` (with ``--standin-die-once-file F``: only while F does not exist);
``--standin-delay-s S`` sleeps before answering; ``--standin-malform FIELD`` drops
``meta_info.FIELD`` from every answer; ``StandinBackend(retract_after_steps=N)``
retracts each native request once after N verify steps (SGLang re-prefills it,
which emits one token outside any verify step).

Run: ``python -m specforge_opd.sglang.standin --model-path DIR --port P [SGLang flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from typing import Callable, Optional

import torch
from aiohttp import web

from specforge_opd.sglang.contract import SGLANG_CAPTURE_OFFSET, server_layer_ids
from specforge_opd.sglang.native import is_request_level_key, step_payloads
from specforge_opd.sglang.speculate import Drafter, LocalTarget, accepted_count

STANDIN_VERSION = "0.5.23-standin"

#: The app's request counters (``ThreadedStandin.max_in_flight`` reads them).
STATE_KEY = web.AppKey("standin_state", dict)

#: SGLang 0.5.23's default of ``SGLANG_FORCE_STREAM_INTERVAL``.
DEFAULT_FORCE_STREAM_INTERVAL = 50

#: The algorithms 0.5.23 accepts to name the capture convention of aux hidden states.
AUX_CAPTURE_ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")


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
        pool_tokens: the KV pool ``/server_info`` reports (``max_total_num_tokens``).
        running_slots: the requests ``/server_info`` says the server decodes at once
            (``max_running_requests`` and ``internal_states[0].effective_max_running_requests_per_dp``;
            0.5.23's DFLASH default is 48).
        chunked_prefill_size: ``--chunked-prefill-size``: an extend longer than this runs in
            chunks, and 0.5.23 returns the hidden states of the last chunk only (None: no chunking).
    """

    def __init__(self, target, *, aux_layer_ids: Optional[list[int]] = None, drafter=None, block_size: Optional[int] = None,
                 force_stream_interval: Optional[int] = None, request_level: Callable[[str], bool] = is_request_level_key,
                 retract_after_steps: Optional[int] = None, pool_tokens: int = 65536, running_slots: int = 48,
                 chunked_prefill_size: Optional[int] = None):
        self.chunked_prefill_size = chunked_prefill_size
        self.pool_tokens = int(pool_tokens)
        self.running_slots = int(running_slots)
        self.target = target.eval()
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.drafter = drafter
        self.block_size = block_size
        if force_stream_interval is None:
            force_stream_interval = int(os.environ.get("SGLANG_FORCE_STREAM_INTERVAL", DEFAULT_FORCE_STREAM_INTERVAL))
        self.force_stream_interval = int(force_stream_interval)
        self.request_level = request_level
        self.retract_after_steps = retract_after_steps
        self.seen: list[tuple[int, ...]] = []
        #: largest cached_tokens answered (tests check the radix-cache emulation was exercised)
        self.max_cached = 0
        #: early flushes of native responses (tests check the flush emulation was exercised)
        self.early_flushes = 0
        self.lock = threading.Lock()

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

    def _logits(self, ids: list[int]) -> torch.Tensor:
        return self.target(torch.tensor([ids])).logits[0].float()

    @torch.inference_mode()
    def generate_verify(self, body: dict) -> dict:
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
        x = torch.tensor([ids])
        out = self.target(x, output_hidden_states=True)
        logits = out.logits[0].float()
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
            itl, itp = [], []
            for pos in range(start, n):
                if pos == 0:
                    itl.append([None, ids[0], None])
                    itp.append(None)
                    continue
                row = lp[pos - 1]
                itl.append([float(row[ids[pos]]), ids[pos], None])
                if top_k:
                    v, i = row.topk(top_k)
                    itp.append([[float(a), int(b), None] for a, b in zip(v, i)])
                else:
                    itp.append([])
            meta["input_token_logprobs"] = itl
            meta["input_top_logprobs"] = itp
            meta["output_token_logprobs"] = [[float(lp[-1, nxt]), nxt, None]]
        if body.get("return_hidden_states") and self.aux_layer_ids:
            # SGLang's models capture "before layer k + 1" for id k: HF index k + 1
            # captured inside the layer loop: concatenated in ascending layer order, whatever the ids' order
            feats = torch.cat([out.hidden_states[k + SGLANG_CAPTURE_OFFSET][0] for k in sorted(self.aux_layer_ids)], -1).float()
            first = cached
            c = self.chunked_prefill_size
            if c is not None and c > 0 and n - cached > c:
                # earlier chunks' hidden states are not stored (inflight_middle_chunks > 0): the last chunk's only
                first = n - ((n - cached - 1) % c + 1)
            meta["hidden_states"] = [feats[first:].tolist()]
        return {"output_ids": [nxt], "meta_info": meta}

    @torch.inference_mode()
    def generate_plain(self, body: dict) -> dict:
        """Greedy decoding of ``max_new_tokens`` tokens (stops included), as a server without a draft does."""
        ids = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        stops = set(int(t) for t in sp.get("stop_token_ids") or [])
        max_new = int(sp.get("max_new_tokens", 128))
        out: list[int] = []
        reason = "length"
        while len(out) < max_new:
            tok = int(self._logits(ids + out)[-1].argmax())
            out.append(tok)
            if tok in stops:
                reason = "stop"
                break
        meta = {"id": "standin-plain", "prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0,
                "num_retractions": 0, "finish_reason": {"type": reason}}
        return {"output_ids": out, "meta_info": meta}

    @torch.inference_mode()
    def generate_native(self, body: dict) -> dict:
        """DFLASH decoding of one request as the 0.5.23 server emits it (see the module docstring)."""
        prompt = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        stops = set(int(t) for t in sp.get("stop_token_ids") or [])
        bs = int(self.block_size)
        layer_ids = list(getattr(getattr(self.drafter, "model", None), "target_layer_ids", None) or [])
        features = LocalTarget(self.target, layer_ids, top_k=1, want_features=bool(layer_ids))
        out: list[int] = []  # req.output_ids (a verify step may overshoot the finish)
        state = {"finished_len": None, "sent": 0, "retractions": 0}
        values: Optional[dict] = None  # req.customized_info: key -> one value per verify step
        meta_acc: dict = {}  # the tokenizer manager's accumulation, key -> list
        sent_ids: list[int] = []

        def append(new: list[int]) -> bool:
            start = len(out)
            out.extend(new)
            for j in range(start, len(out)):
                if out[j] in stops or j + 1 >= max_new:
                    state["finished_len"] = j + 1
                    return True
            return False

        def through_stop() -> list[int]:
            return out if state["finished_len"] is None else out[: state["finished_len"]]

        def flush(final: bool) -> None:
            ots = through_stop()
            off = state["sent"]
            if values is not None:
                for key, vals in values.items():
                    if self.request_level(key):
                        if not final:
                            continue
                        chunk = vals
                    else:
                        chunk = vals[off : len(ots)]
                    meta_acc.setdefault(key, []).extend(chunk)
            sent_ids.extend(ots[off:])
            state["sent"] = len(ots)

        def after_step(finished: bool) -> None:
            if not finished and len(out) % self.force_stream_interval == 0:
                self.early_flushes += 1
                flush(False)

        finished = append([int(self._logits(prompt)[-1].argmax())])  # the prefill's token
        after_step(finished)
        steps = 0
        while not finished:
            seq = prompt + out
            if self.retract_after_steps is not None and steps == self.retract_after_steps and not state["retractions"]:
                # retraction: the request is re-prefilled, which emits one token outside any verify step
                state["retractions"] += 1
                finished = append([int(self._logits(seq)[-1].argmax())])
                after_step(finished)
                continue
            a = len(seq) - 1
            _, feats = features.forward(seq)
            if feats is None:  # a test drafter that reads no features
                feats = torch.zeros(len(seq), 0)
            drafts = self.drafter.draft(feats[:a], seq[a], a, prefix=list(seq))
            logits = self._logits(seq + drafts)[a : a + bs]
            r = accepted_count(drafts, logits.argmax(-1))
            payload = step_payloads(
                torch.tensor([[seq[a]] + drafts]), torch.tensor([r + 1]), torch.tensor([a]), logits, block_size=bs,
            )[0]
            if values is None:
                values = {k: [] for k in payload}
            for k, v in payload.items():
                values[k].append(v)
            steps += 1
            finished = append(drafts[:r] + [int(logits[r].argmax())])
            after_step(finished)
        flush(True)
        ots = through_stop()
        last = ots[-1] if ots else None
        meta = {
            "id": "standin-native",
            "finish_reason": {"type": "stop", "matched": last} if last in stops else {"type": "length", "length": max_new},
            "prompt_tokens": len(prompt),
            "num_retractions": state["retractions"],
            "completion_tokens": len(ots),
            "cached_tokens": 0,
        }
        if steps > 0:
            meta["spec_accept_length"] = len(ots) / steps
            meta["spec_verify_ct"] = steps
        meta.update(meta_acc)
        return {"output_ids": sent_ids, "meta_info": meta}


def check_flags(args) -> bool:
    """SGLang 0.5.23's start-up checks of the flags the stand-in honours; returns whether it runs DFLASH natively.

    Raises:
        ValueError: the messages 0.5.23's ``handle_aux_hidden_state_capture`` raises.
    """
    algo = (args.speculative_algorithm or "").upper()
    if not args.enable_return_aux_hidden_states:
        if args.return_aux_hidden_state_layer_ids is not None:
            raise ValueError("--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states.")
        if algo == "DFLASH" and args.speculative_draft_model_path is None:
            raise ValueError("DFLASH speculative decoding requires setting --speculative-draft-model-path.")
        return algo == "DFLASH"
    if algo not in AUX_CAPTURE_ALGORITHMS:
        raise ValueError(
            "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, DFLASH or DSPARK to name the "
            f"capture convention, got {args.speculative_algorithm!r}."
        )
    if args.speculative_draft_model_path is not None:
        raise ValueError("--enable-return-aux-hidden-states captures without a draft; drop --speculative-draft-model-path.")
    ids = args.return_aux_hidden_state_layer_ids
    if algo != "EAGLE3" and not ids:
        raise ValueError(f"--enable-return-aux-hidden-states with {algo} requires --return-aux-hidden-state-layer-ids.")
    if ids is not None:
        if len(ids) == 0:
            raise ValueError("--return-aux-hidden-state-layer-ids must not be empty.")
        if any(i < 0 for i in ids):
            raise ValueError(f"--return-aux-hidden-state-layer-ids must be non-negative, got {list(ids)}.")
        if len(set(ids)) != len(ids):
            raise ValueError(f"--return-aux-hidden-state-layer-ids must not repeat a layer, got {list(ids)}.")
    return False  # the algorithm only named the capture convention: reset to none


def make_app(
    backend: StandinBackend,
    *,
    native: bool = False,
    die_after: int = 0,
    die_once_file: Optional[str] = None,
    delay_s: float = 0.0,
    malform: Optional[str] = None,
) -> web.Application:
    state = {"n": 0, "in_flight": 0, "max_in_flight": 0}

    async def health(_req):
        return web.Response(text="ok")

    async def info(_req):
        return web.json_response({"version": STANDIN_VERSION, "standin": True,
                                  "max_total_num_tokens": backend.pool_tokens,
                                  "max_running_requests": backend.running_slots,
                                  "internal_states": [{"effective_max_running_requests_per_dp": backend.running_slots}]})

    def answer(body: dict) -> dict:
        out = backend.generate_native(body) if native else backend.generate_verify(body)
        if malform:
            out["meta_info"].pop(malform, None)
        return out

    async def generate(req):
        state["n"] += 1
        if die_after and state["n"] >= die_after and not (die_once_file and os.path.exists(die_once_file)):
            if die_once_file:
                open(die_once_file, "w").close()
            os._exit(17)  # a crash, as a dying server would: no response, connection reset
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            body = await req.json()
            ids = body.get("input_ids")
            if not isinstance(ids, list) or not ids:
                return web.json_response({"error": "input_ids must be a non-empty list"}, status=400)
            loop = asyncio.get_running_loop()
            if isinstance(ids[0], list):
                outs = [await loop.run_in_executor(None, answer, dict(body, input_ids=one)) for one in ids]
                return web.json_response(outs)
            return web.json_response(await loop.run_in_executor(None, answer, body))
        finally:
            state["in_flight"] -= 1

    app = web.Application(client_max_size=256 * 2**20)
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", info)
    app.router.add_get("/get_server_info", info)
    app.router.add_post("/generate", generate)
    return app


class ThreadedStandin:
    """Run the stand-in in a background thread of this process (fast tests). ``url`` once started."""

    def __init__(self, app: web.Application):
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.url: Optional[str] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def max_in_flight(self) -> int:
        """Most ``/generate`` requests the server held at once."""
        return int(self.app[STATE_KEY]["max_in_flight"])

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self.loop.run_forever()

    def __enter__(self) -> "ThreadedStandin":
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc):
        async def _stop():
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def backend_from_args(args, native: bool) -> StandinBackend:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.float32).eval()
    drafter = None
    if native:
        from specforge_opd.models.drafter import load_drafter

        model = load_drafter(args.speculative_draft_model_path, target_config=target.config)
        drafter = Drafter(model, target.get_input_embeddings(), target.get_output_embeddings())
    return StandinBackend(target, aux_layer_ids=args.return_aux_hidden_state_layer_ids, drafter=drafter,
                          block_size=args.speculative_num_draft_tokens)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="SGLang stand-in for tests (127.0.0.1 only)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="*", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--standin-die-after", type=int, default=0)
    p.add_argument("--standin-die-once-file", default=None, help="die only while this file does not exist (then create it)")
    p.add_argument("--standin-delay-s", type=float, default=0.0)
    p.add_argument("--standin-malform", default=None)
    args, _unknown = p.parse_known_args(argv)
    if args.host != "127.0.0.1":
        raise SystemExit("the stand-in binds 127.0.0.1 only")
    try:
        native = check_flags(args)
    except ValueError as e:
        print(f"ValueError: {e}", file=sys.stderr, flush=True)
        return 2
    die_after = args.standin_die_after or int(os.environ.get("STANDIN_DIE_AFTER", "0") or 0)
    backend = backend_from_args(args, native)
    app = make_app(backend, native=native, die_after=die_after, die_once_file=args.standin_die_once_file, delay_s=args.standin_delay_s, malform=args.standin_malform)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


__all__ = ["StandinBackend", "ThreadedStandin", "check_flags", "make_app", "server_layer_ids", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
