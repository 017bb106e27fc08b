"""A stand-in for an SGLang server, for tests: the same JSON, answered by an in-process HF target.

SGLang cannot run on a CPU, so the tests start this instead (same command-line
flags; unknown ones are ignored). It binds 127.0.0.1 only and answers:

* ``GET /health``, ``GET /get_server_info`` (``version``);
* ``POST /generate`` in verify form (``contract.verify_request``/``prefill_request``):
  top-k input log-probs, ``cached_tokens`` from an emulated radix cache (capped at
  ``logprob_start_len`` as SGLang does), hidden states of the uncached positions at
  the ``--return-aux-hidden-state-layer-ids`` (HF ``hidden_states[i]``, the residual
  stream before layer i);
* ``POST /generate`` in native form when started with ``--speculative-algorithm DFLASH``:
  DFlash decoding in-process, the per-step records made by the plugin's own
  ``native.verify_step_payloads`` from SGLang-shaped tensors.

Fault injection for tests: ``--standin-die-after N`` exits the process on the N-th
``/generate`` (with ``--standin-die-once-file F``: only while F does not exist); ``--standin-delay-s S`` sleeps before answering; ``--standin-malform FIELD``
drops ``meta_info.FIELD`` from every answer.

Run: ``python -m specforge_opd.sglang.standin --model-path DIR --port P [SGLang flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from typing import Optional

import torch
from aiohttp import web

from .contract import server_layer_ids
from .native import customized_info_of, verify_step_payloads
from .speculate import Drafter, LocalTarget, speculate_sequence

STANDIN_VERSION = "0.5.23-standin"


class StandinBackend:
    """The model side of the stand-in: an HF target, optionally a DFlash drafter (native mode)."""

    def __init__(self, target, *, aux_layer_ids: Optional[list[int]] = None, drafter=None, block_size: Optional[int] = None):
        self.target = target.eval()
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.drafter = drafter
        self.block_size = block_size
        self.seen: list[tuple[int, ...]] = []
        #: largest cached_tokens answered (tests check the radix-cache emulation was exercised)
        self.max_cached = 0
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

    @torch.inference_mode()
    def generate_verify(self, body: dict) -> dict:
        ids = [int(t) for t in body["input_ids"]]
        n = len(ids)
        sp = body.get("sampling_params") or {}
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
            feats = torch.cat([out.hidden_states[i][0] for i in self.aux_layer_ids], -1).float()
            meta["hidden_states"] = [feats[cached:].tolist()]
        return {"output_ids": [nxt], "meta_info": meta}

    def generate_native(self, body: dict) -> dict:
        ids = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        bs = self.block_size
        # the reference loop with the target in-process; its records become SGLang-shaped tensors
        target = LocalTarget(self.target, self.drafter.model.target_layer_ids, top_k=1)
        rec = asyncio.run(
            speculate_sequence(
                target, self.drafter, ids, sample_id="native", max_new_tokens=int(sp.get("max_new_tokens", 128)),
                stop_token_ids=[int(t) for t in sp.get("stop_token_ids") or []], teacher="token", store_features=True,
            )
        )
        steps = []
        seq = rec.input_ids.tolist()
        for m in range(rec.num_blocks):
            a = int(rec.anchors[m])
            block = torch.tensor([[seq[a]] + rec.drafts[m].tolist()])
            logits, _ = LocalTarget(self.target, [], 1, want_features=False).forward(seq[:a] + block[0].tolist())
            payload = verify_step_payloads(block.reshape(-1), logits[a:], torch.tensor([a]), bs)[0]
            steps.append(payload)
        info = {k: [s[k] for s in steps] for k in customized_info_of(steps)}
        out_ids = seq[len(ids):]
        meta = {
            "id": "standin-native",
            "prompt_tokens": len(ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "spec_verify_ct": rec.num_blocks,
            "spec_accept_length": (len(out_ids) / rec.num_blocks) if rec.num_blocks else 0.0,
            "customized_info": info,
            "finish_reason": {"type": "stop" if rec.finished else "length"},
        }
        return {"output_ids": out_ids, "meta_info": meta}


def make_app(
    backend: StandinBackend,
    *,
    native: bool = False,
    die_after: int = 0,
    die_once_file: Optional[str] = None,
    delay_s: float = 0.0,
    malform: Optional[str] = None,
) -> web.Application:
    state = {"n": 0}

    async def health(_req):
        return web.Response(text="ok")

    async def info(_req):
        return web.json_response({"version": STANDIN_VERSION, "standin": True})

    async def generate(req):
        state["n"] += 1
        if die_after and state["n"] >= die_after and not (die_once_file and os.path.exists(die_once_file)):
            if die_once_file:
                open(die_once_file, "w").close()
            os._exit(17)  # a crash, as a dying server would: no response, connection reset
        if delay_s:
            await asyncio.sleep(delay_s)
        body = await req.json()
        if not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
            return web.json_response({"error": "input_ids must be a non-empty list"}, status=400)
        loop = asyncio.get_running_loop()
        if native and not body.get("return_logprob"):
            out = await loop.run_in_executor(None, backend.generate_native, body)
        else:
            out = await loop.run_in_executor(None, backend.generate_verify, body)
        if malform:
            out["meta_info"].pop(malform, None)
        return web.json_response(out)

    app = web.Application(client_max_size=256 * 2**20)
    app.router.add_get("/health", health)
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


def backend_from_args(args) -> tuple[StandinBackend, bool]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.float32).eval()
    drafter = None
    native = (args.speculative_algorithm or "").upper() == "DFLASH"
    if native:
        from ..drafter import load_drafter

        model = load_drafter(args.speculative_draft_model_path, target_config=target.config)
        drafter = Drafter(model, target.get_input_embeddings(), target.get_output_embeddings())
    return StandinBackend(target, aux_layer_ids=args.return_aux_hidden_state_layer_ids, drafter=drafter, block_size=args.speculative_num_draft_tokens), native


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="SGLang stand-in for tests (127.0.0.1 only)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
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
    die_after = args.standin_die_after or int(os.environ.get("STANDIN_DIE_AFTER", "0") or 0)
    backend, native = backend_from_args(args)
    app = make_app(backend, native=native, die_after=die_after, die_once_file=args.standin_die_once_file, delay_s=args.standin_delay_s, malform=args.standin_malform)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


__all__ = ["StandinBackend", "ThreadedStandin", "make_app", "server_layer_ids", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
