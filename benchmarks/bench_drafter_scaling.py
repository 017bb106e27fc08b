"""Data and depth scaling of the embedded target's drafter: validation tau at a fixed training budget.

Every point trains from scratch with ``configs/small/sft_scaling.yaml`` (first and later ShareGPT
turns of slice 0, 256 greedy response tokens, 128 anchors, constant LR 1e-3, bf16 where native)
for the same number of optimizer steps (``sft.pause_at_step``, about 1M drafter positions), and
differs in one thing:

* ``data1x``, ``data2x``, ``data4x``: the first N samples of one shared responses + features
  step (``sft.train_samples``), N the smallest prefix whose response tokens reach 1x, 2x, 4x
  the first published drafter's (``-b8``, ``--base-tokens``); the largest point takes every sample and is
  the config's own run (``scripts/train_sft.sh configs/small/sft_scaling.yaml``);
* ``depth2``, ``depth3``: 2 and 3 drafter layers on the largest data (``target_layer_ids``
  unchanged).

Then every point's export (the best validation point) and the published drafter are replayed
offline (T=0) on every prompt of the three evaluation sets beside prompt lookup, on one
trajectory cache. Positions/s per depth come from ``benchmarks/results/bench_sft.json``
(measured alone), never from these runs' wall times.

    .venv/bin/python benchmarks/bench_drafter_scaling.py --phase train [--points data1x data2x ...]
    .venv/bin/python benchmarks/bench_drafter_scaling.py --phase eval
    .venv/bin/python benchmarks/bench_drafter_scaling.py --render benchmarks/results/drafter_scaling.json

Each phase resumes where it stopped (the SFT stage's own resume). The long run of the best
point is the same command as the point with ``sft.pause_at_step=null`` (``--long POINT``); the evaluation keeps that point at the budget
(its best validation export up to it) and adds the whole run as ``POINT-long``.
Writes ``benchmarks/results/drafter_scaling.json`` and ``sft_scaling.png``. Its top level holds
the shipped drafter's (``published_*``), the drafter it succeeded (``previous_*``) and prompt
lookup's mean tau, and ``extrapolation``: what the curves predict for 10x more data or depth
(``extrapolate``; ``--phase fit`` refits it alone). ``--phase shipped`` measures only those three, on the same cache, and
updates them in an existing result (the curve points' runs need not be on disk).

A point with its own recipe (another data mix, say) is a run of its own config, trained with
``scripts/train_sft.sh CONFIG``; ``--phase run --run NAME=CONFIG`` replays its export at the
config's budget (and the whole run as ``NAME-long`` if it went past it) beside the shipped rows,
and merges it into the existing result, replacing a point of the same name:

    .venv/bin/python benchmarks/bench_drafter_scaling.py --phase run --run mix-l3=configs/small/sft_mix_l3.yaml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specforge_opd.models.published import BEST_DRAFTER, SCHEME

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")
#: Response tokens the first published drafter (-b8) trained on (its 791 samples of configs/small/sft.yaml).
BASE_TOKENS = 90_000
DEPTHS = {"depth2": 2, "depth3": 3}
DATA = {"data1x": 1, "data2x": 2, "data4x": 4}
POINTS = tuple(DATA) + tuple(DEPTHS)
#: The point that is the config's own run (every sample, 1 layer): trained in its output.dir.
BASE_POINT = "data4x"
#: The best shipped drafter (the v2 mix's three-stage run, configs/small/sft_mix_v2_l3*.yaml) and the one it succeeded.
PUBLISHED = SCHEME + BEST_DRAFTER
PREVIOUS = "published:smollm2-135m-instruct-dflash-b8-mixv2-l3"
#: Two long runs that differ only in their response tokens: the same warm start, recipe (constant LR)
#: and sources, one on a quarter of the other's prompts. Their tau per 10x tokens is the data slope
#: measured past the fixed budget, where the budget points are still early on their curves.
LONG_DATA_PAIR = ("mix-v2q-l3", "mix-v2-l3")
#: The goal of the drafter's mean held-out tau; the extrapolation says what reaching it would take.
GOAL_TAU = 1.8


def sh(args: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(args), f"> {log}", flush=True)
    with open(log, "a") as f:
        subprocess.run(args, check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def shared_run(cfg, config: str) -> tuple[Path, list[int]]:
    """The base run's responses step and each kept sample's supervised tokens (feature order).

    The step is the one the base run trained on: its export's train directory names the
    features step (``run.yaml``), whose marker names the responses step by key. A base
    directory may hold other finished responses steps (a grown pool's donors), so the
    newest one is not necessarily it.
    """
    import yaml

    from specforge_opd.models.drafter import read_drafter_metadata
    from specforge_opd.rollout.responses import read_responses
    from specforge_opd.stages.sft_features import plan_features, supervised_tokens
    from specforge_opd.stepkeys import MARKER, is_done, reusable_step

    out = Path(cfg.resolve_path(cfg.output.dir))
    final = out / "final"
    if not final.is_dir():
        sys.exit(f"{out}: no finished base run; run scripts/train_sft.sh {config} first")
    train_dir = Path(read_drafter_metadata(final)["specforge_checkpoint"]).parents[1]
    features = Path(yaml.safe_load((train_dir / "run.yaml").read_text())["data"]["hidden_states_path"])
    r_key = json.loads((features / MARKER).read_text())["inputs"]["responses"]
    r_dir = reusable_step(cfg, out, "responses", r_key)
    if not is_done(r_dir, r_key):
        sys.exit(f"{out}: the responses step {r_key[:12]} the base run trained on is gone; rerun scripts/train_sft.sh {config}")
    recs = read_responses(r_dir)
    kept, _ = plan_features(recs, cfg.target.max_context)
    return r_dir, [supervised_tokens(recs[i], cfg.target.max_context) for i in kept]


def samples_for(sup: list[int], tokens: int) -> int:
    """The smallest prefix of the samples whose response tokens reach ``tokens`` (all of them if none does)."""
    total = 0
    for i, n in enumerate(sup):
        total += n
        if total >= tokens:
            return i + 1
    return len(sup)


def point_overrides(name: str, sup: list[int], base_tokens: int) -> tuple[list[str], dict]:
    """The overrides of a point and what it is: data multiple, samples, response tokens, layers."""
    if name in DATA:
        largest = max(DATA.values())
        n = len(sup) if DATA[name] == largest else samples_for(sup, DATA[name] * base_tokens)
        layers = 1
    else:
        n, layers = len(sup), DEPTHS[name]
    ov = [f"draft.num_hidden_layers={layers}"] + ([f"sft.train_samples={n}"] if n < len(sup) else [])
    tokens = sum(sup[:n])
    return ov, {"layers": layers, "train_samples": n, "response_tokens": tokens, "data_multiple": tokens / base_tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/small/sft_scaling.yaml")
    p.add_argument("--phase", choices=["train", "eval", "shipped", "run", "fit"], default=None,
                   help="fit: only recompute the extrapolation of an existing result")
    p.add_argument("--run", action="append", default=[], metavar="NAME=CONFIG",
                   help="with --phase run: a point trained by its own config (its output.dir), merged into --json")
    p.add_argument("--points", nargs="+", default=list(POINTS), choices=POINTS)
    p.add_argument("--long", choices=POINTS, default=None, help="continue this point past the budget to its plateau")
    p.add_argument("--steps", type=int, default=None,
                   help="budget per point in optimizer steps (default: the config's sft.pause_at_step); a larger one "
                        "continues the points already trained")
    p.add_argument("--out", default="runs/small/scaling")
    p.add_argument("--eval-config", default="configs/small/opd.yaml", help="its eval section: sets, tokens")
    p.add_argument("--cache-dir", default="runs/opd_scale/trajectory_cache", help="trajectory cache of the eval sets")
    p.add_argument("--base-tokens", type=int, default=BASE_TOKENS)
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/drafter_scaling.json"))
    p.add_argument("--render", default=None, metavar="JSON", help="print the README table of a result and exit")
    args = p.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    if args.phase == "fit":
        write(json.loads(Path(args.json).read_text()), Path(args.json))
        return 0
    if args.phase == "shipped":
        table = json.loads(Path(args.json).read_text())
        table.update(shipped_rows(args, ROOT / args.out, []))
        from specforge_opd.precision import machine_info

        table["shipped_command"], table["shipped_machine"] = sys.argv, machine_info()
        write(table, Path(args.json))
        return 0

    if args.phase == "run":
        table = json.loads(Path(args.json).read_text())
        points = [own_run_point(spec, args) for spec in args.run]
        if not points:
            sys.exit("--phase run: name at least one --run NAME=CONFIG")
        rows = [r for pt in points for r in pt]
        table.update(shipped_rows(args, ROOT / args.out, rows, label_="eval_runs"))
        table = merge_points(table, rows)
        from specforge_opd.precision import machine_info

        table.setdefault("runs_commands", []).append({"command": sys.argv, "machine": machine_info()})
        write(table, Path(args.json))
        return 0

    from specforge_opd.config import load_config

    cfg = load_config(ROOT / args.config)
    base = Path(cfg.resolve_path(cfg.output.dir))
    out = ROOT / args.out
    _, sup = shared_run(cfg, args.config)
    if args.phase == "train" or args.long:
        names = [args.long] if args.long else args.points
        for name in names:
            ov, _ = point_overrides(name, sup, args.base_tokens)
            extra = (["sft.pause_at_step=null"] if args.long
                     else [f"sft.pause_at_step={args.steps}"] if args.steps else [])
            where = [] if name == BASE_POINT else [
                f"output.dir={out / name}", f"sft.reuse_from={base}", "output.tensorboard=false",
                # the base run's validation trajectories serve every point (keyed by target, prompt and budget)
                f"eval.cache_dir={base / 'val_trajectories'}"]
            sh([str(ROOT / "scripts/train_sft.sh"), args.config, *where, *ov, *extra], out / "logs" / f"{name}.log")
    if args.phase == "eval":
        table = evaluate(args, cfg, out, sup)
        write(table, Path(args.json))
    return 0


def write(table: dict, path: Path) -> None:
    """Store ``table`` with its extrapolation refitted, redraw ``sft_scaling.png`` beside it, print the table."""
    table["extrapolation"] = extrapolate(table)
    path.write_text(json.dumps(table, indent=2) + "\n")
    plot(table, path.with_name("sft_scaling.png"))
    print(render(table))


def budget_and_long(name: str, validation: dict, budget: int, final: Path) -> list[dict]:
    """The rows of one point's validation record: the fixed-budget point and, past the budget, the long run.

    A point continued past ``budget`` steps (``--long``) stays a fixed-budget point: the
    export its selection rule (``validation.select``: ``best_val``, earliest of equals, or
    ``last``) picks among the steps up to the budget, as the paused run exported. The whole
    run is a row of its own, ``<name>-long``: its export ``final`` and the step it selected.

    Args:
        validation: the export's ``validation`` record (``curve`` of ``step``, ``tau``,
            ``export``; ``select``; ``selected_step``).
        budget: the curve points' optimizer-step budget (``sft.pause_at_step``).

    Returns:
        One or two dicts: ``name``, ``steps`` (last step), ``selected_step``, ``best_val_tau``
        (the selected point's tau), ``val_curve`` (step, tau), ``path`` (the drafter to evaluate).

    Raises:
        ValueError: no validation point at or before ``budget``.
    """
    curve = validation["curve"]
    pts = [q for q in curve if q["step"] <= budget]
    if not pts:
        raise ValueError(f"{name}: no validation point at or before step {budget}")
    if validation.get("select", "best_val") == "last":
        sel = max(pts, key=lambda q: q["step"])
    else:
        sel = max(pts, key=lambda q: (q["tau"], -q["step"]))
    rows = [(name, pts, sel, sel["export"])]
    if max(q["step"] for q in curve) > budget:
        chosen = next(q for q in curve if q["step"] == validation["selected_step"])
        rows.append((f"{name}-long", curve, chosen, str(final)))
    return [{"name": label, "steps": max(q["step"] for q in p), "selected_step": c["step"], "best_val_tau": c["tau"],
             "val_curve": [{"step": q["step"], "tau": q["tau"]} for q in p], "path": path}
            for label, p, c, path in rows]


def evaluate(args, cfg, out: Path, sup: list[int]) -> dict:
    from specforge_opd.models.drafter import read_drafter_metadata
    from specforge_opd.precision import machine_info

    base = Path(cfg.resolve_path(cfg.output.dir))
    speed = bench_speed(cfg.training.num_anchors)
    budget = args.steps or cfg.sft.pause_at_step
    if budget is None:
        sys.exit(f"{args.config}: no sft.pause_at_step, so no budget per point; pass --steps N")
    per_step = cfg.training.num_anchors * cfg.draft.block_size
    points = []
    for name in args.points:
        final = (base if name == BASE_POINT else out / name) / "final"
        if not final.is_dir():
            print(f"[scaling] {name}: no export yet, left out", flush=True)
            continue
        _, what = point_overrides(name, sup, args.base_tokens)
        for row in budget_and_long(name, read_drafter_metadata(final)["validation"], budget, final):
            points.append({**row, **what, "trained_positions_nominal": row["steps"] * per_step,
                           "positions_per_s_bf16_stored": speed.get(what["layers"])})
    top = shipped_rows(args, out, points)
    best = max(points, key=lambda q: q["eval"]["mean_tau"]) if points else None
    return {"machine": machine_info(), "command": sys.argv, "config": args.config, "base_tokens": args.base_tokens,
            **top, "best_point": best and best["name"], "points": points}


def own_run_point(spec: str, args) -> list[dict]:
    """The rows of a point trained by its own config (``NAME=CONFIG``): budget row and, past it, ``NAME-long``.

    The budget is ``--steps`` or the config's ``sft.pause_at_step``. The row records what the
    run trained on: ``layers``, ``train_samples``, ``response_tokens`` (supervised, as the
    curve points count them), ``data_multiple`` against ``--base-tokens``, the config and its
    ``data.train_sources`` / ``data.source_limits``.

    Raises:
        SystemExit: ``spec`` is not ``NAME=CONFIG``, the run has no export, or no budget.
    """
    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import read_drafter_metadata

    name, sep, config = spec.partition("=")
    if not sep or not name or not config:
        sys.exit(f"--run {spec!r}: expected NAME=CONFIG, e.g. mix-l3=configs/small/sft_mix_l3.yaml")
    cfg = load_config(ROOT / config)
    final = Path(cfg.resolve_path(cfg.output.dir)) / "final"
    if not final.is_dir():
        sys.exit(f"--run {name}: {final} has no export; run scripts/train_sft.sh {config} first")
    budget = args.steps or cfg.sft.pause_at_step
    if budget is None:
        sys.exit(f"--run {name}: {config} has no sft.pause_at_step, so no budget; pass --steps N")
    _, sup = shared_run(cfg, config)
    speed = bench_speed(cfg.training.num_anchors)
    per_step = cfg.training.num_anchors * cfg.draft.block_size
    what = {"layers": cfg.draft.num_hidden_layers, "train_samples": len(sup), "response_tokens": sum(sup),
            "data_multiple": sum(sup) / args.base_tokens, "config": config,
            "train_sources": list(cfg.data.train_sources), "source_limits": dict(cfg.data.source_limits or {})}
    return [{**row, **what, "trained_positions_nominal": row["steps"] * per_step,
             "positions_per_s_bf16_stored": speed.get(what["layers"])}
            for row in budget_and_long(name, read_drafter_metadata(final)["validation"], budget, final)]


def merge_points(table: dict, rows: list[dict]) -> dict:
    """``table`` with ``rows`` in its ``points``: a point of the same name is replaced in place, a new
    one appended; ``best_point`` is recomputed over every point's held-out mean tau."""
    new = {r["name"]: r for r in rows}
    points = [new.pop(p["name"], p) for p in table.get("points", [])] + list(new.values())
    best = max(points, key=lambda q: q["eval"]["mean_tau"]) if points else None
    return {**table, "points": points, "best_point": best and best["name"]}


def bench_speed(num_anchors: int) -> dict:
    """Positions/s per drafter depth from ``bench_sft.json`` (bf16, stored objective, ``num_anchors``)."""
    bench = json.loads((ROOT / "benchmarks/results/bench_sft.json").read_text())
    return {r["layers"]: r["positions_per_s"] for r in bench["rows"]
            if r.get("objective") == "stored" and r["dtype"] == "bf16" and r["num_anchors"] == num_anchors}


def shipped_rows(args, out: Path, points: list[dict], label_: str = "eval") -> dict:
    """Replay the shipped and the previous published drafter, prompt lookup and ``points`` (each gets its ``eval``).

    Every prompt of the eval config's sets, on one trajectory cache (``--cache-dir``), so every row
    is paired. Returns the table's top level: ``eval`` (sets, tokens, method), ``published_name``,
    ``published_mean_tau``, ``published``, ``previous_name``, ``previous_mean_tau``, ``previous``,
    ``prompt_lookup_mean_tau``, ``prompt_lookup`` (each row: per-set ``tau``, ``mean_tau``, ``ci95``,
    2000 bootstrap replicates over prompts).
    """
    from specforge_opd.eval.stats import bootstrap_mean_tau, counts_of, interval

    drafters = ["--drafter", f"published={PUBLISHED}", "--drafter", f"previous={PREVIOUS}"]
    for pt in points:
        drafters += ["--drafter", f"{pt['name']}={pt['path']}"]
    label_ = label_ if points else "eval_shipped"
    ev = out / label_
    sh([PY, "-m", "specforge_opd.cli", "eval", "-c", args.eval_config, "--out", str(ev), "--overwrite", "eval.speedup=false",
        "eval.num_prompts=null", "eval.batch_size=16", f"eval.cache_dir={ROOT / args.cache_dir}", *drafters],
       out / "logs" / f"{label_}.log")
    result = json.loads((ev / "eval.json").read_text())
    ngram = next(n for n in result["drafters"] if n.startswith("prompt lookup"))
    names = ["published", "previous", *(pt["name"] for pt in points), ngram]
    reps = bootstrap_mean_tau({n: counts_of(result, n) for n in names}, replicates=2000, seed=0)
    sets = list(result["drafters"]["published"]["datasets"])

    def row(n):
        taus = {ds: result["drafters"][n]["datasets"][ds]["tau"] for ds in sets}
        lo, hi = interval(reps[n])
        return {"tau": taus, "mean_tau": sum(taus.values()) / len(taus), "ci95": [lo, hi]}

    for pt in points:
        pt["eval"] = row(pt["name"])
    pub, prev, ng = row("published"), row("previous"), row(ngram)
    return {"eval": {"sets": {ds: result["drafters"]["published"]["datasets"][ds]["num_prompts"] for ds in sets},
                     "max_new_tokens": result["eval"]["max_new_tokens"], "method": result.get("method")},
            "published_name": PUBLISHED, "published_mean_tau": pub["mean_tau"], "published": pub,
            "previous_name": PREVIOUS, "previous_mean_tau": prev["mean_tau"], "previous": prev,
            "prompt_lookup_mean_tau": ng["mean_tau"], "prompt_lookup": ng}


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for pt in table["points"]:
        xs = [q["step"] * 1024 / 1e6 for q in pt["val_curve"]]
        a.plot(xs, [q["tau"] for q in pt["val_curve"]], marker="o", label=f"{pt['name']} ({pt['layers']} layer, "
               f"{pt['data_multiple']:.1f}x data)")
    a.set_xlabel("trained drafter positions (M, nominal)")
    a.set_ylabel("validation tau (held-out pool prompts)")
    a.legend(fontsize=7)
    long = [q for q in table["points"] if q["name"].endswith("-long")]
    budget = [q for q in table["points"] if q not in long]
    data = [q for q in budget if q["layers"] == 1]
    b.plot([q["data_multiple"] for q in data], [q["eval"]["mean_tau"] for q in data], marker="o", label="1 layer")
    for q in budget:
        if q["layers"] > 1:
            b.scatter([q["data_multiple"]], [q["eval"]["mean_tau"]], marker="s", label=f"{q['name']} ({q['layers']} layers)")
    for q in long:
        b.scatter([q["data_multiple"]], [q["eval"]["mean_tau"]], marker="*", s=120,
                  label=f"{q['name']} ({q['steps'] * 1024 / 1e6:.0f}M positions)")
    b.axhline(table["prompt_lookup_mean_tau"], ls="--", c="gray", label="prompt lookup")
    b.axhline(table["published_mean_tau"], ls=":", c="k", label=f"published ({label(table)})")
    if table.get("previous"):
        b.axhline(table["previous_mean_tau"], ls=":", c="gray", label=f"previous ({label(table, 'previous')})")
    b.set_xlabel("response tokens (x the published drafter's)")
    b.set_ylabel("mean tau, three eval sets")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _line_fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares line ``y = intercept + slope * x`` over at least two points, with its largest residual."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct x values, got {xs}")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return {"slope": slope, "intercept": intercept, "points": n,
            "max_residual": max(abs(y - intercept - slope * x) for x, y in zip(xs, ys))}


