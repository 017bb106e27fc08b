"""The in-process target's compaction threshold against throughput, in one run.

A continuous batch leaves hole slots in its shared KV cache: a refilled row's prompt is
shorter than the cache, and a verify step's rejected slots stay behind as masked holes.
Every decode and verify step attends over all slots, holes included, so holes cost
attention time; squeezing them out (``InProcessTarget._compact``) costs one copy of the
cache. ``compact_below`` sets when: once the longest row's valid slots fall below that
fraction of the cache. This sweeps it for the two continuous-batch jobs every experiment
pays for, each on the same prompts at every threshold:

- ``generation``: plain greedy generation for the SFT pool of ``configs/small/sft.yaml``
  (mixed prompt lengths, its stop tokens) at batch ``--gen-batch`` (SFT responses, evaluation
  trajectories), tokens/s of the whole job, prefill included;
- ``rollout``: the OPD rollout of ``--rollout-prompts`` prompts of ``configs/small/opd.yaml``'s
  pool with the shipped drafter (``models.published.EMBEDDED_DRAFTER``) at that config's
  ``rollout.batch_size``, tokens/s of the whole job.

Each row records the compactions and whether the outputs equal those of the first threshold
(tokens do not depend on the threshold in fp32, up to numerical ties). Speed is compared
between neighbouring rows of one run: the 2-core machine's speed drifts by up to 10% within
a run, so the default order interleaves the thresholds and repeats the two that matter
(a run in increasing order credited the drift to the higher thresholds). ``by_threshold``
holds each threshold's mean tokens/s over its rows. Run it alone: two processes with 2 OpenMP
threads each slow a small matmul about 20x on a 2-core machine.

    .venv/bin/python benchmarks/bench_compaction.py [--thresholds 0.95 0.5 0.85 0.7 0.95 0.5]
        [--json benchmarks/results/bench_compaction.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def by_threshold(rows: list[dict]) -> dict[str, float]:
    """Mean tokens/s of each threshold over its rows, keyed by the threshold as a string."""
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(str(r["compact_below"]), []).append(r["tok_s"])
    return {k: sum(v) / len(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.95, 0.5, 0.85, 0.7, 0.95, 0.5])
    ap.add_argument("--gen-prompts", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--rollout-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/bench_compaction.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from bench_rollout import same_records
    from bench_throughput import rollout_setup, sft_pool_prompts

    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import load_drafter
    from specforge_opd.models.published import EMBEDDED_DRAFTER
    from specforge_opd.models.target import load_target
    from specforge_opd.precision import machine_info
    from specforge_opd.rollout.engine import autoregressive_generate
    from specforge_opd.rollout.records import tau_of

    res: dict = {"machine": machine_info(), "command": sys.argv, "alone": "run with nothing else heavy on the machine",
                 "thresholds": args.thresholds}

    # -- generation: the small SFT config's pool
    bundle = load_target(load_config(ROOT / "configs/small/sft.yaml", []).target)
    tok, model = bundle.tokenizer, bundle.model
    gp, gid = sft_pool_prompts(tok, args.gen_prompts)
    autoregressive_generate(model, gp[:2], 8, bundle.stop_token_ids)  # warm-up
    rows, first = [], None
    for f in args.thresholds:
        st: dict = {}
        t = time.perf_counter()
        outs = autoregressive_generate(model, gp, args.gen_tokens, bundle.stop_token_ids, sample_ids=gid,
                                       batch_size=args.gen_batch, stats=st, compact_below=f)
        s = time.perf_counter() - t
        first = outs if first is None else first
        toks = sum(len(o) for o in outs)
        rows.append({"compact_below": f, "tok_s": toks / s, "seconds": s, "tokens": toks, "compactions": st["compactions"],
                     "admissions": st["admissions"], "outputs_equal_first": outs == first})
        print(json.dumps(rows[-1]), flush=True)
    res["generation"] = {"prompts": len(gp), "batch": args.gen_batch, "max_new_tokens": args.gen_tokens, "rows": rows,
                         "by_threshold": by_threshold(rows)}

    # -- rollout: the small OPD config's pool with the shipped drafter
    cfg = load_config(ROOT / "configs/small/opd.yaml", [])
    drafter = load_drafter(f"published:{EMBEDDED_DRAFTER}", target_config=model.config).eval()
    engine, prompts, ids = rollout_setup(cfg, bundle, drafter, args.rollout_prompts)
    rows, first = [], None
    for f in args.thresholds:
        engine.compact_below = f
        t = time.perf_counter()
        recs = engine.generate(prompts, ids, batch_size=cfg.rollout.batch_size)
        s = time.perf_counter() - t
        first = recs if first is None else first
        toks = sum(r.completion_tokens for r in recs)
        rows.append({"compact_below": f, "tok_s": toks / s, "seconds": s, "tokens": toks, "tau": tau_of(recs),
                     "compactions": engine.stats["compactions"], "records_equal_first": same_records(recs, first)})
        print(json.dumps(rows[-1]), flush=True)
    res["rollout"] = {"prompts": len(prompts), "drafter": EMBEDDED_DRAFTER, "batch": cfg.rollout.batch_size,
                      "max_new_tokens": cfg.rollout.max_new_tokens, "teacher": cfg.rollout.teacher, "rows": rows,
                      "by_threshold": by_threshold(rows)}
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
