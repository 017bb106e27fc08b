"""Exact offline replay (``eval.replay.offline_tau``) against an earlier revision's, in one run.

The evaluation of every drafter on every prompt of the three sets, the OPD validation
after every refresh and the SFT validation curve all replay drafters over cached target
trajectories, so the replay's speed sets what a study costs. This benchmark builds the
target trajectories of the first ``--prompts`` prompts of each evaluation set (cached in
``--cache``, paid once), then replays the published drafter over all of them with the
current ``offline_tau`` and with the one of ``--before`` (a git revision; its
``eval/replay.py``, or ``eval/evaluate.py`` before the replay had a module of its own, is loaded
beside the current package), alternating, ``--reps`` times
each. It reports replayed tokens per second of both, their ratio, and whether the records
(anchors, accepted counts, drafts) are identical.

Run it alone: two processes with 2 OpenMP threads each slow a small matmul about 20x on
a 2-core machine.

    .venv/bin/python benchmarks/bench_replay.py [--prompts 40] [--before f7df794] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _module_at(rev: str, rels: list[str], name: str):
    """The first module of ``rels`` that exists at git revision ``rev``, as it was there, imported as ``name``
    (beside the current package)."""
    for rel in rels:
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"none of {rels} exists at revision {rev}")
    src = shown.stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(rel).name
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/small/opd.yaml", help="its target, eval sets and start drafter")
    p.add_argument("--prompts", type=int, default=40, help="prompts per evaluation set")
    p.add_argument("--before", default="f7df794", help="git revision whose offline_tau is the reference")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--cache", default="runs/bench_replay/trajectory_cache")
    p.add_argument("--json")
    args = p.parse_args()

    from specforge_opd.config import load_config
    from specforge_opd.eval import evaluate, replay as now
    from specforge_opd.models.drafter import drafter_layer_ids, drafter_path, load_any_drafter
    from specforge_opd.models.target import load_target
    from specforge_opd.precision import machine_info

    before = _module_at(args.before, ["specforge_opd/eval/replay.py", "specforge_opd/eval/evaluate.py"],
                        "specforge_opd.eval._replay_before")
    cfg = load_config(ROOT / args.config, [f"eval.num_prompts={args.prompts}"])
    bundle = load_target(cfg.target)
    drafter = load_any_drafter(str(drafter_path(cfg.draft.path)), bundle.model.config).eval()
    cache = now.TrajectoryCache(ROOT / args.cache, bundle.model, bundle.identity, max_new_tokens=cfg.eval.max_new_tokens,
                                stop_token_ids=list(bundle.stop_token_ids), batch_size=16)
    trajs = [t for toks, _ in evaluate.load_eval_prompts(cfg, bundle.tokenizer).values()
             for t in cache.get(toks, drafter_layer_ids(drafter))]
    if drafter.config._attn_implementation != "sdpa":
        raise SystemExit(f"the drafter attends with {drafter.config._attn_implementation}, not sdpa: the replay would not "
                         "take its grouped-query path")
    tokens = sum(t.input_ids.numel() - 1 - t.prompt_len for t in trajs)
    secs: dict[str, list[float]] = {"before": [], "now": []}
    recs = {}
    now.offline_tau(drafter, bundle.model, trajs[:4])  # warm-up, so neither side pays it
    for rep in range(args.reps):
        for name, mod in ((("before", before), ("now", now)) if rep % 2 == 0 else (("now", now), ("before", before))):
            t0 = time.perf_counter()
            recs[name] = mod.offline_tau(drafter, bundle.model, trajs)
            secs[name].append(time.perf_counter() - t0)
            print(f"{name}: {secs[name][-1]:.1f} s", flush=True)
    same = all(a.anchors.tolist() == b.anchors.tolist() and a.accepted.tolist() == b.accepted.tolist()
               and torch.equal(a.drafts, b.drafts) for a, b in zip(recs["before"], recs["now"]))
    best = {k: min(v) for k, v in secs.items()}
    out = {"machine": machine_info(), "command": sys.argv, "alone": "run with nothing else heavy on the machine",
           "drafter": cfg.draft.path, "trajectories": len(trajs), "replayed_tokens": tokens, "before": args.before,
           "seconds": secs, "tok_s": {k: tokens / v for k, v in best.items()},
           "speedup": best["before"] / best["now"], "records_equal": same, "tau": evaluate.tau_of(recs["now"])}
    print(json.dumps({k: out[k] for k in ("trajectories", "replayed_tokens", "tok_s", "speedup", "records_equal", "tau")}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