def extrapolate(table: dict, goal: float = GOAL_TAU) -> dict:
    """What the curves predict for 10x more data or depth, from the recorded points (no new runs).

    Fits, each on mean held-out tau (the three evaluation sets), linear in log10 of the varied
    quantity (the data points' gains shrink with each doubling, so a line in tokens would
    overpredict):

    * ``data_at_budget``: the fixed-budget points of one layer and the base recipe (``data1x`` ..
      ``data4x``, about 1M positions each), tau against log10 response tokens;
    * ``data_long``: the two long runs of ``LONG_DATA_PAIR`` (same warm start and constant LR,
      4.1x apart in tokens), tau against log10 response tokens;
    * ``depth_at_budget``: the fixed-budget points on the largest base data (1, 2, 3 layers),
      tau against log10 layers, and linear per layer.

    Predictions add each slope to the shipped drafter's mean tau (``published_mean_tau``): at 10x
    its response tokens, at 10x its depth (30 layers, the target's own depth), and the token
    multiple each data slope needs to reach ``goal``. They assume the slopes carry over to the
    shipped recipe (warm start, anneal), which they were not measured at: extrapolations, not
    measurements. Returns ``{fit name: {slope, intercept, points, max_residual, unit}, "predict":
    {...}}``; a fit whose points are not in ``table`` is left out.
    """
    import math

    pts = {p["name"]: p for p in table["points"]}
    tau = lambda p: p["eval"]["mean_tau"]  # noqa: E731
    base = [p for p in table["points"] if not p.get("config") and not p["name"].endswith("-long")]
    fits: dict = {}
    data = [p for p in base if p["layers"] == 1]
    if len({p["response_tokens"] for p in data}) >= 2:
        fits["data_at_budget"] = dict(_line_fit([math.log10(p["response_tokens"]) for p in data], [tau(p) for p in data]),
                                      unit="tau per 10x response tokens", names=[p["name"] for p in data])
    if all(n in pts for n in LONG_DATA_PAIR):
        pair = [pts[n] for n in LONG_DATA_PAIR]
        fits["data_long"] = dict(_line_fit([math.log10(p["response_tokens"]) for p in pair], [tau(p) for p in pair]),
                                 unit="tau per 10x response tokens", names=list(LONG_DATA_PAIR))
    if base:
        most = max(p["response_tokens"] for p in base)
        deep = sorted((p for p in base if p["response_tokens"] == most), key=lambda p: p["layers"])
        if len({p["layers"] for p in deep}) >= 2:
            fits["depth_at_budget"] = dict(_line_fit([math.log10(p["layers"]) for p in deep], [tau(p) for p in deep]),
                                           unit="tau per 10x layers", names=[p["name"] for p in deep],
                                           per_layer=_line_fit([p["layers"] for p in deep], [tau(p) for p in deep])["slope"])
    shipped = table["published_mean_tau"]
    predict: dict = {"from": shipped, "goal": goal}
    for name in ("data_at_budget", "data_long"):
        if name in fits and fits[name]["slope"] > 0:
            k = fits[name]["slope"]
            predict[name] = {"at_10x_tokens": shipped + k, "tokens_multiple_for_goal": 10 ** ((goal - shipped) / k)}
    if "depth_at_budget" in fits:
        predict["depth_at_budget"] = {"at_10x_layers": shipped + fits["depth_at_budget"]["slope"]}
    return {**fits, "predict": predict}


