"""OPD at scale against the fair SFT baselines on the embedded target: the OPD study's table.

Per pool size (``--pools``) and seed (``--seeds``):

1. every OPD variant (``--variants``) from the published drafter with
   ``configs/small/opd.yaml`` at ``data.num_prompts=POOL`` (``scripts/train_opd.sh``; each
   selects its best refresh on the config's held-out validation prompts);
2. the fair SFT baselines (``stages/baselines.py``: the start's own recipe, on the OPD
   pool's responses and on fresh conversations), matched to the FLOPs of the seed's Eq. 1
   run (``--match``), each at the matched FLOPs and at its best validation point;
3. exact offline replay at T=0 of every drafter on every prompt of the three evaluation
   sets (paired 95% bootstrap intervals over prompts), on the OPD validation prompts
   (held out for every run) and on the first ``--in-sample`` prompts of the OPD pool
   (in-sample for OPD and the ``opd_pool`` baseline, held out for the others).

Every training run resumes when the command is run again (kill it at any point); a
finished one is reused. ``--phase train`` only trains, ``--phase eval`` only measures.

Every row of ``--json`` keeps its per-prompt counts (tokens and verify steps of each prompt),
so a later session compares new drafters with rows whose weights it no longer has, paired on
the same prompts, and ``--match-from`` trains the fair baselines of an OPD run that is only
recorded there (its FLOPs and refresh count), without training it again:

    .venv/bin/python benchmarks/bench_opd_at_scale.py --pools 1024 --seeds 1 --variants naive \
        --match naive --match-from benchmarks/results/opd_at_scale.json [--phase train|eval --json ...]

    .venv/bin/python benchmarks/bench_opd_at_scale.py --pools 192 --seeds 0 \\
        [--variants eq1_full naive ...] [--json benchmarks/results/opd_at_scale.json]

Run it alone: rollouts and training dominate (a 192-prompt pilot of one variant is about
20 minutes on the 2-core machine); tau does not depend on load, wall times do.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")

#: The OPD variants of the study: name -> overrides of configs/small/opd.yaml.
VARIANTS = {
    "eq1_full": [],  # paper Eq. 1 with the exact target distribution
    "eq1_token_pooled": ["rollout.teacher=token", "training.combine=pooled"],  # the authors' realized-token estimators
    "verified_stream": ["training.accepted_stream=verified"],  # the authors' accepted stream (bonus slot too)
    "naive": ["training.loss=naive_target_assisted"],
    "all_forward": ["training.loss=all_forward"],
    # the start drafter's own optimizer settings (constant lr 1e-3), which the fair baselines
    # continue with, in place of the paper's lr 3e-4 cosine: the same step size on both sides
    "eq1_full_start_lr": ["training.learning_rate=1e-3", "training.lr_scheduler=constant"],
    "naive_start_lr": ["training.loss=naive_target_assisted", "training.learning_rate=1e-3",
                       "training.lr_scheduler=constant"],
    # a start whose recipe ended by annealing its LR to 0 (the shipped -b8-mixv2-l3): the paper's peak of 3e-4
    # knocks it off its minimum (validation tau dips at the peak and recovers as the cosine decays), so a
    # peak about where the start's own anneal still gained; its baselines take the same peak
    # (--baseline-overrides training.learning_rate=1e-4 --baseline-tag lr1e-4)
    "eq1_full_lr1e-4": ["training.learning_rate=1e-4"],
    "naive_lr1e-4": ["training.loss=naive_target_assisted", "training.learning_rate=1e-4"],
}
SOURCES = ("opd_pool", "fresh")


def sh(args: list[str], log: Path) -> None:
    """Run a resumable stage, its output to ``log``; raises on failure with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(args), f"> {log}", flush=True)
    with open(log, "a") as f:
        rc = subprocess.call(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"{args[0]} exited with {rc}; rerun this command to resume. Log tail:\n{tail}")


def seed_overrides(seed: int) -> list[str]:
    """A seed varies the OPD training, the pool's order and the rollout sampler (as bench_comparison.py)."""
    return [f"training.seed={seed}", f"data.seed={seed + 1}", f"rollout.seed={seed}"]


def pool_overrides(pool: int, out: str = "runs/opd_scale") -> list[str]:
    """The pool size, and one trajectory cache for every run's validation and evaluation (paid once)."""
    return [f"data.num_prompts={pool}", f"eval.cache_dir={Path(out) / 'trajectory_cache'}"]


def train(args, pool: int, seed: int) -> dict[str, dict]:
    """Train every OPD variant and fair baseline of (pool, seed); returns {row name: drafter info}.

    The baselines run as soon as the variant they match (``--match``) has finished, so a
    study cut short still has the comparison that matters most.
    """
    base = Path(args.out) / f"p{pool}"
    ov = pool_overrides(pool, args.out) + seed_overrides(seed)
    rows: dict[str, dict] = {}
    for v in args.variants:
        run = base / f"{v}-s{seed}"
        # the baselines' match may be a run recorded in --match-from and no longer on disk: it is not trained again
        recorded = bool(args.match_from) and v == args.match and not (run / "final").is_dir()
        if args.phase != "eval" and not recorded:  # a finished run is only read back
            sh(["bash", "scripts/train_opd.sh", args.opd_config, f"output.dir={run}", *VARIANTS[v], *ov],
               base / "logs" / f"{v}-s{seed}.log")
        if (run / "final").is_dir():
            rows.update(opd_rows(run, f"OPD {v}", pool, seed))
        if v == args.match and recorded:
            flops, points = recorded_budget(json.loads(Path(args.match_from).read_text()), f"OPD {v}", pool, seed,
                                            refreshes(args, pool, seed))
            rows.update(baselines(args, None, pool, seed, ov, opd_flops=flops, val_points=points))
        elif v == args.match and (run / "final").is_dir():
            rows.update(baselines(args, run, pool, seed, ov))
    return rows


