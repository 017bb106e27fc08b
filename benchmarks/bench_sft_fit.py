"""Is the SFT plateau data-limited? tau of the curve's exports on their own training conversations against validation.

Replays (exact offline replay at T=0, the validation set's rule) the SFT run's curve exports on the
first ``--prompts`` of the conversations they trained on, beside the validation tau the curve
recorded, and prompt lookup on both. A training tau that keeps rising while validation tau flattens
says the drafter memorises its responses: more target responses, not more steps, is the lever.

    .venv/bin/python benchmarks/bench_sft_fit.py [--config configs/small/sft.yaml] [--steps 400 2000 4000 4400]

Writes ``benchmarks/results/bench_sft_fit.json``. About 3 minutes at one thread (the training
trajectories are decoded once and cached under the run's output directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/small/sft.yaml")
    p.add_argument("--steps", type=int, nargs="+", default=[400, 2000, 4000, 4400])
    p.add_argument("--prompts", type=int, default=50, help="training conversations replayed (the validation set's size)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_sft_fit.json"))
    args = p.parse_args()

    from specforge_opd.config import load_config
    from specforge_opd.data.prompts import tokenize_prompts
    from specforge_opd.eval.ngram import ngram_offline_tau
    from specforge_opd.eval.validation import ValidationSet, read_curve
    from specforge_opd.models.drafter import load_drafter
    from specforge_opd.models.target import target_dir
    from specforge_opd.rollout.records import tau_of
    from specforge_opd.stages import sft
    from specforge_opd.stepkeys import target_key

    cfg = load_config(ROOT / args.config)
    out = Path(cfg.resolve_path(cfg.output.dir))
    runs = sorted(out.glob("train-*"), key=lambda d: d.stat().st_mtime)
    if not runs:
        sys.exit(f"{out}: no SFT train step; run scripts/train_sft.sh {args.config} first")
    run = runs[-1]
    b = sft._load_bundle(cfg)
    tid = target_key(target_dir(cfg))
    train, _ = tokenize_prompts(sft._load_prompts(cfg, b.tokenizer), b.tokenizer, cfg)
    val, _ = tokenize_prompts(sft._load_val_prompts(cfg, b.tokenizer), b.tokenizer, cfg)
    kw = dict(max_new_tokens=cfg.sft.max_new_tokens, stop_token_ids=list(b.stop_token_ids))
    sets = {"train": ValidationSet(b.model, tid, [q for _, q in train][: args.prompts], cache_dir=out / "train_trajectories", **kw),
            "validation": ValidationSet(b.model, tid, [q for _, q in val], cache_dir=out / "val_trajectories", **kw)}
    layer_ids = list(cfg.draft.target_layer_ids)
    ngram = {name: tau_of(ngram_offline_tau(s.cache.get(s.prompts, layer_ids, desc=name), cfg.draft.block_size))
             for name, s in sets.items()}
    curve = {pt["step"]: pt for pt in read_curve(run)}
    rows = []
    for step in args.steps:
        if step not in curve:
            sys.exit(f"{run}: no curve point at step {step} (points: {sorted(curve)})")
        d = load_drafter(curve[step]["export"], target_config=b.model.config)
        rows.append({"step": step, "train_tau": sets["train"].tau(d), "validation_tau": curve[step]["tau"]})
        print(rows[-1], flush=True)
    from specforge_opd.precision import machine_info

    res = {"machine": machine_info(), "config": args.config, "run": run.name, "train_prompts": len(sets["train"].prompts),
           "validation_prompts": len(sets["validation"].prompts), "ngram": ngram, "points": rows}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