def render_extrapolation(ex: dict) -> str:
    """The README's lines for ``extrapolate``'s result."""
    p = ex["predict"]
    lines = [f"Extrapolation from the shipped drafter's {p['from']:.3f} (fits linear in log10 of the varied quantity; "
             "predictions, not measurements):", "",
             "| fit | points | slope | largest residual | at 10x | multiple for " + f"{p['goal']:.1f} |",
             "|---|---|---:|---:|---:|---:|"]
    for name in ("data_at_budget", "data_long", "depth_at_budget"):
        if name not in ex:
            continue
        f, q = ex[name], p.get(name, {})
        at = q.get("at_10x_tokens", q.get("at_10x_layers"))
        need = q.get("tokens_multiple_for_goal")
        lines.append(f"| {name} | {', '.join(f['names'])} | {f['slope']:+.3f} {f['unit']} | {f['max_residual']:.3f} | "
                     + (f"{at:.3f}" if at is not None else "-") + " | "
                     + (f"{need:.2g}x the tokens" if need is not None else "-") + " |")
    return "\n".join(lines)


def label(table: dict, key: str = "published") -> str:
    """The short name of a published row: the suffix after ``smollm2-135m-instruct-dflash-`` (a result
    written before the successor shipped has no name: its published row is ``b8``)."""
    name = table.get(f"{key}_name", "published:smollm2-135m-instruct-dflash-b8")
    return name.split("dflash-", 1)[-1]


