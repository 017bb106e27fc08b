"""OPD rollout throughput against batch size: fixed length-bucketed batches (before) and one continuous batch (after).

On the embedded SmolLM2 target with a published drafter (``--drafter``, default the 1-layer ``-b8``), the OPD prompt
pool of ``--config`` (its rollout settings: max_new_tokens, teacher form, stored features,
stop tokens), measured side by side in one run for each batch size:

- ``before``: the prompts cut into length-bucketed batches of B (``length_batches``), each
  decoded until its last row ends (finished rows leave; nothing takes their place);
- ``after``: one continuous batch of B rows (``generate(..., batch_size=B)``): rows that end
  are refilled from the queue.

Per row: rollout tokens/s (completion tokens over wall time, prefill included), tau, the
ideal speedup over plain decoding ``tau * t_decode / (t_verify + t_draft)`` with
``t_decode`` a plain decode step at the same batch (``autoregressive_generate``, measured
here), the measured speedup (spec tok/s over plain tok/s on the same prompts, both
continuous) and their ratio; and the compute bound: the run's target and drafter FLOPs per
rollout token (``eval/flops.py``) at the rate of one 2048^3 matmul measured in the same run.
Both modes must give equal records (tokens, anchors, drafts, accepted counts).

Run alone on a quiet machine:

    .venv/bin/python benchmarks/bench_rollout.py [--batch 4 8 16 32] [--prompts 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def matmul_gflops(n: int = 2048, reps: int = 3) -> float:
    """The rate of one n^3 fp32 matmul on this machine (GFLOP/s, best of ``reps``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def rollout_flops(target_config, draft_config, records) -> float:
    """Target verify/prefill FLOPs plus drafter FLOPs (one forward per block over its new context) of the records."""
    from specforge_opd.eval.flops import drafter_forward_flops, rollout_target_flops

    total = 0.0
    for r in records:
        bs = r.block_size
        total += rollout_target_flops(target_config, prompt_len=r.prompt_len, anchors=r.anchors.tolist(), block_size=bs)
        prev = 0
        for a in r.anchors.tolist():
            total += drafter_forward_flops(draft_config, query_slots=bs, context_rows=a - prev, attended_keys=bs * (a + bs),
                                           lm_head_slots=bs - 1)["total"]
            prev = a
    return total


def same_records(x, y) -> bool:
    return all(a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.anchors, b.anchors)
               and torch.equal(a.drafts, b.drafts) and torch.equal(a.accepted, b.accepted) for a, b in zip(x, y)) and len(x) == len(y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/tiny/opd.yaml"))
    ap.add_argument("--drafter", default="published:smollm2-135m-instruct-dflash-b8")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--prompts", type=int, default=48, help="prompts of the OPD pool rolled out per measurement")
    ap.add_argument("--modes", nargs="+", default=["before", "after"], choices=["before", "after"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specforge_opd.config import load_config
    from specforge_opd.data.chat import render_prompt
    from specforge_opd.models.drafter import drafter_mask_token_id, load_drafter
    from specforge_opd.models.target import load_target
    from specforge_opd.precision import machine_info
    from specforge_opd.rollout.engine import SpeculativeEngine, autoregressive_generate, length_batches
    from specforge_opd.rollout.records import tau_of
    from specforge_opd.stages.opd import _pool

    cfg = load_config(args.config, [])
    bundle = load_target(cfg.target)
    tok = bundle.tokenizer
    drafter = load_drafter(args.drafter, target_config=bundle.model.config).eval()
    pool, _ = _pool(cfg, tokenizer=tok)
    prompts = [tok(render_prompt(tok, p.chat_messages(), thinking=cfg.target.thinking), add_special_tokens=False)["input_ids"]
               for p in pool][: args.prompts]
    ids = [str(p.id) for p in pool][: args.prompts]
    rc = cfg.rollout
    engine = SpeculativeEngine(bundle.model, drafter, rc, stop_token_ids=bundle.stop_token_ids, mask_token_id=drafter_mask_token_id(drafter),
                               max_context=cfg.target.max_context, too_long=cfg.target.too_long, prefill_chunk=cfg.target.prefill_chunk)
    engine.generate(prompts[:2], ids[:2])  # warm-up: allocator, packed weights, thread pools
    gflops = matmul_gflops()

    rows = []
    reference = None
    for B in args.batch:
        ar_stats: dict = {}
        t = time.perf_counter()
        ar = autoregressive_generate(bundle.model, prompts, rc.max_new_tokens, bundle.stop_token_ids, sample_ids=ids,
                                     batch_size=B, stats=ar_stats, prefill_chunk=cfg.target.prefill_chunk)
        ar_tok_s = sum(len(o) for o in ar) / (time.perf_counter() - t)
        t_decode = ar_stats["t_decode"] / max(ar_stats["decode_steps"], 1)
        row = {"batch": B, "prompts": len(prompts), "ar_tok_s": ar_tok_s, "t_decode_ms": 1e3 * t_decode}
        for mode in args.modes:
            t = time.perf_counter()
            if mode == "before":
                recs, st = [], {"verify_steps": 0, "batch_steps": 0, "t_verify": 0.0, "t_draft": 0.0}
                by_id = {}
                for idx in length_batches([len(p) for p in prompts], B):
                    for r in engine.generate([prompts[i] for i in idx], [ids[i] for i in idx]):
                        by_id[r.sample_id] = r
                    for k in st:
                        st[k] += engine.stats[k]
                recs = [by_id[s] for s in ids if s in by_id]
            else:
                recs = engine.generate(prompts, ids, batch_size=B)
                st = engine.stats
            wall = time.perf_counter() - t
            toks = sum(r.completion_tokens for r in recs)
            tau = tau_of(recs)
            steps = max(st["batch_steps"], 1)
            ideal = tau * t_decode / ((st["t_verify"] + st["t_draft"]) / steps)
            measured = (toks / wall) / ar_tok_s
            bound = gflops * 1e9 / (rollout_flops(bundle.model.config, drafter.config, recs) / toks)
            reference = reference or recs
            row[mode] = {"tok_s": toks / wall, "tau": tau, "seconds": wall, "tokens": toks,
                         "t_verify_ms": 1e3 * st["t_verify"] / steps, "t_draft_ms": 1e3 * st["t_draft"] / steps,
                         "ideal_speedup": ideal, "measured_speedup": measured, "measured_over_ideal": measured / ideal,
                         "compute_bound_tok_s": bound, "of_compute_bound": (toks / wall) / bound,
                         "records_equal_first_run": same_records(recs, reference)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    best = max(rows, key=lambda r: r.get("after", r.get("before"))["tok_s"])
    result = {"machine": machine_info(), "config": args.config, "drafter": args.drafter, "matmul_gflops": gflops,
              "max_new_tokens": rc.max_new_tokens, "teacher": rc.teacher, "rows": rows, "best_batch_after": best["batch"]}
    print(f"best batch (after): {best['batch']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