def refreshes(args, pool: int, seed: int) -> int:
    """The OPD recipe's refresh count at ``pool`` prompts (``stages.plan``: ceil(pool x epochs / prompts per
    iteration)), each followed by a validation point."""
    from specforge_opd.config import load_config

    cfg = load_config(ROOT / args.opd_config, pool_overrides(pool, args.out) + seed_overrides(seed))
    return math.ceil(pool * cfg.training.num_epochs / cfg.opd.prompts_per_iteration)


def recorded_budget(table: dict, name: str, pool: int, seed: int, points: int) -> tuple[float, int]:
    """(drafter-training FLOPs, validation points) of the OPD run ``name`` at (pool, seed) as recorded in a
    result table: its last refresh's cumulative FLOPs (the best-validation row's where the best is the last)
    less the start's, which is what ``stages.baselines.opd_drafter_flops`` reads from a run on disk.

    Raises:
        SystemExit: the table has no such row, or no FLOPs for it or for the start.
    """
    rows = {r["drafter"]: r for r in table.get("rows", [])}
    start = next((r for r in rows.values() if r["kind"] == "start"), None)
    row = rows.get(f"{name} last p{pool} s{seed}") or rows.get(f"{name} best-val p{pool} s{seed}")
    if row is None or start is None or not row.get("drafter_flops") or not start.get("drafter_flops"):
        raise SystemExit(f"--match-from: no '{name} last p{pool} s{seed}' (or best-val) row with drafter_flops beside "
                         "the start's; train the OPD run itself (drop --match-from)")
    return row["drafter_flops"] - start["drafter_flops"], points


def baselines(args, match: Path | None, pool: int, seed: int, ov: list[str], **budget) -> dict[str, dict]:
    """The fair SFT baselines matched to the OPD run ``match`` (``stages.baselines.run_fair_sft``), or to the
    recorded budget ``budget`` (``opd_flops``, ``val_points``) of one no longer on disk."""
    from specforge_opd.stages.baselines import run_fair_sft

    rows: dict[str, dict] = {}
    for source in args.baselines:
        out = baseline_dir(Path(args.out) / f"p{pool}", source, args.baseline_tag, seed)
        if args.phase == "eval" and not (out / "final").is_dir():
            continue
        # the user's overrides come after the start's recipe in run_fair_sft: they change it on purpose
        res = run_fair_sft(args.sft_config, args.opd_config, source=source, out=out, opd_out=match,
                           overrides=ov + list(args.baseline_overrides), **budget)
        rows.update(baseline_rows(res, baseline_label(source, args.baseline_tag), pool, seed))
    return rows


def opd_rows(run: Path, name: str, pool: int, seed: int) -> dict[str, dict]:
    """The selected (best validation) refresh and the last one (the run's full FLOPs) of an OPD run."""
    from specforge_opd.models.drafter import read_drafter_metadata

    meta = read_drafter_metadata(run / "final")
    curve = (meta.get("validation") or {}).get("curve") or []
    last = max(curve, key=lambda p: p["step"]) if curve else None
    sel = (meta.get("validation") or {}).get("selected_refresh")
    out = {f"{name} best-val p{pool} s{seed}": {"path": str(run / "final"), "kind": "opd", "select": "best_val", "pool": pool,
                                         "seed": seed, "drafter_flops": meta["flops"]["drafter_budget"], "refresh": sel}}
    if last is not None and last["step"] != sel:
        out[f"{name} last p{pool} s{seed}"] = {"path": last["export"], "kind": "opd", "select": "last", "pool": pool,
                                       "seed": seed, "drafter_flops": last["drafter_flops"], "refresh": last["step"]}
    return out


def baseline_label(source: str, tag: str | None, sep: str = " ") -> str:
    """A baseline's source, with the tag of a changed recipe (``--baseline-tag``) when there is one: its rows and
    run directory never mix with the start's-own-recipe baseline of the same source."""
    return f"{source}{sep}{tag}" if tag else source


def baseline_dir(pool_dir: Path, source: str, tag: str | None, seed: int) -> Path:
    """Where one fair baseline of a (pool, seed) runs: the training phase and the curves read the same place."""
    return pool_dir / f"sft-{baseline_label(source, tag, '-')}-s{seed}"


def baseline_rows(res: dict, source: str, pool: int, seed: int) -> dict[str, dict]:
    """The matched-FLOPs and best-validation drafters of one fair baseline."""
    by_step = {p["step"]: p for p in res["curve"]}
    name = f"SFT fair {source}"
    out = {f"{name} matched p{pool} s{seed}": {"path": str(res["matched"]), "kind": "sft", "select": "matched", "pool": pool,
                                        "seed": seed, "drafter_flops": by_step[res["steps"]]["drafter_flops"],
                                        "step": res["steps"]}}
    if res["selected_step"] != res["steps"]:
        out[f"{name} best-val p{pool} s{seed}"] = {"path": str(res["best_val"]), "kind": "sft", "select": "best_val",
                                           "pool": pool, "seed": seed,
                                           "drafter_flops": by_step[res["selected_step"]]["drafter_flops"],
                                           "step": res["selected_step"]}
    else:  # the best point is the matched one
        out[f"{name} matched p{pool} s{seed}"]["best_val"] = True
    return out


def stored_tau(path: Path, name: str, replay) -> float:
    """The tau stored at ``path``, or ``replay()``'s, then stored there (atomically) for the next eval phase."""
    if path.is_file():
        return float(json.loads(path.read_text())["tau"])
    tau = float(replay())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"name": name, "tau": tau}) + "\n")
    tmp.replace(path)
    return tau