def render(table: dict) -> str:
    sets = list(table["eval"]["sets"])
    lines = [f"Mean tau over every prompt of {', '.join(f'{s} ({n})' for s, n in table['eval']['sets'].items())}, "
             f"exact offline replay at T=0, {table['eval']['max_new_tokens']} new tokens, 95% bootstrap intervals.", "",
             "| drafter | layers | response tokens | steps (best) | val tau | " + " | ".join(sets) + " | mean tau [95% CI] |",
             "|---|---:|---:|---:|---:|" + "---:|" * (len(sets) + 1)]
    ci = lambda r: f"**{r['mean_tau']:.3f}** [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"  # noqa: E731
    shipped = [(f"published ({label(table)})", table["published"])]
    if table.get("previous"):
        shipped.append((f"previous ({label(table, 'previous')})", table["previous"]))
    for name, r in (*shipped, ("prompt lookup", table["prompt_lookup"])):
        lines.append(f"| {name} | - | - | - | - | " + " | ".join(f"{r['tau'][s]:.3f}" for s in sets) + f" | {ci(r)} |")
    for pt in table["points"]:
        lines.append(f"| {pt['name']} | {pt['layers']} | {pt['response_tokens'] / 1e3:.0f}K ({pt['data_multiple']:.1f}x) | "
                     f"{pt['steps']} ({pt['selected_step']}) | {pt['best_val_tau']:.3f} | "
                     + " | ".join(f"{pt['eval']['tau'][s]:.3f}" for s in sets) + f" | {ci(pt['eval'])} |")
    own = [pt for pt in table["points"] if pt.get("config")]
    if own:
        lines += ["", "Points with their own recipe (their validation prompts are their own mix's, so their val tau "
                  "compares only within the run; the three evaluation sets compare every row): "
                  + "; ".join(f"{pt['name']}: `{pt['config']}`, sources {', '.join(pt['train_sources'])}" for pt in own
                              if not pt["name"].endswith("-long")) + "."]
    if table.get("extrapolation"):
        lines += ["", render_extrapolation(table["extrapolation"])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
