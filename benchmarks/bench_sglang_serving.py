"""Serving benchmark of a finished drafter with SGLang's own DFLASH decoding (GPU only; NOT YET RUN ON A GPU).

For each dataset and concurrency (1, 8, 32) it measures output throughput (tokens/s) and
SGLang's ``meta_info.spec_accept_length`` (pooled: sum completion tokens / sum
``spec_verify_ct``, DESIGN.md tau) with ``--speculative-algorithm DFLASH``, and the same
throughput without speculation; then compares the served tau with our own offline
evaluation of the drafter on the same prompts (tau parity), when ``--our-tau FILE``
(the JSON ``specforge-opd eval`` writes: {dataset: tau}) is given.

    python benchmarks/bench_sglang_serving.py --target Qwen/Qwen3-8B --drafter runs/x/final \
        --block-size 16 --datasets mtbench humaneval --num-prompts 80 --sglang-python /opt/sglang/bin/python \
        --out bench_sglang.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp


async def _one(session, url, ids, max_new):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
    async with session.post(url + "/generate", json=body) as r:
        r.raise_for_status()
        out = await r.json()
    m = out["meta_info"]
    return int(m["completion_tokens"]), int(m.get("spec_verify_ct", 0) or 0)


async def run_load(url: str, prompts: list[list[int]], concurrency: int, max_new: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:

        async def go(ids):
            async with sem:
                return await _one(s, url, ids, max_new)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(go(p) for p in prompts))
        dt = time.perf_counter() - t0
    toks = sum(c for c, _ in res)
    steps = sum(v for _, v in res)
    return {"concurrency": concurrency, "tokens": toks, "seconds": dt, "tok_per_s": toks / dt, "tau": (toks / steps) if steps else None}


def main(argv=None) -> int:
    from specforge_opd.config import SGLangConfig
    from specforge_opd.sglang.launcher import SGLangServer, server_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "mmath_math500"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--thinking", action="store_true")
    p.add_argument("--sglang-python", default="python")
    p.add_argument("--max-total-tokens", type=int, default=200000)
    p.add_argument("--our-tau", help="JSON {dataset: tau} from specforge-opd eval of the same drafter and prompts")
    p.add_argument("--out", default="bench_sglang.json")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from specforge_opd.data.chat import render_prompt
    from specforge_opd.data.prompts import eval_prompts

    tok = AutoTokenizer.from_pretrained(a.target)
    sets = {}
    for name in a.datasets:
        recs = eval_prompts(name, limit=a.num_prompts)
        sets[name] = [tok(render_prompt(tok, r.messages or [{"role": "user", "content": r.prompt}], thinking=a.thinking), add_special_tokens=False).input_ids for r in recs]
    cfg = SGLangConfig(python=a.sglang_python, max_total_tokens=a.max_total_tokens, startup_timeout_s=1800)
    from specforge_opd.precision import machine_info

    result = {"machine": machine_info(), "target": a.target, "drafter": a.drafter, "block_size": a.block_size, "runs": {}}
    for mode in ("plain", "native"):
        args = lambda port, mode=mode: server_args(cfg, model_path=a.target, port=port, mode=mode, draft_path=a.drafter, block_size=a.block_size)
        if mode == "native":
            # the stock DFLASH path, without our plugin's overlap restriction
            args = lambda port: [x for x in server_args(cfg, model_path=a.target, port=port, mode="native", draft_path=a.drafter, block_size=a.block_size) if x != "--disable-overlap-schedule"]
        with SGLangServer(cfg, args, log_path=Path(a.out).with_suffix(f".{mode}.log")) as srv:
            result["version"] = srv.version
            for name, prompts in sets.items():
                for c in a.concurrency:
                    r = asyncio.run(run_load(srv.url, prompts, c, a.max_new_tokens))
                    result["runs"].setdefault(name, {}).setdefault(mode, []).append(r)
                    print(name, mode, r, flush=True)
    if a.our_tau:
        ours = json.loads(Path(a.our_tau).read_text())
        for name in sets:
            served = result["runs"][name]["native"][0]["tau"]
            result["runs"][name]["tau_parity"] = {"served": served, "ours": ours.get(name)}
    for name in sets:
        base = {r["concurrency"]: r["tok_per_s"] for r in result["runs"][name]["plain"]}
        for r in result["runs"][name]["native"]:
            r["speedup"] = r["tok_per_s"] / base[r["concurrency"]]
    Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