def replay_sets(args, drafters: dict[str, dict], pool: int, seed: int) -> None:
    """Add ``val_tau`` (OPD validation prompts) and ``pool_tau`` (first --in-sample OPD pool prompts) to each row."""
    import torch

    from specforge_opd.config import load_config
    from specforge_opd.data.prompts import held_out_prompts, prompt_token_ids, training_pool
    from specforge_opd.eval.validation import ValidationSet
    from specforge_opd.models.drafter import load_any_drafter
    from specforge_opd.models.target import load_target

    cfg = load_config(ROOT / args.opd_config, pool_overrides(pool, args.out) + seed_overrides(seed))
    bundle = load_target(cfg.target)
    tok = bundle.tokenizer

    def ids(records):
        return [prompt_token_ids(tok, r, cfg) for r in records]

    val = held_out_prompts(cfg.data, cfg.opd.val_prompts, field="opd.val_prompts", cache=cfg.target.cache_dir, tokenizer=tok)
    train = training_pool(cfg.data, cache=cfg.target.cache_dir, tokenizer=tok)[: args.in_sample]
    cache = Path(args.out) / "trajectory_cache"
    sets = {"val_tau": ValidationSet(bundle.model, bundle.identity, ids(val), max_new_tokens=cfg.rollout.max_new_tokens,
                                     stop_token_ids=list(bundle.stop_token_ids), cache_dir=cache),
            "pool_tau": ValidationSet(bundle.model, bundle.identity, ids(train), max_new_tokens=cfg.rollout.max_new_tokens,
                                      stop_token_ids=list(bundle.stop_token_ids), cache_dir=cache)}
    # a set's replay of the same weights is read back from the store (T=0 replay is deterministic)
    store = Path(args.out) / STORE
    store.mkdir(parents=True, exist_ok=True)
    set_settings = {k: {"prompts": p, "max_new_tokens": cfg.rollout.max_new_tokens, "target": replay_settings(cfg)["target"]}
                    for k, p in (("val_tau", ids(val)), ("pool_tau", ids(train)))}
    for name, d in drafters.items():
        if d.get("seed", seed) != seed or d.get("pool", pool) != pool or "val_tau" in d:
            continue
        digest = weights_digest(d["path"])
        files = {k: store / f"set-{replay_key(set_settings[k], digest)}.json" for k in sets}
        loaded = []

        def drafter():
            if not loaded:
                loaded.append(load_any_drafter(d["path"], bundle.model.config).eval())
            return loaded[0]

        for k, vs in sets.items():
            with torch.no_grad():
                d[k] = stored_tau(files[k], name, lambda vs=vs: vs.tau(drafter()))
        print(f"  {name}: validation tau {d['val_tau']:.3f}, OPD-pool tau {d['pool_tau']:.3f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pools", type=int, nargs="+", default=[192])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--baselines", nargs="*", default=list(SOURCES), choices=list(SOURCES))
    p.add_argument("--match", default="eq1_full", choices=list(VARIANTS), help="the OPD variant the baselines match in FLOPs")
    p.add_argument("--match-from", metavar="JSON", default=None,
                   help="where the --match run is not on disk: take its FLOPs from this result (e.g. "
                   "benchmarks/results/opd_at_scale.json) and train only the baselines")
    p.add_argument("--baseline-overrides", nargs="+", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change the baselines' recipe (the start's own by default), e.g. training.learning_rate=1e-4 "
                   "to match an OPD variant's step size; needs --baseline-tag")
    p.add_argument("--baseline-tag", default=None, help="names the changed recipe in the baselines' rows and directories")
    p.add_argument("--sft-config", default="configs/small/sft.yaml")
    p.add_argument("--opd-config", default="configs/small/opd.yaml")
    p.add_argument("--out", default="runs/opd_scale")
    p.add_argument("--phase", choices=["all", "train", "eval", "curves"], default="all",
                   help="curves: only collect every finished or running run's validation curve into --json")
    p.add_argument("--in-sample", type=int, default=64, help="OPD pool prompts replayed for the in-sample tau")
    p.add_argument("--eval-prompts", type=int, default=None, help="prompts per eval set (default: all of them)")
    p.add_argument("--replicates", type=int, default=2000)
    p.add_argument("--json", help="write the table's data here (e.g. benchmarks/results/opd_at_scale.json); the rows of other "
                   "(pool, seed) pairs already in that file are kept (merge)")
    p.add_argument("--import-eval", nargs="+", default=[], metavar="EVAL_JSON",
                   help="store the replays of eval.json files written before the replay store (then exit)")
    args = p.parse_args()
    if bool(args.baseline_overrides) != bool(args.baseline_tag):
        p.error("--baseline-overrides and --baseline-tag go together: a changed recipe needs its own rows and directories")
    out = ROOT / args.out
    if args.import_eval:
        for f in args.import_eval:
            import_eval(args, out, Path(f))
        return 0
    if args.phase == "curves":
        table = collect_curves(args)
        print(json.dumps(table["runs"], indent=1))
        if args.json and Path(args.json).is_file():  # keep the curves of runs this checkout no longer has
            table["runs"] = {**json.loads(Path(args.json).read_text()).get("runs", {}), **table["runs"]}
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
        return 0

    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import drafter_path

    start = load_config(ROOT / args.opd_config).draft.path
    drafters: dict[str, dict] = {"start": {"path": str(drafter_path(start)), "kind": "start", "select": "-"}}
    for pool in args.pools:
        for seed in args.seeds:
            drafters.update(train(args, pool, seed))
    if args.phase == "train":
        return 0
    from specforge_opd.models.drafter import read_drafter_metadata

    drafters["start"]["drafter_flops"] = (read_drafter_metadata(drafters["start"]["path"]).get("flops") or {}).get("drafter_budget")
    for pool in args.pools:
        for seed in args.seeds:
            replay_sets(args, drafters, pool, seed)
            # each (pool, seed) has its own validation prompts: the start keeps one pair per run it is compared with
            st = drafters["start"]
            st.setdefault("sets", {})[f"p{pool} s{seed}"] = {"val_tau": st.pop("val_tau"), "pool_tau": st.pop("pool_tau")}
    result = evaluate_all(args, drafters, out)
    committed = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).is_file() else None
    if committed:
        add_recorded(committed, drafters, result)
    table = summarize(result, drafters, args)
    if committed:
        table = merge(committed, table)
    (out / "opd_at_scale.md").write_text(render(table) + "\n")
    print(render(table))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
        png = plot_scale_curve(table, Path(args.json).with_name(Path(args.json).stem + "_scale_curve.png"))
        if png:
            print(f"[opd_at_scale] scale curve: {png}", flush=True)
    return 0


