"""The SFT stage on SpecForge: responses -> features -> train -> export.

``specforge-opd sft -c configs/<exp>/sft.yaml`` trains a DFlash drafter with
SpecForge's own DFlash SFT trainer on the target's own responses; ``_run_sft``
reads top to bottom as the four steps, each in its own module:

1. **responses** (``responses``): training prompts (``prompts.training_pool``)
   rendered with the target's chat template (``prompts.tokenize_prompts``, the
   rendering rollout and benchmarks use) and answered by the target, greedy or
   sampled (``sft.temperature``); JSONL chunks of token ids.
2. **features** (``sft_features``): the target runs over prompt + response; each
   kept sample is a SpecForge offline DFlash feature file, plus our ``manifest.json``.
3. **train** (``sft_train``): a SpecForge run YAML (strategy dflash, offline
   features) and ``python -m specforge.cli train -c run.yaml`` as a subprocess,
   resumed from its ``-latest`` checkpoint when one exists; with ``sft.val_prompts``
   in segments with a validation point after each.
4. **export**: the final SpecForge checkpoint, read with
   ``torch.load(weights_only=True)`` (``drafter.load_specforge_checkpoint``), exported
   by ``drafter.save_drafter`` to ``<output.dir>/final`` and verified
   (``export_check.verify_export``): reloaded, and a short speculative decode must
   equal greedy target decoding.

Every step writes into a directory named by a hash of its inputs and a
``DONE.json`` marker last (``stepkeys``), so a rerun skips finished steps, a changed
input redoes only what depends on it, and a killed run resumes by chunk / by sample /
from SpecForge's checkpoint without duplicating samples.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

from specforge_opd.atomic import atomic_write_bytes, atomic_write_json
from specforge_opd.config import ConfigError, ExperimentConfig
from specforge_opd.data import assets
from specforge_opd.data import prompts as prompts_mod
from specforge_opd.data.prompts import PromptsError, held_out_prompts, prompt_limit, tokenize_prompts
from specforge_opd.eval.flops import FlopsLedger, sft_flops
from specforge_opd.eval.validation import ValidationSet, plateaued, read_curve
from specforge_opd.models import target as target_mod
from specforge_opd.models.draft_config import draft_config_dict, make_draft_config, resolve_mask_token_id
from specforge_opd.models.drafter import METADATA_FILE, load_drafter, load_specforge_checkpoint, read_drafter_metadata, save_drafter
from specforge_opd.models.export_check import verify_export
from specforge_opd.models.target import target_dir
from specforge_opd.precision import Precision, announce, machine_info
from specforge_opd.rollout.responses import read_responses, run_responses
from specforge_opd.stages.plan import estimate_sft
from specforge_opd.stages.rollout import response_generator
from specforge_opd.stages.sft_features import (
    MIN_SUPERVISED_TOKENS,
    drafter_dtype,
    run_features,
    sft_precision,
    subset_features,
)
from specforge_opd.stages.sft_train import (
    _publish_launch,
    check_init_shape,
    follow_node0,
    gpu_count,
    init_drafter_dir,
    nodes_from_env,
    on_gpu,
    run_train,
    run_train_validated,
    sft_recipe,
    sft_training_inputs,
    specforge_run_config,
)
from specforge_opd.stepkeys import (  # noqa: F401  (SFTError: the stage's error, raised by every step)
    MARKER,
    SFTError,
    dir_bytes,
    donor_steps,
    hash_inputs,
    is_done,
    keyed_step,
    read_marker_stats,
    reusable_step,
    step_dir,
    target_key,
)

#: The stage's steps, in order (``sft_report.json`` lists the ones a rerun skipped).
STEPS = ("responses", "features", "train", "export")


# ---------------------------------------------------------------------------
# the stage


def _say_skipped(step: str, skipped: int, total: int, cfg) -> None:
    """Say how many prompts ``tokenize_prompts`` dropped: the pool counts a prompt's own text, the
    limit applies to it rendered with the chat template, so a few more can fall over it."""
    if skipped:
        print(f"[{step}] {skipped} of {total} prompts are over {prompt_limit(cfg)} tokens with the chat template "
              f"(min of data.max_prompt_tokens and target.max_context - sft.max_new_tokens); {total - skipped} kept "
              f"(target.too_long={cfg.target.too_long})", flush=True)


def _load_bundle(cfg: ExperimentConfig):
    return target_mod.load_target(cfg.target)


def _load_prompts(cfg: ExperimentConfig, tokenizer=None) -> list:
    """The ``data.num_prompts`` prompts SFT trains on: ``prompts.training_pool``, which with the
    target's ``tokenizer`` drops prompts over ``data.max_prompt_tokens`` before the cap, as the
    OPD stage's pool does (so the cap counts prompts that fit)."""
    return list(prompts_mod.training_pool(cfg.data, tokenizer=tokenizer))


