"""Benchmark: cost of exact offline tau (replay against cached greedy trajectories) versus live
speculative decoding, per evaluated drafter, on the embedded SmolLM2 target (issue 6).

    .venv/bin/python benchmarks/bench_offline_eval.py [--prompts 16] [--max-new-tokens 64]
        [--batch-sizes 1 8] [--drafter DIR ...] [--threads 1] [--cache-dir DIR]

Prints (and writes with --json) per drafter: offline replay seconds, live seconds at each
batch size, their ratio, the one-time cache cost, and the per-prompt tau agreement between
offline and live (a mismatch is reported with the target's top-2 logit gap at the first
differing token: DESIGN.md's numerical-ties allowance). Without --drafter a random drafter
(1 layer, block 16, seed 0) is used: its tau is ~1, which is the worst case for the offline
evaluator's lm_head saving (every block decides at slot 1) but the best for live decoding's
step count, so the ratio is not flattered.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafter", action="append", default=[], help="HF DFlash dir (default: a random drafter)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None, help="trajectory cache to reuse (default: in memory only)")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specforge_opd.config import RolloutConfig, TargetConfig
    from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID
    from specforge_opd.data.chat import render_prompt
    from specforge_opd.data.prompts import eval_prompts
    from specforge_opd.eval.evaluate import TrajectoryCache, offline_tau
    from specforge_opd.models.drafter import build_drafter, derive_draft_config, load_drafter
    from specforge_opd.models.target import load_target
    from specforge_opd.rollout.engine import SpeculativeEngine
    from specforge_opd.rollout.records import tau_of

    bundle = load_target(TargetConfig(device="cpu"))
    model, tok = bundle.model, bundle.tokenizer
    drafters = {}
    for d in args.drafter:
        drafters[d] = load_drafter(d, target_config=model.config).eval()
    if not drafters:
        cfg = derive_draft_config(model.config, num_hidden_layers=1, block_size=16, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
        drafters["random(1 layer, bs16)"] = build_drafter(cfg, seed=0).eval()
    prompts = [tok(render_prompt(tok, r.chat_messages(), thinking=False), add_special_tokens=False)["input_ids"]
               for r in eval_prompts(args.dataset, limit=args.prompts)]
    N = args.max_new_tokens
    layers = sorted({i for d in drafters.values() for i in d.target_layer_ids})
    cache = TrajectoryCache(args.cache_dir, model, bundle.identity, max_new_tokens=N, stop_token_ids=bundle.stop_token_ids)
    t0 = time.perf_counter()
    trajs = cache.get(prompts, layers)
    t_cache = time.perf_counter() - t0
    from specforge_opd.precision import machine_info

    out = {"machine": machine_info(), "dataset": args.dataset, "prompts": len(prompts), "max_new_tokens": N, "threads": torch.get_num_threads(),
           "cache_seconds_once": t_cache, "drafters": {}}
    for name, d in drafters.items():
        t0 = time.perf_counter()
        off = offline_tau(d, model, trajs)
        t_off = time.perf_counter() - t0
        res = {"offline_seconds": t_off, "tau_offline": tau_of(off), "live": {}}
        for B in args.batch_sizes:
            engine = SpeculativeEngine(model, d, RolloutConfig(max_new_tokens=N, teacher="full", store_features=False),
                                       stop_token_ids=bundle.stop_token_ids, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
            t0 = time.perf_counter()
            live = []
            for i in range(0, len(prompts), B):
                live += engine.generate(prompts[i : i + B])
            t_live = time.perf_counter() - t0
            same, ties, other = 0, 0, []
            for lv, of, tr in zip(live, off, trajs):
                if tau_of([lv]) == tau_of([of]) and lv.input_ids.tolist() == of.input_ids.tolist():
                    same += 1
                    continue
                a, b = lv.input_ids.tolist(), of.input_ids.tolist()
                div = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                gap = float(tr.top2_gap[div - 1]) if div - 1 < tr.top2_gap.numel() else float("nan")
                if gap < 1e-4:
                    ties += 1
                else:
                    other.append({"sample": of.sample_id, "first_diff": div, "top2_gap": gap})
            res["live"][f"batch{B}"] = {
                "seconds": t_live, "tau_live": tau_of(live), "cost_ratio": t_live / t_off,
                "per_prompt_tau_equal": same, "diverged_at_tie": ties, "mismatches": other,
            }
        out["drafters"][name] = res
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