#: Eval settings that decide a drafter's replay; a stored replay is reused only under equal ones (and equal target).
REPLAY_SETTINGS = ("datasets", "num_prompts", "max_new_tokens", "temperature", "seeds", "mode", "ngram", "ngram_max",
                   "cache_dir")
STORE = "eval_store"
PROMPT_LOOKUP = "prompt-lookup"


def weights_digest(path: str | Path) -> str:
    """sha256 over a drafter directory's weights and config (``*.safetensors``, ``config.json``), file names included."""
    import hashlib

    h = hashlib.sha256()
    d = Path(path)
    for f in sorted([*d.glob("*.safetensors"), d / "config.json"]):
        if f.is_file():
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def replay_key(settings: dict, digest: str) -> str:
    """The store key of one replay: ``settings`` (``replay_settings``) and the drafter's weights digest."""
    import hashlib

    return hashlib.sha256(json.dumps({**settings, "weights": digest}, sort_keys=True).encode()).hexdigest()[:24]


def replay_settings(cfg) -> dict:
    """What decides a replay's result besides the drafter: the target section and the eval settings."""
    # threads, prefill chunking and the weight cache's place change no token of a T=0 replay
    target = {k: v for k, v in cfg.target.model_dump(mode="json").items() if k not in ("threads", "prefill_chunk", "cache_dir")}
    return {"target": target,
            "eval": {k: v for k, v in cfg.eval.model_dump(mode="json").items() if k in REPLAY_SETTINGS}}


def import_eval(args, out: Path, path: Path) -> int:
    """Put the drafters of an ``eval.json`` written before the store into it (``--import-eval``).

    An entry is taken only where the file's eval settings and target equal this run's and the
    drafter's weights are not newer than the file (so they are the weights it replayed).
    Returns how many entries were stored.
    """
    from specforge_opd.config import load_config

    prompts_ov = f"eval.num_prompts={'null' if args.eval_prompts is None else args.eval_prompts}"
    cfg = load_config(ROOT / args.opd_config, [prompts_ov, f"eval.cache_dir={out / 'trajectory_cache'}"])
    settings = replay_settings(cfg)
    old = json.loads(path.read_text())
    theirs = {k: v for k, v in old["eval"].items() if k in REPLAY_SETTINGS}
    if theirs != settings["eval"] or old["target"].get("thinking") != cfg.target.thinking:
        print(f"[opd_at_scale] {path}: other eval settings ({theirs}), nothing imported", flush=True)
        return 0
    store, n = out / STORE, 0
    store.mkdir(parents=True, exist_ok=True)
    for name, entry in old["drafters"].items():
        if entry.get("path") is None:
            key = replay_key(settings, PROMPT_LOOKUP)
        else:
            d = ROOT / entry["path"]
            weights = [*d.glob("*.safetensors")]
            if not weights or max(f.stat().st_mtime for f in weights) > path.stat().st_mtime:
                continue
            key = replay_key(settings, weights_digest(d))
        rec = {"name": name, "entry": entry, "target": old["target"], "eval": old["eval"], "method": old.get("method")}
        (store / f"{key}.json").write_text(json.dumps(rec) + "\n")
        n += 1
    print(f"[opd_at_scale] {path}: {n} replays imported into {store}", flush=True)
    return n


def evaluate_all(args, drafters: dict[str, dict], out: Path) -> dict:
    """Exact offline replay of every drafter (and prompt lookup) on every prompt of the three sets.

    Each drafter's replay is kept in ``out/eval_store``, one JSON per ``replay_key`` (its weights'
    digest, the target and the eval settings), and read back when the same weights are replayed
    under the same settings: replay at T=0 is deterministic, so an eval phase pays only for
    drafters it has not replayed before (about 2 minutes each with a filled trajectory cache).

    Returns:
        An ``eval.json``-shaped dict (``target``, ``eval``, ``method``, ``drafters``) holding every
        drafter of ``drafters`` under its row name, plus prompt lookup.
    """
    from specforge_opd.config import load_config

    prompts_ov = f"eval.num_prompts={'null' if args.eval_prompts is None else args.eval_prompts}"
    cache_ov = f"eval.cache_dir={out / 'trajectory_cache'}"
    settings = replay_settings(load_config(ROOT / args.opd_config, [prompts_ov, cache_ov]))
    store = out / STORE
    keys = {name: replay_key(settings, weights_digest(d["path"])) for name, d in drafters.items()}
    keys[PROMPT_LOOKUP] = replay_key(settings, PROMPT_LOOKUP)
    found = {n: json.loads((store / f"{k}.json").read_text()) for n, k in keys.items() if (store / f"{k}.json").is_file()}
    missing = [n for n in drafters if n not in found]
    if missing or PROMPT_LOOKUP not in found:
        eval_args = []
        for name in missing or list(drafters)[:1]:
            eval_args += ["--drafter", f"{name}={drafters[name]['path']}"]
        ev = out / "eval"
        # eval.batch_size: the trajectory cache decodes in a continuous batch of that many rows (offline replay is
        # exact whatever the batch)
        sh([PY, "-m", "specforge_opd.cli", "eval", "-c", args.opd_config, "--out", str(ev), "--overwrite", "eval.speedup=false",
            prompts_ov, "eval.batch_size=16", cache_ov, *eval_args], out / "logs" / "eval.log")
        fresh = json.loads((ev / "eval.json").read_text())
        store.mkdir(parents=True, exist_ok=True)
        for name, entry in fresh["drafters"].items():
            own = PROMPT_LOOKUP if entry.get("path") is None else name
            found[own] = {"name": name, "entry": entry, "target": fresh["target"], "eval": fresh["eval"],
                          "method": fresh.get("method")}
            tmp = store / f".{keys[own]}.tmp"
            tmp.write_text(json.dumps(found[own]) + "\n")
            tmp.replace(store / f"{keys[own]}.json")
    print(f"[opd_at_scale] replayed {len(missing)} drafter(s); {len(drafters) - len(missing)} read back from {store}",
          flush=True)
    head = found[PROMPT_LOOKUP]
    return {"target": head["target"], "eval": head["eval"], "method": head["method"],
            "drafters": {**{n: found[n]["entry"] for n in drafters}, head["name"]: head["entry"]}}


