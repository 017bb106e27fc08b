"""The main job's comparison: prompt lookup vs SFT vs fair continued SFT vs OPD, tau per held-out set.

(a) the drafter OPD started from (the OPD config's ``draft.path``: a published
drafter or the SFT stage's export); (b) that drafter trained further by SFT with its
own recipe (``stages.baselines``: on the target's responses to the OPD prompt pool by
default) for the same drafter-training FLOPs as the OPD stage spent, and its best
validation point when that is earlier; (c) the OPD drafter. The FLOPs come from the
drafters' metadata (``specforge_opd.eval.flops``): the OPD stage's ``drafter_budget``
(drafter forward + backward + the teacher's lm_head) divided by the cost of one SFT
optimizer step on (b)'s responses gives (b)'s steps. ``--baseline sft_data`` keeps the
older baseline (the SFT stage's data and the SFT config's recipe), which is not fair.
``--baseline-lr opd`` gives (b) OPD's peak learning rate in place of the start's: the same step
size on both sides, for a start whose own recipe ended by annealing to 0, where its peak
would knock (b) off the start's minimum before it learns anything.

``python -m specforge_opd.stages.compare --sft-config configs/tiny/sft.yaml --opd-config configs/tiny/opd.yaml``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from specforge_opd.atomic import atomic_write_text
from specforge_opd.config import load_config
from specforge_opd.eval import evaluate
from specforge_opd.eval.ngram import NGRAM_NAME
from specforge_opd.models.drafter import read_drafter_metadata
from specforge_opd.models.target import apply_threads
from specforge_opd.precision import machine_info
from specforge_opd.stages import baselines, sft
# the matched budget's helpers live with the fair baselines, which use them too; importable from here as before
from specforge_opd.stages.baselines import matched_steps, opd_drafter_flops, start_shape_overrides
from specforge_opd.stages.publish import source_commit


def _main_job_sft(sft_cfg) -> Optional[dict]:
    """The SFT stage's own export (``<sft output.dir>/final``): its selected step and validation tau, if any."""
    final = Path(sft_cfg.resolve_path(sft_cfg.output.dir)) / "final"
    v = read_drafter_metadata(final).get("validation") if final.is_dir() else None
    return None if not v else {"path": str(final), "selected_step": v["selected_step"], "validation_tau": v["selected_tau"],
                               "val_prompts": v["val_prompts"]}


def run_matched_sft(sft_config: str, opd_config: str, out: Optional[Path] = None, overrides: Optional[list[str]] = None,
                    opd_out: Optional[Path] = None, baseline: str = "opd_pool") -> Path:
    """Train (b), the matched-FLOPs SFT drafter; returns its export directory.

    (b) continues SFT (``sft_config``'s training recipe, fresh warm-up) from the drafter
    OPD started from (the OPD config's ``draft.path``, with its shape) for the drafter-training FLOPs
    the OPD run spent. ``baseline``: ``opd_pool`` (default; the paper's Figure 4
    baseline) trains on the target's responses to the OPD stage's own prompt pool
    (its ``data`` section, ``rollout.max_new_tokens``), so it needs no SFT data: a
    published drafter works as well as this repository's SFT export; ``sft_data``
    trains on the SFT stage's own responses and features (reused from its output dir).
    ``opd_out`` is the OPD run to match (default: the OPD config's ``output.dir``).

    Raises:
        ValueError: an unknown ``baseline``, no ``draft.path`` in the OPD config, or no OPD FLOPs metadata.
    """
    if baseline not in ("opd_pool", "sft_data"):
        raise ValueError(f"baseline={baseline!r}: expected opd_pool or sft_data")
    sft_cfg, opd_cfg, start = baselines.load_pair(sft_config, opd_config, overrides)
    sft_out = Path(sft_cfg.resolve_path(sft_cfg.output.dir))
    opd_final = Path(opd_out or opd_cfg.resolve_path(opd_cfg.output.dir)) / "final"
    opd = opd_drafter_flops(opd_final)
    out = Path(out or sft_out.parent / "sft_matched")
    ov = start_shape_overrides(sft_cfg, start) + list(overrides or []) + [f"output.dir={out}", f"sft.init_drafter={start}",
                                  # the baseline is the drafter at the matched FLOPs, not the best point of a curve
                                  "sft.val_prompts=0"]
    if baseline == "sft_data":
        ov.append(f"sft.reuse_from={sft_out}")
    cfg = load_config(sft_config, ov)
    if baseline == "opd_pool":
        cfg = cfg.model_copy(update={"data": opd_cfg.data, "sft": cfg.sft.model_copy(
            update={"max_new_tokens": opd_cfg.rollout.max_new_tokens})})

    def steps_for(responses: list) -> int:
        steps, per_step = matched_steps(cfg, start, responses, opd)
        print(f"[compare] OPD spent {opd:.3e} drafter FLOPs; one SFT step costs {per_step:.3e}: continuing SFT "
              f"from {start} for {steps} steps on the {baseline} responses -> {out}", file=sys.stderr)
        return steps

    return sft.run_sft(cfg, budget_for=lambda responses: {"max_steps": steps_for(responses)})


