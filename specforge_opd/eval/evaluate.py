"""Evaluation: accepted length tau and speedup per dataset (paper section 5, Table 1).

Two ways to get tau:

* **Exact offline replay (temperature 0)**, ``specforge_opd.eval.replay``: the
  target's greedy trajectory and its context features are computed once per
  (target identity, rendered prompt, max_new_tokens, stop tokens) and cached
  (``TrajectoryCache``); the tau of any drafter then follows from replaying its
  drafting steps against the cached trajectory (``offline_tau``). No target forward.
* **Live decoding** (T > 0, ``eval.mode: live``, and the speedup measurement):
  ``specforge_opd.rollout.engine.SpeculativeEngine`` against
  ``specforge_opd.rollout.engine.autoregressive_generate`` on the same prompts, batch
  and machine.

Stopping rule, shared with the live engine and SGLang: a sequence ends once it
holds ``max_new_tokens`` completion tokens (the prefill token counts) or a stop
token; tokens past that are dropped and the verify step that produced them
still counts. tau is pooled by ``specforge_opd.rollout.records.tau_of``.

``evaluate`` writes ``eval.json``, ``eval.md`` and PNG plots into ``out_dir``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from specforge_opd.atomic import atomic_write_text
from specforge_opd.config import ConfigError, ExperimentConfig
from specforge_opd.data.chat import render_prompt
from specforge_opd.data.prompts import KNOWN_EVAL_SETS, eval_prompts
from specforge_opd.eval.ngram import NGRAM_NAME, ngram_offline_tau
from specforge_opd.eval.plots import plot_accept_histograms, plot_tau_per_dataset
# TrajectoryCache, offline_tau, offline_replay and EvalError are reached as evaluate.X by tests and benchmarks
from specforge_opd.eval.replay import EvalError, TrajectoryCache, _cut, offline_replay, offline_tau  # noqa: F401
from specforge_opd.models import target as target_mod
from specforge_opd.models.drafter import (
    DrafterError,
    check_compatible,
    drafter_layer_ids,
    drafter_path,
    drafter_mask_token_id,
    load_drafter,
    read_drafter_metadata,
)
from specforge_opd.rollout.engine import SpeculativeEngine, autoregressive_generate
from specforge_opd.rollout.records import RolloutRecord, accepted_histogram, tau_of


# ---------------------------------------------------------------------------
# live decoding and speedup


def _rollout_config(cfg: ExperimentConfig, *, temperature: float, seed: int, max_new_tokens: int):
    # eval decodes like the rollout engine but stores nothing it does not need
    return cfg.rollout.model_copy(
        # teacher "full" keeps the verify pass's hidden states (no extra vocab-wide work)
        update=dict(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, batch_size=cfg.eval.batch_size,
                    store_features=False, teacher="full", anchors="real")
    )


def live_decode(cfg: ExperimentConfig, target_model, drafter, prompts: list[list[int]], *, stop_token_ids, temperature: float, seed: int, max_new_tokens: Optional[int] = None, sample_ids=None) -> list[RolloutRecord]:
    """Speculative decoding with ``specforge_opd.rollout.engine.SpeculativeEngine`` (batch ``eval.batch_size``)."""
    rcfg = _rollout_config(cfg, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens or cfg.eval.max_new_tokens)
    engine = SpeculativeEngine(target_model, drafter, rcfg, stop_token_ids=list(stop_token_ids), mask_token_id=drafter_mask_token_id(drafter),
                               max_context=cfg.target.max_context, too_long=cfg.target.too_long,
                               prefill_chunk=cfg.target.prefill_chunk)
    sample_ids = sample_ids or [str(i) for i in range(len(prompts))]
    # one continuous batch of eval.batch_size rows
    return engine.generate(prompts, sample_ids=sample_ids, batch_size=cfg.eval.batch_size)


def measure_speedup(cfg: ExperimentConfig, target_model, drafter, prompts: list[list[int]], *, stop_token_ids) -> dict:
    """Wall-clock decode speedup of speculative over autoregressive decoding, measured in one run.

    Decode time per output token, prefill excluded: each method runs once with
    ``max_new_tokens=1`` (prefill only) and once with ``eval.max_new_tokens``;
    ``t_decode = (t_full - t_prefill) / (tokens_full - tokens_prefill)``. Same
    prompts, batch size (``eval.batch_size``) and machine; temperature 0.

    Returns:
        dict: ``ar_s_per_token``, ``spec_s_per_token`` (seconds), ``speedup``
        (ar / spec), ``ar_tokens``, ``spec_tokens``, ``tau``, ``num_prompts``, ``batch_size``.
    """
    N = cfg.eval.max_new_tokens
    bsz = cfg.eval.batch_size

    def ar(n):
        t0 = time.perf_counter()
        outs = autoregressive_generate(target_model, prompts, n, list(stop_token_ids), temperature=0.0, seed=0, batch_size=bsz)
        dt = time.perf_counter() - t0
        return dt, sum(len(_cut(list(o), n, stop_token_ids)) for o in outs)

    def spec(n):
        t0 = time.perf_counter()
        recs = live_decode(cfg, target_model, drafter, prompts, stop_token_ids=stop_token_ids, temperature=0.0, seed=0, max_new_tokens=n)
        dt = time.perf_counter() - t0
        return dt, sum(r.completion_tokens for r in recs), recs

    ar(2)  # warm-up: first calls pay for allocator and kernel selection
    ar_p, ar_p_tok = ar(1)
    sp_p, sp_p_tok, _ = spec(1)
    ar_f, ar_tok = ar(N)
    sp_f, sp_tok, recs = spec(N)
    ar_per = (ar_f - ar_p) / max(1, ar_tok - ar_p_tok)
    sp_per = (sp_f - sp_p) / max(1, sp_tok - sp_p_tok)
    return {
        "ar_s_per_token": ar_per,
        "spec_s_per_token": sp_per,
        "speedup": ar_per / sp_per if sp_per > 0 else float("nan"),
        "ar_tokens": ar_tok,
        "spec_tokens": sp_tok,
        "tau": tau_of(recs),
        "num_prompts": len(prompts),
        "batch_size": bsz,
    }


# ---------------------------------------------------------------------------
# prompts


def _prompt_token_ids(cfg: ExperimentConfig, tokenizer, records) -> tuple[list[list[int]], list[str], int]:
    """Render (same chat rendering as training) and tokenize; apply ``target.too_long``."""
    limit = cfg.target.max_context - cfg.eval.max_new_tokens
    if limit <= 0:
        raise ConfigError(f"eval.max_new_tokens={cfg.eval.max_new_tokens} leaves no room under target.max_context={cfg.target.max_context}")
    out, ids, skipped = [], [], 0
    for rec in records:
        messages = rec.chat_messages()
        first_turn = []
        for m in messages:  # the first user turn (MT-Bench's second turn needs the first answer)
            first_turn.append(m)
            if m.get("role") == "user":
                break
        text = render_prompt(tokenizer, first_turn, thinking=cfg.target.thinking, system_prompt=cfg.target.system_prompt)
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not toks:
            raise EvalError(f"prompt {rec.id} renders to no tokens")
        if len(toks) > limit:
            if cfg.target.too_long == "error":
                raise EvalError(f"prompt {rec.id} has {len(toks)} tokens > target.max_context - eval.max_new_tokens = {limit} (set target.too_long=skip or truncate_left)")
            if cfg.target.too_long == "skip":
                skipped += 1
                continue
            toks = toks[-limit:]
        out.append(toks)
        ids.append(str(rec.id))
    return out, ids, skipped


def check_dataset_names(cfg: ExperimentConfig) -> None:
    """Raise EvalError for an empty or unknown ``eval.datasets`` (listing the known names); loads nothing."""
    known = list(KNOWN_EVAL_SETS)
    if not cfg.eval.datasets:
        raise EvalError("eval.datasets is empty; name at least one of: " + ", ".join(known))
    unknown = [d for d in cfg.eval.datasets if d not in known]
    if unknown:
        raise EvalError(f"eval.datasets: unknown dataset(s) {unknown}; known: {', '.join(known)}")


def load_eval_prompts(cfg: ExperimentConfig, tokenizer) -> dict[str, tuple[list[list[int]], list[str]]]:
    """Token ids and sample ids per dataset of ``eval.datasets``.

    Raises:
        EvalError: an unknown dataset (listing the known ones), an empty dataset.
        prompts.PromptsError: a dataset missing offline (names the package or
            ``data.local_files.<name>`` to provide).
    """
    check_dataset_names(cfg)
    out = {}
    for name in cfg.eval.datasets:
        recs = eval_prompts(name, limit=cfg.eval.num_prompts, cache=cfg.target.cache_dir, local_files=cfg.data.local_files)
        toks, ids, skipped = _prompt_token_ids(cfg, tokenizer, recs)
        if skipped:
            print(f"eval {name}: skipped {skipped} prompts longer than the context limit", file=sys.stderr)
        if not toks:
            raise EvalError(f"eval dataset {name} has no prompts to evaluate (num_prompts={cfg.eval.num_prompts}, {skipped} skipped as too long)")
        out[name] = (toks, ids)
    return out


# ---------------------------------------------------------------------------
# the evaluation


def _dataset_stats(records: list[RolloutRecord], block_size: int) -> dict:
    steps = sum(r.num_blocks for r in records)
    return {
        "tau": tau_of(records),
        "tau_per_prompt": [tau_of([r]) for r in records],
        # per-prompt counts behind the pooled tau, for bootstrap intervals (specforge_opd.eval.stats)
        "tokens_per_prompt": [int(r.completion_tokens) for r in records],
        "steps_per_prompt": [int(r.num_blocks) for r in records],
        "histogram": accepted_histogram(records, block_size),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "verify_steps": steps,
        "num_prompts": len(records),
        "finished": sum(bool(r.finished) for r in records),
    }


def evaluate(cfg: ExperimentConfig, drafter_dirs: dict[str, Path], out_dir: os.PathLike, *, target=None, prompt_sets: Optional[dict] = None) -> dict:
    """Evaluate drafters on ``cfg.eval.datasets`` and write ``eval.json``, ``eval.md`` and plots.

    Args:
        cfg: the experiment config (``eval``, ``target``, ``rollout`` sections).
        drafter_dirs: {name: HF DFlash directory}; several drafters are evaluated
            on the same prompts (and, offline, the same cached trajectories).
        out_dir: where the results go (created).
        target: an object with ``.model``, ``.identity``, ``.stop_token_ids`` and
            ``.tokenizer`` (``specforge_opd.models.target.TargetBundle``); None loads ``cfg.target``.
        prompt_sets: {dataset: (prompt token ids, sample ids)} instead of
            ``eval.datasets`` (tests, callers with their own prompts).

    Returns:
        The dict written to ``eval.json``.

    Raises:
        EvalError / DrafterError: see module docstring; a drafter that does not fit
        the target fails before any decoding.
    """
    ecfg = cfg.eval
    out = Path(out_dir)
    if not drafter_dirs:
        raise EvalError("no drafter to evaluate: pass --drafter DIR (or NAME=DIR)")
    if prompt_sets is None:
        check_dataset_names(cfg)  # before paying for the target
    for name, d in drafter_dirs.items():  # a wrong name or path, too, before the target loads
        if not drafter_path(d).exists():
            raise DrafterError(f"drafter {name}: {d} does not exist; give an exported drafter directory "
                               f"or published:NAME (python -m specforge_opd.models.published list)")
    if target is None:
        target = target_mod.load_target(cfg.target)  # through the module: tests patch it there
    model = target.model
    stop_ids = list(target.stop_token_ids)
    drafters = {}
    for name, d in drafter_dirs.items():
        drafter = load_drafter(d, target_config=model.config, target_dtype=cfg.target.dtype)  # check_compatible runs before the weights load
        check_compatible(drafter.config, model.config, expected_mask_token_id=cfg.draft.mask_token_id)
        drafters[name] = drafter.to(model.device).eval()
    if prompt_sets is None:
        prompt_sets = load_eval_prompts(cfg, target.tokenizer)
    for name, (toks, _) in prompt_sets.items():
        if not toks:
            raise EvalError(f"eval dataset {name} is empty")
    offline = ecfg.mode == "offline" or (ecfg.mode == "auto" and ecfg.temperature == 0.0)
    if offline and ecfg.temperature != 0.0:
        raise ConfigError(f"eval.mode=offline is exact only at temperature 0 (eval.temperature={ecfg.temperature}); use mode=auto or live")
    cache_root = Path(ecfg.cache_dir) if ecfg.cache_dir else out / "trajectory_cache"
    cache = TrajectoryCache(cache_root, model, target.identity, max_new_tokens=ecfg.max_new_tokens, stop_token_ids=stop_ids,
                            batch_size=max(ecfg.batch_size, 8))
    all_layers = sorted({i for d in drafters.values() for i in drafter_layer_ids(d)})

    result: dict[str, Any] = {
        "target": {"identity": target.identity, "path": str(getattr(target, "path", "")), "thinking": cfg.target.thinking},
        "eval": ecfg.model_dump(mode="json"),
        "method": "offline_replay" if offline else "live",
        "drafters": {},
    }
    for name, d in drafters.items():
        meta = read_drafter_metadata(drafter_dirs[name])
        result["drafters"][name] = {
            "path": str(drafter_dirs[name]),
            "block_size": int(d.block_size),
            "target_layer_ids": drafter_layer_ids(d),
            "metadata": meta,
            "flops": meta.get("flops"),
            "datasets": {},
        }
    ngram_bs = int(next(iter(drafters.values())).block_size)
    if offline and ecfg.ngram:
        result["drafters"][NGRAM_NAME] = {"path": None, "block_size": ngram_bs, "target_layer_ids": [],
                                          "metadata": {"drafter": "prompt lookup", "ngram_max": ecfg.ngram_max},
                                          "flops": None, "datasets": {}}

    for ds, (toks, sids) in prompt_sets.items():
        if offline:
            t0 = time.perf_counter()
            trajs = cache.get(toks, all_layers, desc=f"{ds}: target trajectories")
            t_cache = time.perf_counter() - t0
        for name, d in drafters.items():
            entry: dict[str, Any]
            if offline:
                t0 = time.perf_counter()
                recs = offline_tau(d, model, trajs, sids, desc=f"{ds}: {name}")
                entry = _dataset_stats(recs, d.block_size)
                entry.update(seconds=time.perf_counter() - t0, cache_seconds=t_cache)
            else:
                per_seed = []
                for seed in ecfg.seeds:
                    recs = live_decode(cfg, model, d, toks, stop_token_ids=stop_ids, temperature=ecfg.temperature, seed=seed, sample_ids=sids)
                    per_seed.append(_dataset_stats(recs, d.block_size) | {"seed": seed})
                entry = per_seed[0] | {"seeds": per_seed}
                taus = [s["tau"] for s in per_seed]
                entry["tau"] = statistics.fmean(taus)
                entry["tau_std"] = statistics.stdev(taus) if len(taus) > 1 else 0.0
                entry["tau_min"], entry["tau_max"] = min(taus), max(taus)
            if ecfg.speedup:
                n = ecfg.speedup_num_prompts or len(toks)
                entry["speedup"] = measure_speedup(cfg, model, d, toks[:n], stop_token_ids=stop_ids)
            result["drafters"][name]["datasets"][ds] = entry
        if offline and ecfg.ngram:
            recs = ngram_offline_tau(trajs, ngram_bs, sids, max_ngram=ecfg.ngram_max)
            result["drafters"][NGRAM_NAME]["datasets"][ds] = _dataset_stats(recs, ngram_bs)

    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = {
        "tau": plot_tau_per_dataset(result, out / "tau_per_dataset.png").name,
        "histogram": plot_accept_histograms(result, out / "accept_hist.png").name,
    }
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2, default=float))
    atomic_write_text(out / "eval.md", render_markdown(result))
    return result



def _hist_summary(hist: list[int]) -> str:
    """Share of verify steps by accepted length r+1: '1:62% 2:21% 3:9% ...' (nonzero bins)."""
    total = sum(hist)
    if not total:
        return "-"
    return " ".join(f"{L}:{100 * c / total:.0f}%" for L, c in enumerate(hist) if L > 0 and c)


def _fmt_flops(x) -> str:
    return "-" if x in (None, 0) else f"{float(x):.3g}"


def render_markdown(result: dict) -> str:
    """``eval.md``: one table per dataset, drafters side by side, then FLOPs."""
    lines = [f"# Evaluation ({result['method']})", ""]
    e = result["eval"]
    lines.append(f"target `{result['target']['identity']}`, thinking={result['target']['thinking']}, "
                 f"temperature={e['temperature']}, max_new_tokens={e['max_new_tokens']}, batch_size={e['batch_size']}"
                 + (f", seeds={e['seeds']}" if result["method"] == "live" else ""))
    lines.append("")
    lines.append("tau = completion tokens (prefill token included) / verify steps. "
                 "Histogram: share of verify steps by accepted length r+1. "
                 "Speedup: autoregressive / speculative decode time per output token (prefill excluded).")
    datasets = []
    for d in result["drafters"].values():
        for ds in d["datasets"]:
            if ds not in datasets:
                datasets.append(ds)
    for ds in datasets:
        lines += ["", f"## {ds}", "", "| drafter | tau | prompts | verify steps | generated tokens | accepted length r+1 | speedup |",
                  "|---|---|---|---|---|---|---|"]
        for name, d in result["drafters"].items():
            s = d["datasets"].get(ds)
            if s is None:
                continue
            tau = f"{s['tau']:.3f}"
            if "tau_std" in s:
                tau += f" ± {s['tau_std']:.3f}"
            sp = s.get("speedup")
            sp_txt = f"{sp['speedup']:.2f}x (AR {1000 * sp['ar_s_per_token']:.1f} ms/tok, spec {1000 * sp['spec_s_per_token']:.1f} ms/tok)" if sp else "-"
            lines.append(f"| {name} | {tau} | {s['num_prompts']} | {s['verify_steps']} | {s['completion_tokens']} | {_hist_summary(s['histogram'])} | {sp_txt} |")
    lines += ["", "## Training FLOPs", "", "| drafter | drafter training | teacher lm_head | target rollout | target capture |", "|---|---|---|---|---|"]
    for name, d in result["drafters"].items():
        f = d.get("flops") or {}
        lines.append(f"| {name} | {_fmt_flops(f.get('drafter_train'))} | {_fmt_flops(f.get('teacher_lm_head'))} | "
                     f"{_fmt_flops(f.get('target_rollout'))} | {_fmt_flops(f.get('target_capture'))} |")
    lines += ["", f"![tau per dataset]({result['plots']['tau']})", "", f"![accepted length]({result['plots']['histogram']})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# earlier results in the output directory


def check_results_free(out: Path, drafters: dict[str, Path]) -> None:
    """Refuse to replace an earlier evaluation of other drafters in ``out``.

    ``eval.json`` there may hold results of other drafters (another run of the verb with the same
    ``output.dir``); writing this run's would lose them. A run that keeps every drafter recorded
    there (same name, same directory) may go ahead, with more drafters or none new.

    Raises:
        EvalError: ``out/eval.json`` records a drafter (prompt lookup aside) that this run drops or
            points elsewhere.
    """
    f = out / "eval.json"
    if not drafters or not f.exists():
        return
    try:
        before = json.loads(f.read_text()).get("drafters", {})
    except (OSError, ValueError, AttributeError):
        before = {}
    if not isinstance(before, dict):
        before = {}
    had = {n: v["path"] for n, v in before.items() if isinstance(v, dict) and isinstance(v.get("path"), str)}
    now = {n: os.path.realpath(p) for n, p in drafters.items()}
    lost = [n for n, p in had.items() if now.get(n) != os.path.realpath(p)]
    if lost:
        names = ", ".join(f"{n}={had[n]}" for n in lost)
        raise EvalError(f"output.dir={out} already holds eval.json with drafters this run would drop ({names}); "
                        f"pass output.dir=NEW_DIR (or --out), keep them as --drafter NAME=DIR, or --overwrite to replace it")