def collect_curves(args) -> dict:
    """Every run's validation curve so far (OPD: ``opd_curve.jsonl``; baselines: the SFT train step's
    ``curve.jsonl``), all on the OPD run's held-out validation prompts: a record that survives the runs."""
    from specforge_opd.eval.validation import read_curve
    from specforge_opd.precision import machine_info
    from specforge_opd.stages.opd_validation import OPD_CURVE_FILE

    runs = {}
    for pool in args.pools:
        base = ROOT / args.out / f"p{pool}"
        for seed in args.seeds:
            for v in args.variants:
                curve = read_curve(base / f"{v}-s{seed}", OPD_CURVE_FILE)
                if curve:
                    runs[f"OPD {v} p{pool} s{seed}"] = {
                        "kind": "opd", "variant": v, "pool": pool, "seed": seed, "overrides": VARIANTS[v],
                        "finished": (base / f"{v}-s{seed}" / "final").is_dir(),
                        "curve": [{k: p[k] for k in ("step", "tau", "drafter_flops", "opd_flops")} for p in curve]}
            for source in args.baselines:
                run_dir = baseline_dir(base, source, args.baseline_tag, seed)
                train_dirs = sorted(run_dir.glob("train-*"))
                curve = read_curve(train_dirs[-1]) if train_dirs else []
                if curve:
                    runs[f"SFT fair {baseline_label(source, args.baseline_tag)} p{pool} s{seed}"] = {
                        "kind": "sft", "source": source, "pool": pool, "seed": seed,
                        "overrides": list(args.baseline_overrides), "finished": (run_dir / "final").is_dir(),
                        "curve": [{k: p[k] for k in ("step", "tau", "drafter_flops")} for p in curve]}
    for r in runs.values():
        best = max(r["curve"], key=lambda p: (p["tau"], -p["step"]))
        r["best_val_tau"], r["best_step"] = best["tau"], best["step"]
        r["last_val_tau"] = max(r["curve"], key=lambda p: p["step"])["tau"]
    return {"machine": machine_info(), "command": sys.argv, "config": args.opd_config,
            "note": "validation tau: exact offline replay at T=0 on the OPD config's held-out validation prompts "
                    "(opd.val_prompts after data.num_prompts of its pool); OPD step 0 is the start drafter",
            "runs": runs}


def add_recorded(committed: dict, drafters: dict[str, dict], result: dict) -> list[str]:
    """Add the committed rows that keep per-prompt ``counts`` and were not replayed now to ``drafters`` and
    ``result``, so that ``summarize`` compares them with this run's drafters paired on the same prompts.

    The committed start's counts must equal this run's (the same prompts and target trajectories); otherwise
    nothing is added and ``merge`` refuses the table. Returns the names added.
    """
    rows = committed.get("rows", [])
    start = next((r for r in rows if r["kind"] == "start"), None)
    here = result["drafters"].get("start", {}).get("datasets", {})
    now = {ds: [list(e.get("tokens_per_prompt", [])), list(e.get("steps_per_prompt", []))] for ds, e in here.items()}
    if start is None or start.get("counts") != now:
        return []
    added = []
    for r in rows:
        if r["kind"] == "start" or r["drafter"] in drafters or not r.get("counts"):
            continue
        drafters[r["drafter"]] = {k: r.get(k) for k in ("kind", "select", "pool", "seed", "drafter_flops", "val_tau",
                                                          "pool_tau", "path")}
        result["drafters"][r["drafter"]] = {"path": r["path"], "datasets": {
            ds: {"tau": r["tau"][ds], "num_prompts": len(t), "tokens_per_prompt": t, "steps_per_prompt": s}
            for ds, (t, s) in r["counts"].items()}}
        added.append(r["drafter"])
    return added