def _load_val_prompts(cfg: ExperimentConfig, tokenizer=None) -> list:
    """``sft.val_prompts`` records of the training pool right after the ``data.num_prompts`` SFT trains on
    (the same pool as ``_load_prompts`` with the same ``tokenizer``).

    Raises:
        SFTError: ``data.num_prompts`` is unset (the whole pool trains), or the pool has no prompt left.
    """
    try:
        return held_out_prompts(cfg.data, cfg.sft.val_prompts, field="sft.val_prompts", tokenizer=tokenizer)
    except PromptsError as e:
        raise SFTError(str(e)) from None


def run_sft(cfg: ExperimentConfig, **kwargs) -> Path:
    """Run the SFT stage end to end on this node (``_run_sft``: arguments, outputs, errors).

    With ``NNODES`` > 1 (``nodes_from_env``) every node runs this: node 0 runs the stage,
    the others join its SpecForge training (``follow_node0``); ``output.dir`` must be on a
    filesystem every node sees. Returns ``<output.dir>/final``.

    Raises:
        SFTError, ConfigError, DrafterError: with the step and the fix named.
    """
    nodes = nodes_from_env()
    if nodes.nnodes == 1:
        return _run_sft(cfg, **kwargs)
    if not on_gpu(cfg):
        raise SFTError(f"NNODES={nodes.nnodes}: a multi-node SFT needs GPUs (target.device); run it on one node on a CPU")
    if cfg.sft.plateau_patience:
        # node 0 decides alone when the plateau stops training; the others could not know
        raise SFTError(f"NNODES={nodes.nnodes} with sft.plateau_patience={cfg.sft.plateau_patience}: set "
                       "sft.plateau_patience=0 (and sft.max_steps) for a multi-node SFT")
    out = Path(cfg.resolve_path(cfg.output.dir))
    if nodes.node_rank > 0:
        return follow_node0(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        final = _run_sft(cfg, **kwargs)
    except BaseException as e:
        _publish_launch(out, end=True, error=f"{type(e).__name__}: {e}"[:500])
        raise
    _publish_launch(out, end=True)
    return final


def _reopen_if_rule_loosened(t_dir: Path, t_key: str, cfg: ExperimentConfig) -> None:
    """Continue a train step the plateau rule stopped when today's rule would not have stopped it.

    ``sft.plateau_patience`` and ``sft.plateau_band`` are not part of the step's key, like
    ``sft.pause_at_step``: the same command with a looser rule (more patience, a narrower
    band, or 0 = off) takes the finished step up again from its last checkpoint, its
    curve kept. The rule that stopped it stays in force otherwise (the step stays done).
    """
    if not is_done(t_dir, t_key):
        return
    stopped = read_marker_stats(t_dir).get("plateau_step")
    if stopped is None or plateaued(read_curve(t_dir), cfg.sft.plateau_patience, cfg.sft.plateau_band):
        return
    print(f"[sft train] the plateau rule stopped this run at step {stopped}; sft.plateau_patience="
          f"{cfg.sft.plateau_patience} / sft.plateau_band={cfg.sft.plateau_band} would not: continuing it", flush=True)
    (t_dir / MARKER).unlink()


def _made_here(r_dir: Path, f_dir: Path, out: Path) -> dict:
    """``sft_flops``'s ``generated_here`` / ``captured_here``: whether the responses and features
    steps are this run's own, not reused from ``sft.reuse_from`` (whose run paid for them)."""
    return {"generated_here": r_dir.resolve().is_relative_to(out.resolve()),
            "captured_here": f_dir.resolve().is_relative_to(out.resolve())}


def _target_dtype_input(cfg: ExperimentConfig) -> dict:
    # The target's weights are keyed by their files, not by the dtype they run in: a bf16
    # target answers and captures differently. Keyed only off the float32 default, so the
    # keys of existing float32 runs stay valid.
    return {} if cfg.target.dtype == "float32" else {"target_dtype": cfg.target.dtype}


def responses_inputs(cfg: ExperimentConfig, tid: str, tokenized: list) -> dict:
    """The inputs the responses step is keyed by (``stepkeys.hash_inputs``) and donors are matched on.

    ``tid``: ``stepkeys.target_key`` of the target; ``tokenized``: ``[(sample id, prompt token ids)]``.
    """
    return {"target": tid, "prompts": hash_inputs({"p": tokenized}), "n": len(tokenized),
            "temperature": cfg.sft.temperature, "max_new_tokens": cfg.sft.max_new_tokens,
            "chunk": cfg.sft.chunk_prompts, "seed": cfg.data.seed, "stop": list(cfg.target.stop_token_ids),
            "backend": cfg.rollout.backend, **_target_dtype_input(cfg)}


def features_inputs(cfg: ExperimentConfig, r_key: str, tid: str, layer_ids: list[int]) -> dict:
    """The inputs the features step is keyed by and donors are matched on (``r_key``: the responses step's key)."""
    return {"responses": r_key, "target": tid, "layer_ids": layer_ids, "max_context": cfg.target.max_context,
            "dtype": drafter_dtype(cfg), **_target_dtype_input(cfg)}


def _run_sft(cfg: ExperimentConfig, *, bundle=None, prompts: Optional[Sequence] = None,
             target_path: Optional[str] = None, val_prompts: Optional[Sequence] = None,
             budget_for: Optional[Callable[[list], dict]] = None) -> Path:
    """Run the SFT stage end to end; returns the exported HF DFlash directory ``<output.dir>/final``.

    ``bundle`` (a ``TargetBundle``-like object with ``model``, ``tokenizer``,
    ``stop_token_ids``), ``prompts`` (``PromptRecord``-like) and ``target_path``
    (HF directory SpecForge loads the target embedding / lm_head / tokenizer
    from) default to ``target.load_target``, ``prompts.training_pool`` and
    ``target_dir(cfg)``; ``val_prompts`` (records, with ``sft.val_prompts`` > 0)
    defaults to the pool's prompts after the trained ones. ``budget_for``, given the
    finished responses (``ResponseRecord`` list), returns ``sft`` fields to set before
    training (``max_steps``, ``val_interval``): a budget that depends on the data (the
    matched-FLOPs baselines, ``stages.baselines``). Writes ``<output.dir>/sft_report.json`` (wall time per
    step, disk used, the export check's tau).

    Raises:
        SFTError, ConfigError, DrafterError: with the step and the fix named.
    """
    out = Path(cfg.resolve_path(cfg.output.dir))
    out.mkdir(parents=True, exist_ok=True)
    precision = sft_precision(cfg)
    announce(precision, "sft")
    stage = _start(cfg, out, precision, bundle, target_path or target_dir(cfg))
    # the validation prompts are checked before any target work: a pool with none left after
    # data.num_prompts must fail now, not after the responses and features steps
    val_tok = _validation_prompts(cfg, val_prompts, stage.tokenizer)
    resp = _responses_step(stage, prompts)
    if budget_for is not None:
        stage.cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update=budget_for(read_responses(resp.dir)))})
    feats = _features_step(stage, resp)
    trained = _train_step(stage, resp, feats, val_tok)
    final, verify = _export_step(stage, resp, feats, trained, len(val_tok))
    _write_report(stage, final, verify, trained.stats, (resp.dir, feats.dir, trained.dir, final))
    return final


