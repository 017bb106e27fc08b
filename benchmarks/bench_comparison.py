"""Comparison and ablation tables of the main job on the embedded target (issue 9, item 8).

For each seed: (a) the SFT drafter, (b) SFT continued for the OPD stage's
drafter-training FLOPs, (c) SFT + OPD; and the ablations of the paper's section
5.3 as OPD variants from the same SFT drafter: mixed (Eq. 1), all-forward,
all-reverse, no decay, random anchors, naive target-assisted. Every drafter is
evaluated by exact offline replay at T=0 on the same held-out prompts; the
tables give mean tau per dataset and its spread (min..max) over the seeds.

The SFT stage runs once (``configs/tiny/sft.yaml``); seeds vary the OPD and
continued-SFT training (``training.seed``, ``data.seed`` order, ``rollout.seed``).

    .venv/bin/python benchmarks/bench_comparison.py --seeds 0 1 [--variants mixed all_forward ...]

Results go to ``runs/bench/comparison.md`` (and ``.json``). On the 2-core machine
the full run takes about 90 minutes; every run inside it resumes when restarted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")

VARIANTS = {
    "mixed": [],
    "all_forward": ["training.loss=all_forward"],
    "all_reverse": ["training.loss=all_reverse"],
    "no_decay": ["training.rejected_decay=1.0"],
    "random_anchors": ["rollout.anchors=random"],
    "naive_target_assisted": ["training.loss=naive_target_assisted"],
}


def sh(args: list[str]) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True, cwd=ROOT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--sft-config", default="configs/tiny/sft.yaml")
    p.add_argument("--opd-config", default="configs/tiny/opd.yaml")
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args()
    out = ROOT / args.out
    sh(["bash", "scripts/train_sft.sh", args.sft_config])
    from specforge_opd.config import load_config

    sft_final = Path(load_config(ROOT / args.sft_config).output.dir) / "final"
    drafters: dict[str, dict[int, Path]] = {}
    for seed in args.seeds:
        seed_ov = [f"training.seed={seed}", f"data.seed={seed + 1}", f"rollout.seed={seed}"]
        for v in args.variants:
            run = out / f"opd-{v}-s{seed}"
            sh(["bash", "scripts/train_opd.sh", args.opd_config, f"output.dir={run}", *VARIANTS[v], *seed_ov])
            drafters.setdefault(f"OPD {v}", {})[seed] = run / "final"
        # (b): continued SFT for the FLOPs of the seed's mixed OPD run
        from specforge_opd.compare import run_matched_sft

        mixed = out / f"opd-mixed-s{seed}"
        if mixed.is_dir():
            m = run_matched_sft(args.sft_config, args.opd_config, out=out / f"sft-matched-s{seed}",
                                overrides=[f"training.seed={seed}"], opd_out=mixed)
            drafters.setdefault("SFT + matched-FLOPs SFT", {})[seed] = m
    eval_args = ["--drafter", f"SFT={sft_final}"]
    for name, per_seed in drafters.items():
        for seed, d in per_seed.items():
            eval_args += ["--drafter", f"{name} s{seed}={d}"]
    sh([PY, "-m", "specforge_opd.cli", "eval", "-c", args.opd_config, "--out", str(out / "eval"), *eval_args])
    result = json.loads((out / "eval" / "eval.json").read_text())
    rows = {"SFT": {}}
    for name, per_seed in drafters.items():
        rows[name] = {}
    datasets = list(next(iter(result["drafters"].values()))["datasets"])
    for ds in datasets:
        rows["SFT"][ds] = [result["drafters"]["SFT"]["datasets"][ds]["tau"]]
        for name, per_seed in drafters.items():
            rows[name][ds] = [result["drafters"][f"{name} s{s}"]["datasets"][ds]["tau"] for s in per_seed]
    lines = [f"# tau per dataset, mean (min..max) over seeds {args.seeds}", "",
             "| drafter | " + " | ".join(datasets) + " | mean |", "|---|" + "---:|" * (len(datasets) + 1)]
    for name, per_ds in rows.items():
        cells = [f"{statistics.fmean(v):.3f} ({min(v):.3f}..{max(v):.3f})" for v in per_ds.values()]
        means = [statistics.fmean(vals[i] for vals in per_ds.values()) for i in range(len(next(iter(per_ds.values()))))]
        cells.append(f"{statistics.fmean(means):.3f} ({min(means):.3f}..{max(means):.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    (out / "comparison.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