def build_summary(result: dict, names: list[str], *, seeds: list[int], stage_seconds: dict, extra: Optional[dict] = None) -> dict:
    """The main job's machine-readable result (``runs/<exp>/summary.json``).

    Rows are the drafters ``names`` in table order; each has tau per dataset and
    its mean, and the cumulative drafter-training FLOPs (None for prompt lookup).
    ``stage_seconds``: wall time per stage; ``seeds``: the seeds behind the rows.
    """
    commit = source_commit()
    rows = []
    for n in names:
        d = result["drafters"][n]
        taus = {ds: s["tau"] for ds, s in d["datasets"].items()}
        rows.append({"drafter": n, "tau": taus, "mean_tau": sum(taus.values()) / len(taus),
                     "drafter_flops": (d.get("flops") or {}).get("drafter_budget")})
    e = result["eval"]
    # stage_seconds depend on the CPU (bf16 is native on some): the machine goes with them
    return {"rows": rows, "seeds": list(seeds), "commit": commit, "stage_seconds": dict(stage_seconds), "machine": machine_info(),
            "eval": {"method": result["method"], "num_prompts": e["num_prompts"], "max_new_tokens": e["max_new_tokens"],
                     "block_size": result["drafters"][names[-1]]["block_size"]},
            **(extra or {})}


def render_summary(summary: dict) -> str:
    """The README's main-job table, generated from a ``summary.json`` (one row per drafter)."""
    dsets = list(summary["rows"][0]["tau"])
    lines = ["| drafter | " + " | ".join(dsets) + " | mean | drafter-training FLOPs |",
             "|---|" + "---:|" * (len(dsets) + 2)]
    for r in summary["rows"]:
        f = r["drafter_flops"]
        lines.append(f"| {r['drafter']} | " + " | ".join(f"{r['tau'][ds]:.3f}" for ds in dsets)
                     + f" | **{r['mean_tau']:.3f}** | {'-' if f is None else f'{f:.2e}'} |")
    st = summary["stage_seconds"]
    lines.append("")
    names = summary.get("seed_fields") or ["seed"] * len(summary["seeds"])
    seeds = ", ".join(f"{n}={v}" for n, v in zip(names, summary["seeds"]))
    lines.append(f"Seeds: {seeds}; commit `{(summary.get('commit') or '?')[:12]}`; stage wall times: "
                 + ", ".join(f"{k} {v:.0f} s" for k, v in st.items()) + ".")
    return "\n".join(lines)