@dataclass
class _Stage:
    """What the steps of one ``_run_sft`` share: ``cfg`` takes the ``sft`` fields ``budget_for`` returns once the
    responses are in; ``skipped`` (steps found done) and ``timings`` (seconds per step) go into ``sft_report.json``."""

    cfg: ExperimentConfig
    out: Path
    precision: Precision
    tpath: str
    tid: str
    target_config: Any
    tokenizer: Any
    dcfg: Any
    mask: int
    layer_ids: list[int]
    bundle: Any = None
    skipped: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def target(self):
        """The target bundle (``model``, ``tokenizer``, ``stop_token_ids``), loaded on the first call."""
        if self.bundle is None:
            print("[sft] loading target", flush=True)
            self.bundle = _load_bundle(self.cfg)
        return self.bundle


class _Responses(NamedTuple):
    tokenized: list  # [(sample id, prompt token ids)]
    key: str
    dir: Path


class _Features(NamedTuple):
    key: str
    dir: Path
    train_dir: Path  # the directory SpecForge reads: ``dir``, or its first ``sft.train_samples`` samples
    samples: int


class _Trained(NamedTuple):
    key: str
    dir: Path
    stats: dict  # the train step's marker stats: checkpoint, step (and with validation: curve, selected, ...)


def _start(cfg: ExperimentConfig, out: Path, precision, bundle, tpath: str) -> _Stage:
    """The target's config and tokenizer (the ``bundle``'s, or read from ``tpath`` without weights) and the drafter
    built for them. Raises ConfigError, DrafterError: no mask token, or ``sft.init_drafter`` of another shape."""
    from transformers import AutoConfig, AutoTokenizer

    target_config = bundle.model.config if bundle is not None else AutoConfig.from_pretrained(tpath)
    tokenizer = bundle.tokenizer if bundle is not None else AutoTokenizer.from_pretrained(tpath)
    mask = resolve_mask_token_id(cfg, target_config, tokenizer)
    dcfg = make_draft_config(cfg, target_config, mask)
    if cfg.sft.init_drafter:
        check_init_shape(cfg, dcfg, target_config)
    layer_ids = [int(i) for i in dcfg.dflash_config["target_layer_ids"]]
    return _Stage(cfg, out, precision, tpath, target_key(tpath), target_config, tokenizer, dcfg, mask, layer_ids,
                  bundle=bundle)