def summarize(result: dict, drafters: dict[str, dict], args) -> dict:
    """Rows (mean tau with its 95% interval over every prompt of the three sets, FLOPs, in-sample and held-out
    tau) and ratios (each OPD row over the start and over the best fair baseline of its pool and seed, paired)."""
    from specforge_opd.eval.stats import bootstrap_mean_tau, counts_of, interval
    from specforge_opd.precision import machine_info

    names = [n for n in drafters if n in result["drafters"] and result["drafters"][n]["datasets"]]
    reps = bootstrap_mean_tau({n: counts_of(result, n) for n in names}, replicates=args.replicates, seed=0)
    datasets = list(result["drafters"]["start"]["datasets"])
    rows = []
    for n in names:
        taus = {ds: result["drafters"][n]["datasets"][ds]["tau"] for ds in datasets}
        d = drafters[n]
        lo, hi = interval(reps[n])
        rows.append({"drafter": n, "kind": d["kind"], "select": d["select"], "pool": d.get("pool"), "seed": d.get("seed"),
                     "tau": taus, "mean_tau": sum(taus.values()) / len(taus), "ci95": [lo, hi],
                     "drafter_flops": d.get("drafter_flops"), "val_tau": d.get("val_tau"), "pool_tau": d.get("pool_tau"),
                     "path": d["path"], **({"sets": d["sets"]} if d.get("sets") else {}),
                     "counts": {ds: [list(t), list(s)] for ds, (t, s) in counts_of(result, n).items()}})
    by = {r["drafter"]: r for r in rows}
    ratios = []
    for r in rows:
        if r["kind"] != "opd":
            continue
        peers = [b for b in rows if b["kind"] == "sft" and b["pool"] == r["pool"] and b["seed"] == r["seed"]]
        # the best fair baseline: the highest mean tau among the baselines of the same pool and seed
        best = max(peers, key=lambda b: b["mean_tau"]) if peers else None
        entry = {"drafter": r["drafter"]}
        for key, other in (("over_start", by["start"]), ("over_best_baseline", best)):
            if other is None:
                continue
            ratio = reps[r["drafter"]] / reps[other["drafter"]]
            lo, hi = interval(ratio)
            entry[key] = {"against": other["drafter"], "ratio": r["mean_tau"] / other["mean_tau"], "ci95": [lo, hi]}
        ratios.append(entry)
    prompts = {ds: result["drafters"]["start"]["datasets"][ds]["num_prompts"] for ds in datasets}
    return {"machine": machine_info(), "command": sys.argv, "prompts": prompts, "datasets": datasets, "rows": rows,
            "ratios": ratios, "replicates": args.replicates,
            "eval": {"method": result.get("method"), "max_new_tokens": result["eval"]["max_new_tokens"]}}


def _pool_seed(row: dict) -> tuple:
    return row.get("pool"), row.get("seed")


def _named_by_pool(table: dict) -> dict:
    """``table`` with every row name carrying its pool (``... best-val p192 s0``), as rows are named now;
    tables written before named rows by seed only."""
    names = {}
    for r in table["rows"]:
        if r["kind"] != "start" and f" p{r['pool']} s" not in r["drafter"]:
            head, seed = r["drafter"].rsplit(" s", 1)
            names[r["drafter"]] = f"{head} p{r['pool']} s{seed}"
    if not names:
        return table
    ren = lambda n: names.get(n, n)  # noqa: E731
    out = dict(table)
    out["rows"] = [dict(r, drafter=ren(r["drafter"])) for r in table["rows"]]
    out["ratios"] = [{k: (ren(v) if k == "drafter" else dict(v, against=ren(v["against"])) if isinstance(v, dict) else v)
                      for k, v in e.items()} for e in table["ratios"]]
    return out


def merge(old: dict, new: dict) -> dict:
    """``new`` with the rows and ratios of ``old`` that ``new`` has no row of the same name for.

    A session replays the drafters it trained; earlier runs may be gone, so their rows are kept
    from the committed table (and compared with the new ones paired, where they keep their
    per-prompt counts: ``add_recorded``). Every row is measured on the same prompts of
    the same evaluation sets and the same target trajectories, so the start drafter's row must
    agree; a disagreement (other prompts, other target, other evaluation) is refused.

    Raises:
        ValueError: the two tables' start rows, prompts or evaluation settings differ.
    """
    old, new = _named_by_pool(old), _named_by_pool(new)
    start = lambda t: next(r for r in t["rows"] if r["kind"] == "start")  # noqa: E731
    for key in ("prompts", "eval"):
        if old.get(key) != new.get(key):
            raise ValueError(f"--json: the committed table has {key}={old.get(key)}, this run {new.get(key)}; "
                             "write this run to another --json file")
    if abs(start(old)["mean_tau"] - start(new)["mean_tau"]) > 1e-9:
        raise ValueError(f"--json: the start drafter's mean tau differs ({start(old)['mean_tau']:.6f} committed, "
                         f"{start(new)['mean_tau']:.6f} now): other trajectories; write this run to another --json file")
    # a row is replaced by the row of its name, else kept: a session that trains only the baselines of a
    # (pool, seed) keeps that pair's OPD rows, whose weights may be gone
    ran = {r["drafter"] for r in new["rows"]}
    kept = [r for r in old["rows"] if r["kind"] != "start" and r["drafter"] not in ran]
    names = {r["drafter"] for r in kept}
    out = dict(new)
    # the start's validation and pool tau per (pool, seed): this run's, and the committed ones of other runs
    sets = {**(start(old).get("sets") or {}), **(start(new).get("sets") or {})}
    out["rows"] = [dict(r, sets=sets) if r["kind"] == "start" and sets else r for r in new["rows"]] + kept
    out["ratios"] = new["ratios"] + [e for e in old["ratios"] if e["drafter"] in names]
    out["merged_from"] = sorted({f"p{p} s{s}" for p, s in (_pool_seed(r) for r in kept)})
    machines = old.get("machines", [old.get("machine")]) + [new.get("machine")]
    out["machines"] = [m for i, m in enumerate(machines) if m not in machines[:i]]
    return unpaired_baseline_ratios(out)


