"""A stand-in for an SGLang 0.5.23 server, for tests: the same JSON, answered by an in-process HF target.

SGLang cannot run on a CPU, so the tests start this instead (same command-line
flags; unknown ones are ignored). It binds 127.0.0.1 only. Where our integration
depends on SGLang's behaviour, it behaves as 0.5.23 does (each point is checked
against the released wheel's source by ``tests/test_sglang_contract.py``):

* start-up: ``--enable-return-aux-hidden-states`` is refused unless
  ``--speculative-algorithm`` is EAGLE3, DFLASH or DSPARK, and refused with a
  draft path; the algorithm is then reset to none (a verify server, no drafting);
  aux layer ids at or past the target's layer count are refused;
* ``/server_info``: the pool of ``--max-total-tokens`` (65536 when unset: a GPU's
  sizing), ``--max-running-requests`` (48, DFLASH's default) and the resolved fields
  our client reads (``enable_deterministic_inference``, ``enable_mixed_chunk``, ...);
* ``POST /generate`` in verify form, plain generation and native (DFLASH) form:
  ``standin_model.StandinBackend`` (stop sets, log-prob entry 0, hidden-state
  refusals, seeds, batched native decoding with queueing and 503, early flushes,
  bf16 rounding); a batch of prompts (``input_ids`` as a list of lists) answers a list.

Fault injection for tests: ``--standin-die-after N`` exits the process on the N-th
``/generate`` (with ``--standin-die-once-file F``: only while F does not exist);
``--standin-delay-s S`` sleeps before answering; ``--standin-malform FIELD`` drops
``meta_info.FIELD`` from every answer; ``StandinBackend(retract_after_steps=N)``
retracts each native request once after N verify steps (SGLang re-prefills it,
which emits one token outside any verify step); ``--standin-bf16`` rounds logits
and hidden states to bfloat16.

Run: ``python -m specforge_opd.testing.standin --model-path DIR --port P [SGLang flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from typing import Optional

import torch
from aiohttp import web

from specforge_opd.sglang.contract import server_layer_ids
from specforge_opd.sglang.speculate import Drafter
from specforge_opd.testing.standin_model import DEFAULT_FORCE_STREAM_INTERVAL, StandinBackend, StandinRequestError

#: The app's request counters (``ThreadedStandin.max_in_flight`` reads them).
STATE_KEY = web.AppKey("standin_state", dict)

#: The algorithms 0.5.23 accepts to name the capture convention of aux hidden states.
AUX_CAPTURE_ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")


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
        return web.json_response(backend.server_info())

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
            try:
                if isinstance(ids[0], list):
                    outs = [await loop.run_in_executor(None, answer, dict(body, input_ids=one)) for one in ids]
                    return web.json_response(outs)
                return web.json_response(await loop.run_in_executor(None, answer, body))
            except StandinRequestError as e:
                return web.json_response({"error": {"message": str(e), "code": e.status}}, status=e.status)
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


def check_layer_range(layer_ids: Optional[list[int]], num_layers: int) -> None:
    """0.5.23's start-up check of the aux layer ids against the target (``_check_capture_layer_ids_in_range``).

    Raises:
        ValueError: an id at or past ``num_layers``, with SGLang's message.
    """
    out_of_range = [k for k in (layer_ids or []) if k >= num_layers]
    if out_of_range:
        raise ValueError(f"--return-aux-hidden-state-layer-ids {out_of_range} out of range for a target with {num_layers} layers.")


def backend_from_args(args, native: bool) -> StandinBackend:
    """Load the target (and the drafter in native mode) named by the flags; raises ``ValueError`` as 0.5.23's start-up does."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.float32).eval()
    check_layer_range(args.return_aux_hidden_state_layer_ids, int(target.config.num_hidden_layers))
    drafter = None
    if native:
        from specforge_opd.models.drafter import load_drafter

        model = load_drafter(args.speculative_draft_model_path, target_config=target.config)
        drafter = Drafter(model, target.get_input_embeddings(), target.get_output_embeddings())
    hidden = bool(args.enable_return_hidden_states or args.enable_return_aux_hidden_states or args.return_hidden_states_mode)
    return StandinBackend(target, aux_layer_ids=args.return_aux_hidden_state_layer_ids, drafter=drafter,
                          block_size=args.speculative_num_draft_tokens, pool_tokens=args.max_total_tokens or 65536,
                          running_slots=args.max_running_requests or 48, max_queued_requests=args.max_queued_requests,
                          chunked_prefill_size=args.chunked_prefill_size, return_hidden_states=hidden,
                          deterministic=args.enable_deterministic_inference, bf16=args.standin_bf16,
                          random_seed=args.random_seed if args.random_seed is not None else 0)


def parse_flags(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The SGLang flags the stand-in honours (unknown ones ignored, as a server with more features would take them)."""
    p = argparse.ArgumentParser(description="SGLang stand-in for tests (127.0.0.1 only)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="*", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--enable-return-hidden-states", action="store_true")
    p.add_argument("--return-hidden-states-mode", default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--standin-bf16", action="store_true", help="round logits and hidden states to bfloat16")
    p.add_argument("--standin-die-after", type=int, default=0)
    p.add_argument("--standin-die-once-file", default=None, help="die only while this file does not exist (then create it)")
    p.add_argument("--standin-delay-s", type=float, default=0.0)
    p.add_argument("--standin-malform", default=None)
    return p.parse_known_args(argv)[0]


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_flags(argv)
    if args.host != "127.0.0.1":
        raise SystemExit("the stand-in binds 127.0.0.1 only")
    try:
        native = check_flags(args)
    except ValueError as e:
        print(f"ValueError: {e}", file=sys.stderr, flush=True)
        return 2
    die_after = args.standin_die_after or int(os.environ.get("STANDIN_DIE_AFTER", "0") or 0)
    try:
        backend = backend_from_args(args, native)
    except ValueError as e:
        print(f"ValueError: {e}", file=sys.stderr, flush=True)
        return 2
    app = make_app(backend, native=native, die_after=die_after, die_once_file=args.standin_die_once_file, delay_s=args.standin_delay_s, malform=args.standin_malform)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


__all__ = ["DEFAULT_FORCE_STREAM_INTERVAL", "StandinBackend", "ThreadedStandin", "check_flags", "check_layer_range", "make_app",
           "server_layer_ids", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