def _validation_prompts(cfg: ExperimentConfig, val_prompts: Optional[Sequence], tokenizer) -> list:
    """``sft.val_prompts`` tokenized as ``[(id, token ids)]`` ([] when 0): ``val_prompts`` or ``_load_val_prompts``.
    Raises SFTError: as ``_load_val_prompts``, or every validation prompt is over the prompt limit."""
    if not cfg.sft.val_prompts:
        return []
    val_recs = list(val_prompts) if val_prompts is not None else _load_val_prompts(cfg, tokenizer)
    val_tok, val_long = tokenize_prompts(val_recs, tokenizer, cfg)
    if not val_tok:
        raise SFTError(f"sft.val_prompts: all {len(val_recs)} validation prompts are longer than {prompt_limit(cfg)} tokens")
    _say_skipped("sft validation", val_long, len(val_recs), cfg)
    return val_tok


def _responses_step(stage: _Stage, prompts: Optional[Sequence]) -> _Responses:
    """Step 1: the target's responses to ``prompts`` (default: ``_load_prompts``), in ``responses-<key>``.
    Raises SFTError: the prompt pool is empty, or every prompt is over the prompt limit."""
    t0 = time.time()
    cfg, out = stage.cfg, stage.out
    records_in = list(prompts) if prompts is not None else _load_prompts(cfg, stage.tokenizer)
    if not records_in:
        raise SFTError("sft responses: the training prompt pool is empty (check data.train_sources and data.slices)")
    tokenized, too_long = tokenize_prompts(records_in, stage.tokenizer, cfg)
    if not tokenized:
        raise SFTError(f"sft responses: all {len(records_in)} prompts are longer than {prompt_limit(cfg)} tokens")
    _say_skipped("sft responses", too_long, len(records_in), cfg)
    r_inputs = responses_inputs(cfg, stage.tid, tokenized)
    r_key = hash_inputs(r_inputs)
    r_dir = reusable_step(cfg, out, "responses", r_key)
    keyed_step("responses", r_dir, r_key, r_inputs,
               lambda: dict(run_responses(r_dir, tokenized, stage.target(), cfg,
                                          donor_steps(cfg, out, "responses", r_inputs, vary=("prompts", "n")),
                                          remote=response_generator(cfg)),
                            prompts_too_long_skipped=too_long), stage.skipped)
    stage.timings["responses"] = time.time() - t0
    return _Responses(tokenized, r_key, r_dir)