def unpaired_ratio(row: dict, other: dict) -> dict:
    """``row``'s mean tau over ``other``'s, with an approximate 95% interval from the two rows' own intervals.

    For rows without per-prompt counts (recorded before rows kept them, weights gone), so no paired
    bootstrap is possible. Each row's bootstrap interval gives a standard error on the log scale,
    (log hi - log lo) / 3.92; the two are treated as independent: se = sqrt(se_row^2 + se_other^2) and
    the interval is ratio * exp(+-1.96 se). Both rows are measured on the same prompts, whose errors
    correlate positively, so this interval is wider than the paired one would be.

    Returns:
        {"against": other's name, "ratio", "ci95": [lo, hi], "paired": False}
    """
    import math

    se = [(math.log(r["ci95"][1]) - math.log(r["ci95"][0])) / 3.92 for r in (row, other)]
    ratio = row["mean_tau"] / other["mean_tau"]
    half = 1.96 * math.hypot(*se)
    return {"against": other["drafter"], "ratio": ratio, "ci95": [ratio * math.exp(-half), ratio * math.exp(half)],
            "paired": False}


def unpaired_baseline_ratios(table: dict) -> dict:
    """``table`` with ``over_best_baseline`` made unpaired (``unpaired_ratio``) for each OPD row whose ratio over
    the best fair baseline of its pool and seed is missing or stale, while such baselines are in the table.

    A row recorded without per-prompt counts cannot be paired with one trained in a later session, so the
    paired ratio ``summarize`` gives is missing there, or stays from an earlier table while a better
    baseline (or a rerun of the same one) arrives. A paired ratio that still names the best baseline at its
    mean tau is left as it is; an unpaired one is computed again, so merging twice changes nothing.
    """
    rows = {r["drafter"]: r for r in table["rows"]}
    ratios = []
    for e in table["ratios"]:
        r = rows[e["drafter"]]
        peers = [b for b in table["rows"] if b["kind"] == "sft" and _pool_seed(b) == _pool_seed(r)]
        if peers:
            best = max(peers, key=lambda b: b["mean_tau"])
            cur = e.get("over_best_baseline")
            if (not cur or cur.get("paired") is False or cur["against"] != best["drafter"]
                    or abs(cur["ratio"] - r["mean_tau"] / best["mean_tau"]) > 1e-12):
                e = dict(e, over_best_baseline=unpaired_ratio(r, best))
        ratios.append(e)
    return dict(table, ratios=ratios)


def across_seeds(table: dict) -> list[dict]:
    """Per OPD variant, selection and pool: its ratio over the start and over the best fair baseline at each
    seed, and the lowest of them (the OPD study's goal holds at every seed); ``unpaired``: the seeds whose ratio
    over the best fair baseline is unpaired (``unpaired_ratio``)."""
    groups: dict[tuple, dict] = {}
    rows = {r["drafter"]: r for r in table["rows"]}
    for e in table["ratios"]:
        r = rows[e["drafter"]]
        name = e["drafter"].rsplit(" s", 1)[0].removesuffix(f" p{r['pool']}")
        g = groups.setdefault((name, r["pool"]), {"drafter": name, "pool": r["pool"], "seeds": [],
                                                  "over_start": [], "over_best_baseline": [], "unpaired": []})
        g["seeds"].append(r["seed"])
        if (e.get("over_best_baseline") or {}).get("paired") is False:
            g["unpaired"].append(r["seed"])
        for k in ("over_start", "over_best_baseline"):  # None where a seed has no such ratio, so lists align
            g[k].append(e[k]["ratio"] if e.get(k) else None)
    for g in groups.values():
        order = sorted(range(len(g["seeds"])), key=lambda i: g["seeds"][i])
        for k in ("seeds", "over_start", "over_best_baseline"):
            g[k] = [g[k][i] for i in order]
        for k in ("over_start", "over_best_baseline"):
            got = [x for x in g[k] if x is not None]
            g[f"min_{k}"] = min(got) if got else None
        g["unpaired"].sort()
    return sorted(groups.values(), key=lambda g: (g["pool"], g["drafter"]))