def table(result: dict, names: list[str]) -> str:
    """Markdown table of tau per dataset (rows) and drafter (columns), with the mean."""
    dsets = list(next(iter(result["drafters"].values()))["datasets"])
    lines = ["| dataset | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    means = {n: [] for n in names}
    for ds in dsets:
        cells = []
        for n in names:
            t = result["drafters"][n]["datasets"][ds]["tau"]
            means[n].append(t)
            cells.append(f"{t:.3f}")
        lines.append(f"| {ds} | " + " | ".join(cells) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{sum(v) / len(v):.3f}**" for v in means.values()) + " |")
    flops = []
    for n in names:
        f = (result["drafters"][n].get("flops") or {}).get("drafter_budget")
        flops.append("-" if f is None else f"{f:.2e}")
    lines.append("| drafter-training FLOPs (cumulative) | " + " | ".join(flops) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--render"]:
        # print the README table of a committed summary.json (the README's table is this output)
        import json

        if len(argv) != 2:
            print("usage: python -m specforge_opd.stages.compare --render SUMMARY.json", file=sys.stderr)
            return 2
        print(render_summary(json.loads(Path(argv[1]).read_text())))
        return 0
    p = argparse.ArgumentParser(prog="python -m specforge_opd.stages.compare", description=__doc__.splitlines()[0],
                                epilog="python -m specforge_opd.stages.compare --render SUMMARY.json prints the "
                                       "comparison table of a written summary.json (the README's table)")
    p.add_argument("--sft-config", required=True)
    p.add_argument("--opd-config", required=True)
    p.add_argument("--out", help="where eval.json/eval.md/comparison.md go (default <opd output.dir>/comparison)")
    p.add_argument("--summary", help="also write the machine-readable result (summary.json) here")
    p.add_argument("--stage-seconds", nargs="*", default=[], metavar="STAGE=SECONDS",
                   help="wall times of the stages before this one, for the summary")
    p.add_argument("--baseline", choices=["opd_pool", "fresh", "sft_data"], default="opd_pool",
                   help="what the SFT baseline trains on: responses to the OPD prompt pool (default), to fresh "
                        "conversations of the SFT pool, or the SFT stage's own data (the old matched baseline)")
    p.add_argument("--recipe", choices=["start", "config"], default="start",
                   help="the baseline's training recipe: the start drafter's own (default, fair) or the SFT config's")
    p.add_argument("--baseline-lr", choices=["start", "opd"], default="start",
                   help="the baseline's peak learning rate: its recipe's (default) or the OPD config's "
                        "(training.learning_rate), so that both sides take the same step size")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides applied to both configs")
    args = p.parse_args(argv)
    sft_cfg = load_config(args.sft_config, args.overrides)
    opd_cfg = load_config(args.opd_config, args.overrides)
    apply_threads(opd_cfg.target.threads)
    opd_final = Path(opd_cfg.resolve_path(opd_cfg.output.dir)) / "final"
    import time

    stages = {}
    for kv in args.stage_seconds:
        k, _, v = kv.partition("=")
        stages[k] = float(v)
    t0 = time.time()
    # the SFT row is the drafter OPD started from: a published drafter or this run's SFT export
    start = Path(opd_cfg.resolve_path(opd_cfg.draft.path))
    fair = None
    if args.baseline == "sft_data":  # the SFT stage's own data and recipe: not a fair baseline, kept for comparison
        matched = run_matched_sft(args.sft_config, args.opd_config, overrides=args.overrides, baseline=args.baseline)
        drafters = {"SFT": start, "SFT + matched-FLOPs SFT": matched, "SFT + OPD": opd_final}
    else:
        # run_fair_sft applies these after the recipe, and to both configs: the OPD config keeps its own rate
        same_lr = [f"training.learning_rate={opd_cfg.training.learning_rate}"] if args.baseline_lr == "opd" else []
        fair = baselines.run_fair_sft(args.sft_config, args.opd_config, source=args.baseline, recipe=args.recipe,
                                      overrides=list(args.overrides) + same_lr)
        drafters = {"SFT": start, "SFT + matched-FLOPs SFT": fair["matched"]}
        if fair["selected_step"] != fair["steps"]:
            drafters["SFT + best-val SFT"] = fair["best_val"]
        drafters["SFT + OPD"] = opd_final
    stages["matched_sft"] = time.time() - t0
    out = Path(args.out) if args.out else opd_final.parent / "comparison"
    t0 = time.time()
    result = evaluate.evaluate(opd_cfg, drafters, out)
    stages["eval"] = time.time() - t0
    names = ([NGRAM_NAME] if NGRAM_NAME in result["drafters"] else []) + list(drafters)
    text = table(result, names)
    if args.summary:
        import json

        summary = build_summary(result, names, seeds=[opd_cfg.data.seed, opd_cfg.rollout.seed], stage_seconds=stages,
                                extra={"seed_fields": ["opd data.seed", "opd rollout.seed"],
                                       "sft_row": str(opd_cfg.draft.path), "baseline": args.baseline,
                                       "baseline_recipe": None if fair is None else {
                                           "recipe": args.recipe, "source": fair["recipe"].get("source"),
                                           "note": fair["recipe_note"], "steps": fair["steps"],
                                           "learning_rate": args.baseline_lr,
                                           "selected_step": fair["selected_step"]},
                                       "main_job_sft": _main_job_sft(sft_cfg)})
        atomic_write_text(Path(args.summary), json.dumps(summary, indent=2))
        print(f"summary: {args.summary}")
    (out / "comparison.md").write_text(
        f"# tau on held-out sets (offline exact replay at T=0; {opd_cfg.eval.num_prompts} prompts per set, "
        f"{opd_cfg.eval.max_new_tokens} new tokens)\n\n{text}\n"
    )
    print(text)
    print(f"\n(eval.json, eval.md, plots and comparison.md in {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