def _features_step(stage: _Stage, resp: _Responses) -> _Features:
    """Step 2: the target's features over each prompt + response, in ``features-<key>`` (with ``sft.train_samples``,
    trained on its first N). Raises SFTError: no sample has enough supervised tokens, or too few for N."""
    t0 = time.time()
    cfg, out = stage.cfg, stage.out
    f_inputs = features_inputs(cfg, resp.key, stage.tid, stage.layer_ids)
    f_key = hash_inputs(f_inputs)
    f_dir = reusable_step(cfg, out, "features", f_key)
    keyed_step("features", f_dir, f_key, f_inputs,
               lambda: run_features(f_dir, read_responses(resp.dir), lambda: stage.target().model, stage.layer_ids, cfg,
                                    donor_steps(cfg, out, "features", f_inputs, vary=("responses",))), stage.skipped)
    n_samples = read_marker_stats(f_dir)["samples"]
    train_dir = f_dir
    if cfg.sft.train_samples is not None and cfg.sft.train_samples != n_samples:
        # a data-curve point: the first N samples of the shared step, linked into a directory of their own
        train_dir = subset_features(f_dir, out / f"features-{f_key}-first{cfg.sft.train_samples}", cfg.sft.train_samples)
        n_samples = cfg.sft.train_samples
        print(f"[sft features] training on the first {n_samples} samples (sft.train_samples)", flush=True)
    stage.timings["features"] = time.time() - t0
    return _Features(f_key, f_dir, train_dir, n_samples)


def _train_step(stage: _Stage, resp: _Responses, feats: _Features, val_tok: list) -> _Trained:
    """Step 3: SpecForge's training in ``train-<key>`` (in validated segments with ``val_tok``), continued when
    the plateau rule stopped it and today's would not. Raises SFTError: SpecForge fails, or a segment ends early."""
    t0 = time.time()
    cfg = stage.cfg
    gpus = gpu_count() if on_gpu(cfg) else 0
    nodes = nodes_from_env()
    t_inputs = {"features": feats.key, "draft": draft_config_dict(stage.dcfg), "training": sft_training_inputs(cfg),
                "overrides": cfg.sft.specforge_overrides, "save_interval": cfg.sft.save_interval, "gpus": gpus,
                "init_drafter": cfg.sft.init_drafter, "max_steps": cfg.sft.max_steps}
    if feats.train_dir != feats.dir:
        t_inputs["train_samples"] = feats.samples
    if nodes.nnodes > 1:  # the step counts change with the ranks (one node keeps its earlier keys)
        t_inputs["nnodes"] = nodes.nnodes
    if val_tok:
        t_inputs["validation"] = {"prompts": hash_inputs({"p": val_tok}), "interval": cfg.sft.val_interval,
                                  "select": cfg.sft.select}
    t_key = hash_inputs(t_inputs)
    t_dir = step_dir(stage.out, "train", t_key)
    _reopen_if_rule_loosened(t_dir, t_key, cfg)
    stats = keyed_step("train", t_dir, t_key, t_inputs,
                       lambda: _train(stage, t_dir, resp, feats, val_tok, gpus, nodes), stage.skipped)
    stage.timings["train"] = time.time() - t0
    return _Trained(t_key, t_dir, stats)