def scale_curve(table: dict) -> list[dict]:
    """OPD's gain over its start against pool size, per OPD drafter measured at two pools or more.

    Each point is one pool: ``ratio`` the mean over its seeds of (OPD mean tau / start mean tau),
    ``lowest`` the lowest seed. The gain (ratio - 1) is fitted by least squares as linear in
    log10(pool), and ``predicted_10x`` is that line at ten times the largest pool: an extrapolation
    of two or three points, to say which way the curve points, not a measurement.

    Returns:
        [{"drafter", "points": [{"pool", "seeds", "ratio", "lowest"}] by pool, "slope_per_decade",
        "predicted_10x": {"pool", "ratio"}}], sorted by drafter name; empty when no drafter has two pools.
    """
    by: dict[str, list] = {}
    for g in across_seeds(table):
        got = [x for x in g["over_start"] if x is not None]
        if got:
            by.setdefault(g["drafter"], []).append({"pool": g["pool"], "seeds": g["seeds"], "ratio": sum(got) / len(got),
                                                     "lowest": min(got)})
    out = []
    for name in sorted(by):
        pts = sorted(by[name], key=lambda q: q["pool"])
        if len(pts) < 2:
            continue
        xs = [math.log10(q["pool"]) for q in pts]
        ys = [q["ratio"] - 1.0 for q in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        far = pts[-1]["pool"] * 10
        out.append({"drafter": name, "points": pts, "slope_per_decade": slope,
                    "predicted_10x": {"pool": far, "ratio": 1.0 + my + slope * (math.log10(far) - mx)}})
    return out


def plot_scale_curve(table: dict, path: Path) -> Path | None:
    """``scale_curve`` as a PNG (OPD over its start against pool size, log x; dashed: the fit out to 10x).

    Returns the written path, or None (nothing written) when no drafter was measured at two pools.
    """
    curves = scale_curve(table)
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for c in curves:
        pools = [q["pool"] for q in c["points"]]
        line, = ax.plot(pools, [q["ratio"] for q in c["points"]], marker="o", label=c["drafter"])
        ax.scatter(pools, [q["lowest"] for q in c["points"]], marker="v", color=line.get_color(), s=14)
        far = c["predicted_10x"]
        ax.plot([pools[-1], far["pool"]], [c["points"][-1]["ratio"], far["ratio"]], ls="--", color=line.get_color())
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.05, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("OPD prompt pool (prompts)")
    ax.set_ylabel("held-out mean tau / start")
    ax.set_title("OPD gain against pool size (o: mean of seeds, v: lowest)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def render(table: dict) -> str:
    """The README's table from ``opd_at_scale.json``: ``python benchmarks/bench_opd_at_scale.py --render FILE``."""
    ds = table["datasets"]
    lines = [f"Mean tau over every prompt of {', '.join(f'{d} ({n})' for d, n in table['prompts'].items())}, exact offline "
             f"replay at T=0, {table['eval']['max_new_tokens']} new tokens; 95% paired bootstrap intervals "
             f"({table['replicates']} replicates over prompts). val: the OPD run's held-out validation prompts; "
             "pool: the first OPD-pool prompts (in-sample for OPD and the opd_pool baseline)."
             + (" A ratio marked unpaired has one of its two rows recorded without per-prompt counts: its interval treats "
                "the two rows' intervals as independent, so it is wider than a paired one."
                if any((e.get("over_best_baseline") or {}).get("paired") is False for e in table["ratios"]) else ""), "",
             "| drafter | " + " | ".join(ds) + " | mean tau [95% CI] | val | pool | drafter FLOPs |",
             "|---|" + "---:|" * (len(ds) + 4)]
    f = lambda x, fmt="{:.3f}": "-" if x is None else fmt.format(x)  # noqa: E731
    # by pool, then seed (a merge puts the rows it ran first); the start first, run order kept within a (pool, seed)
    place = lambda r: (r["kind"] != "start", r.get("pool") or 0, r.get("seed") or 0)  # noqa: E731
    shown = []
    for r in sorted(table["rows"], key=place):
        if r.get("sets"):  # one start row per (pool, seed): each run's validation prompts are its own
            order = sorted(r["sets"], key=lambda k: tuple(int(x[1:]) for x in k.split()))
            shown += [dict(r, drafter=f"start (val, pool: {k})", **r["sets"][k]) for k in order]
        else:
            shown.append(r)
    for r in shown:
        lines.append(f"| {r['drafter']} | " + " | ".join(f"{r['tau'][d]:.3f}" for d in ds)
                     + f" | **{r['mean_tau']:.3f}** [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | {f(r['val_tau'])} | "
                     f"{f(r['pool_tau'])} | {f(r['drafter_flops'], '{:.2e}')} |")
    if table["ratios"]:
        lines += ["", "| OPD drafter | over the start [95% CI] | over the best fair baseline [95% CI] |", "|---|---:|---:|"]
        # an unpaired ratio (OPD row recorded without per-prompt counts) is marked, its interval being wider
        cell = lambda e: "-" if e is None else (f"{e['ratio']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"  # noqa: E731
                                                + (", unpaired" if e.get("paired") is False else ""))
        rank = {r["drafter"]: place(r) for r in table["rows"]}
        for e in sorted(table["ratios"], key=lambda e: rank[e["drafter"]]):
            lines.append(f"| {e['drafter']} | {cell(e.get('over_start'))} | {cell(e.get('over_best_baseline'))}"
                         + (f" ({e['over_best_baseline']['against']})" if e.get("over_best_baseline") else "") + " |")
    groups = [g for g in across_seeds(table) if len(g["seeds"]) > 1]
    if groups:
        lines += ["", "| OPD drafter | pool | seeds | over the start, per seed (lowest) | over the best fair baseline, "
                  "per seed (lowest) |", "|---|---:|---|---:|---:|"]
        def per(g, k):
            if g["min_" + k] is None:
                return "-"
            unpaired = g["unpaired"] if k == "over_best_baseline" else []
            cells = ["-" if x is None else f"{x:.3f}" + (" unpaired" if seed in unpaired else "")
                     for x, seed in zip(g[k], g["seeds"])]
            return ", ".join(cells) + f" (**{g['min_' + k]:.3f}**)"

        for g in groups:
            lines.append(f"| {g['drafter']} | {g['pool']} | {', '.join(map(str, g['seeds']))} | "
                         f"{per(g, 'over_start')} | {per(g, 'over_best_baseline')} |")
    curves = scale_curve(table)
    if curves:
        pools = sorted({q["pool"] for c in curves for q in c["points"]})
        lines += ["", "OPD over its start against pool size (mean of seeds; the last column extrapolates the fit, "
                  "linear in log pool, to 10x the largest pool):", "",
                  "| OPD drafter | " + " | ".join(f"pool {n}" for n in pools) + " | gain per 10x pool | predicted at 10x |",
                  "|---|" + "---:|" * (len(pools) + 2)]
        for c in curves:
            at = {q["pool"]: q for q in c["points"]}
            cells = [f"{at[n]['ratio']:.3f} ({len(at[n]['seeds'])} seed{'s' * (len(at[n]['seeds']) > 1)})"
                     if n in at else "-" for n in pools]
            lines.append(f"| {c['drafter']} | " + " | ".join(cells) + f" | {c['slope_per_decade']:+.3f} | "
                         f"{c['predicted_10x']['ratio']:.3f} (pool {c['predicted_10x']['pool']}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:
        print(render(json.loads(Path(sys.argv[2]).read_text())))
        sys.exit(0)
    if sys.argv[1:2] == ["--scale-curve"]:  # the PNG beside the table: <name>_scale_curve.png
        src = Path(sys.argv[2])
        print(plot_scale_curve(json.loads(src.read_text()), src.with_name(src.stem + "_scale_curve.png")))
        sys.exit(0)
    sys.exit(main())