def _train(stage: _Stage, t_dir: Path, resp: _Responses, feats: _Features, val_tok: list, gpus: int, nodes) -> dict:
    """The train step's work: the draft config file, SpecForge's run config and ``run_train``, or with
    ``val_tok`` ``run_train_validated`` (its curve's points carry the drafter's cumulative FLOPs)."""
    cfg, out = stage.cfg, stage.out
    dfile = t_dir / "draft_config" / "config.json"
    text = json.dumps(draft_config_dict(stage.dcfg), indent=2, sort_keys=True) + "\n"
    # SpecForge's resume contract hashes this file: rewrite only when it changed.
    if not dfile.is_file() or dfile.read_text() != text:
        atomic_write_bytes(dfile, text.encode())
    run = specforge_run_config(cfg, target_path=stage.tpath, draft_config_file=dfile, features=feats.train_dir,
                               out_dir=t_dir / "checkpoints", num_samples=feats.samples, mask_token_id=stage.mask,
                               gpus=gpus, nodes=nodes, init_dir=init_drafter_dir(cfg, t_dir, stage.target_config))
    if not val_tok:
        return run_train(t_dir, run, cfg, gpus)
    b = stage.target()
    # eval.cache_dir, when set, shares the trajectories with other runs on the same prompts (keyed, so safe)
    valset = ValidationSet(b.model, stage.tid, [p for _, p in val_tok], max_new_tokens=cfg.sft.max_new_tokens,
                           stop_token_ids=list(b.stop_token_ids),
                           cache_dir=Path(cfg.resolve_path(cfg.eval.cache_dir)) if cfg.eval.cache_dir
                           else out / "val_trajectories")
    responses = read_responses(resp.dir)
    init = _start_flops(cfg) if cfg.sft.init_drafter else FlopsLedger()

    def flops_at(step: int) -> FlopsLedger:
        here = sft_flops(cfg, stage.dcfg, stage.target_config, responses, steps=step,
                         **_made_here(resp.dir, feats.dir, out))
        return init.add(here)

    # segment ends count the steps of every rank on every node
    return run_train_validated(t_dir, run, cfg, gpus * nodes.nnodes, num_samples=feats.samples, valset=valset,
                               target_config=stage.target_config, flops_at=flops_at,
                               tensorboard_dir=out / "tensorboard" if cfg.output.tensorboard else None,
                               plot_path=out / "sft_curve.png")


def _start_flops(cfg: ExperimentConfig) -> FlopsLedger:
    """The FLOPs ledger ``sft.init_drafter`` records (its training history), which this run's adds to."""
    return FlopsLedger.from_dict(read_drafter_metadata(cfg.resolve_path(cfg.sft.init_drafter)).get("flops"))


def _export_step(stage: _Stage, resp: _Responses, feats: _Features, trained: _Trained, n_val: int) -> tuple[Path, dict]:
    """Step 4: ``<output.dir>/final`` and the export check's record, unless it holds this train step's (selected)
    checkpoint already. Raises SFTError, DrafterError: the export fails its check or does not load back."""
    t0 = time.time()
    cfg, stats = stage.cfg, trained.stats
    chosen = stats.get("selected")
    final = stage.out / "final"
    meta = read_drafter_metadata(final) if final.is_dir() else {}
    validation = None if chosen is None else {
        "select": cfg.sft.select, "selected_step": int(chosen["step"]), "selected_tau": chosen["tau"],
        "curve": stats["curve"], "val_prompts": n_val, "plateau_step": stats.get("plateau_step"),
        "paused_at": stats.get("paused_at")}
    if (meta.get("sft_key") == trained.key and meta.get("verify") is not None
            and (chosen is None or meta.get("step") == chosen["step"])):
        stage.skipped.append("export")
        verify = meta["verify"]
        # the same weights, but the curve may have grown since (a continued run that stopped on a plateau
        # or at another pause): the export's record says where the run stands now
        if validation is not None and meta.get("validation") != json.loads(json.dumps(validation, default=str)):
            atomic_write_json(final / METADATA_FILE, dict(meta, validation=validation))
            print(f"[sft export] done already: {final} (its validation record brought up to step "
                  f"{max(p['step'] for p in validation['curve'])})", flush=True)
        else:
            print(f"[sft export] done already: {final}", flush=True)
    else:
        verify = _export(stage, final, resp, feats, trained, validation)
    stage.timings["export"] = time.time() - t0
    return final, verify


def _export(stage: _Stage, final: Path, resp: _Responses, feats: _Features, trained: _Trained,
            validation: Optional[dict]) -> dict:
    """Export the trained drafter (the selected curve point with validation) to ``final`` with its metadata, after
    checking it against greedy decoding on the last ``sft.verify_prompts`` training prompts; returns that check."""
    cfg, stats, target_config = stage.cfg, trained.stats, stage.target_config
    chosen = stats.get("selected")
    ckpt = Path(stats["checkpoint"])
    if chosen is not None:  # the validated checkpoint, exported before SpecForge could prune it
        model = load_drafter(chosen["export"], target_config=target_config, target_dtype=cfg.target.dtype)
        ckpt = Path(chosen["checkpoint"])
    else:
        model = load_specforge_checkpoint(ckpt, target_config)
    b = stage.target()
    held = [p for _, p in resp.tokenized[-cfg.sft.verify_prompts:]] if cfg.sft.verify_prompts else []
    verify = verify_export(model, b.model, held, list(b.stop_token_ids), cfg.sft.verify_max_new_tokens)
    if verify["prompts"]:
        print(f"[sft export] speculative decode == greedy on {verify['prompts']} prompts; tau {verify['tau']:.3f}",
              flush=True)
    else:
        print("[sft export] lossless check skipped (sft.verify_prompts=0)", flush=True)
    step = int(chosen["step"] if chosen is not None else stats["step"])
    ledger = sft_flops(cfg, stage.dcfg, target_config, read_responses(resp.dir), steps=step,
                       **_made_here(resp.dir, feats.dir, stage.out))
    if cfg.sft.init_drafter:
        ledger = _start_flops(cfg).add(ledger)
    save_drafter(model, final, metadata={"stage": "sft", "sft_key": trained.key, "specforge_checkpoint": str(ckpt),
                                         "target": stage.tpath, "target_identity": stage.tid,
                                         "target_dtype": cfg.target.dtype, "samples": feats.samples, "step": step,
                                         "verify": verify, "init_drafter": cfg.sft.init_drafter,
                                         "flops": ledger.to_dict(), "validation": validation,
                                         "precision": stage.precision.record(), "recipe": sft_recipe(cfg),
                                         "machine": machine_info()},
                 dtype=cfg.target.dtype)
    load_drafter(final, target_config=target_config, target_dtype=cfg.target.dtype)  # the export must load back through the public loader
    return verify


def _write_report(stage: _Stage, final: Path, verify: dict, train_stats: dict, step_dirs: Sequence[Path]) -> None:
    """``<output.dir>/sft_report.json``: wall time per step, the steps skipped, the export check, the selected
    validation point and the disk each step's directory (and the whole run) uses."""
    chosen = train_stats.get("selected")
    report = {"final": str(final), "precision": stage.precision.record(), "machine": machine_info(),
              "timings_s": stage.timings, "skipped": stage.skipped, "verify": verify,
              "validation": None if chosen is None else {"selected": chosen, "curve": train_stats["curve"]},
              "disk_bytes": {d.name: dir_bytes(d) for d in step_dirs}}
    report["disk_bytes"]["total"] = dir_bytes(stage.out)
    atomic_write_json(stage.out / "sft_report.json", report)
    print(f"[sft] done: {final} | " + ", ".join(f"{k} {v:.1f}s" for k, v in stage.timings.items())
          + f" | disk {report['disk_bytes']['total'] / 2**20:.1f} MiB", flush=True)


# ---------------------------------------------------------------------------
# --dry-run


def _plan_target_config(cfg: ExperimentConfig):
    """The target's HF config without loading weights: a local dir, the embedded target, or a Qwen3 fixture."""
    from transformers import AutoConfig

    if cfg.target.path is not None:
        p = cfg.resolve_path(cfg.target.path)
        if p is not None and (p / "config.json").is_file():
            return AutoConfig.from_pretrained(str(p)), str(p)
        m = re.search(r"qwen3-(\d+b(?:-a\d+b)?)", cfg.target.path.lower())
        if m:
            fx = assets.qwen3_fixture_dir(m.group(1))
            if not (fx / "config.json").is_file():
                raise ConfigError(f"dry run of target.path={cfg.target.path!r} needs the Qwen3 config fixture "
                                  f"{fx}/config.json, which is missing (reinstall the package)")
            return AutoConfig.from_pretrained(str(fx)), f"{cfg.target.path} (config fixture {fx})"
        raise ConfigError(f"target.path={cfg.target.path!r} is neither a local HF directory nor a known Qwen3 size "
                          "(dry run reads the config only)")
    d = target_dir(cfg)
    return AutoConfig.from_pretrained(d), d


def dry_run(cfg: ExperimentConfig) -> dict:
    """Print every step, the draft config and the estimates; loads no weights."""
    tconf, where = _plan_target_config(cfg)
    mask = resolve_mask_token_id(cfg, tconf, None)
    dcfg = make_draft_config(cfg, tconf, mask)
    n = cfg.data.num_prompts
    est = estimate_sft(cfg, tconf, dcfg, n)
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    out = cfg.resolve_path(cfg.output.dir)
    print(f"SFT stage plan for {cfg.name} (dry run: no weights loaded)")
    print(f"  target: {where}")
    print(f"  prompts: {n if n is not None else 'the whole pool'} from {cfg.data.train_sources} "
          f"(slices {cfg.data.slices} of {cfg.data.num_slices}); thinking={cfg.target.thinking}")
    print(f"  1. responses -> {out}/responses-<key>/chunk_*.jsonl: backend {cfg.rollout.backend}, "
          f"temperature {cfg.sft.temperature}, max_new_tokens {cfg.sft.max_new_tokens}, batch {cfg.sft.batch_size}; "
          f"disk <= {gib(est['responses_disk_bytes_max'])}")
    print(f"  2. features -> {out}/features-<key>/rows_*/data_*.ckpt: target layers "
          f"{dcfg.dflash_config['target_layer_ids']}, <= {est['feature_bytes_per_sample_max'] / 2**20:.1f} MiB/sample, "
          f"disk <= {gib(est['features_disk_bytes_max'])}; samples with < {MIN_SUPERVISED_TOKENS} response tokens dropped")
    print(f"  3. train -> {out}/train-<key>/checkpoints: specforge train (dflash, {cfg.training.num_epochs} epochs, "
          f"lr {cfg.training.learning_rate}, num_anchors {cfg.training.num_anchors}, batch {cfg.training.batch_size}); "
          f"memory ~{gib(est['train_memory_bytes_per_rank'])} per rank; target weights {gib(est['target_weights_bytes'])}")
    print(f"  4. export -> {out}/final (HF DFlash, SGLang-loadable), verified against greedy decoding "
          f"on {cfg.sft.verify_prompts} prompts")
    print("  draft config:")
    print("    " + json.dumps(draft_config_dict(dcfg), sort_keys=True).replace(", \"", ",\n    \""))
    print(f"  drafter params {est['drafter_params'] / 1e6:.1f}M; target params {est['target_params'] / 1e9:.2f}B")
    p = est["precision"]
    print(f"  precision: training.mixed_precision={p['requested']} -> {p['value']} on {p['device']} ({p['reason']})")
    return {"draft_config": draft_config_dict(dcfg), "estimate": est}
