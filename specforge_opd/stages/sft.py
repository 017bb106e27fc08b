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
from typing import Any, Callable, Optional, Sequence

from specforge_opd.atomic import atomic_write_bytes, atomic_write_json
from specforge_opd.config import ConfigError, ExperimentConfig
from specforge_opd.data.prompts import prompt_limit, tokenize_prompts
from specforge_opd.eval.flops import FlopsLedger, sft_flops
from specforge_opd.models.draft_config import draft_config_dict, make_draft_config, resolve_mask_token_id
from specforge_opd.models.export_check import verify_export
from specforge_opd.models.target import target_dir
from specforge_opd.precision import announce, machine_info
from specforge_opd.rollout.responses import read_responses, run_responses
from specforge_opd.stages.plan import estimate_sft
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
    SFTError,
    dir_bytes,
    donor_steps,
    hash_inputs,
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


@dataclass
class SFTInputs:
    """What ``run_sft`` works on; tests pass their own (tiny target, own prompts)."""

    bundle_loader: Callable[[], Any]
    target_path: str
    prompts: Optional[Sequence] = None
    timings: dict = field(default_factory=dict)


def _say_skipped(step: str, skipped: int, total: int, cfg) -> None:
    """Say how many prompts ``tokenize_prompts`` dropped: the pool counts a prompt's own text, the
    limit applies to it rendered with the chat template, so a few more can fall over it."""
    if skipped:
        print(f"[{step}] {skipped} of {total} prompts are over {prompt_limit(cfg)} tokens with the chat template "
              f"(min of data.max_prompt_tokens and target.max_context - sft.max_new_tokens); {total - skipped} kept "
              f"(target.too_long={cfg.target.too_long})", flush=True)


def _load_bundle(cfg: ExperimentConfig):
    from specforge_opd.models.target import load_target

    return load_target(cfg.target)


def _load_prompts(cfg: ExperimentConfig, tokenizer=None) -> list:
    """The ``data.num_prompts`` prompts SFT trains on: ``prompts.training_pool``, which with the
    target's ``tokenizer`` drops prompts over ``data.max_prompt_tokens`` before the cap, as the
    OPD stage's pool does (so the cap counts prompts that fit)."""
    from specforge_opd.data.prompts import training_pool

    return list(training_pool(cfg.data, tokenizer=tokenizer))


def _load_val_prompts(cfg: ExperimentConfig, tokenizer=None) -> list:
    """``sft.val_prompts`` records of the training pool right after the ``data.num_prompts`` SFT trains on
    (the same pool as ``_load_prompts`` with the same ``tokenizer``).

    Raises:
        SFTError: ``data.num_prompts`` is unset (the whole pool trains), or the pool has no prompt left.
    """
    from specforge_opd.data.prompts import PromptsError, held_out_prompts

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
    from specforge_opd.eval.validation import plateaued, read_curve
    from specforge_opd.stepkeys import MARKER, is_done

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
    tpath = target_path or target_dir(cfg)
    timings: dict[str, float] = {}
    skipped: list[str] = []
    cache: dict[str, Any] = {"bundle": bundle}

    def get_bundle():
        if cache["bundle"] is None:
            print("[sft] loading target", flush=True)
            cache["bundle"] = _load_bundle(cfg)
        return cache["bundle"]

    from transformers import AutoConfig, AutoTokenizer

    target_config = get_bundle().model.config if bundle is not None else AutoConfig.from_pretrained(tpath)
    tokenizer = bundle.tokenizer if bundle is not None else AutoTokenizer.from_pretrained(tpath)
    mask = resolve_mask_token_id(cfg, target_config, tokenizer)
    dcfg = make_draft_config(cfg, target_config, mask)
    if cfg.sft.init_drafter:
        check_init_shape(cfg, dcfg, target_config)
    layer_ids = [int(i) for i in dcfg.dflash_config["target_layer_ids"]]
    tid = target_key(tpath)

    # the validation prompts are checked before any target work: a pool with none left after
    # data.num_prompts must fail now, not after the responses and features steps
    val_tok: list = []
    if cfg.sft.val_prompts:
        val_recs = list(val_prompts) if val_prompts is not None else _load_val_prompts(cfg, tokenizer)
        val_tok, val_long = tokenize_prompts(val_recs, tokenizer, cfg)
        if not val_tok:
            raise SFTError(f"sft.val_prompts: all {len(val_recs)} validation prompts are longer than {prompt_limit(cfg)} tokens")
        _say_skipped("sft validation", val_long, len(val_recs), cfg)

    # -- responses
    t0 = time.time()
    records_in = list(prompts) if prompts is not None else _load_prompts(cfg, tokenizer)
    if not records_in:
        raise SFTError("sft responses: the training prompt pool is empty (check data.train_sources and data.slices)")
    tokenized, too_long = tokenize_prompts(records_in, tokenizer, cfg)
    if not tokenized:
        raise SFTError(f"sft responses: all {len(records_in)} prompts are longer than {prompt_limit(cfg)} tokens")
    _say_skipped("sft responses", too_long, len(records_in), cfg)
    r_inputs = responses_inputs(cfg, tid, tokenized)
    r_key = hash_inputs(r_inputs)
    r_dir = reusable_step(cfg, out, "responses", r_key)
    keyed_step("responses", r_dir, r_key, r_inputs,
               lambda: dict(run_responses(r_dir, tokenized, get_bundle(), cfg,
                                          donor_steps(cfg, out, "responses", r_inputs, vary=("prompts", "n"))),
                            prompts_too_long_skipped=too_long), skipped)
    timings["responses"] = time.time() - t0
    if budget_for is not None:
        cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update=budget_for(read_responses(r_dir)))})

    # -- features
    t0 = time.time()
    f_inputs = features_inputs(cfg, r_key, tid, layer_ids)
    f_key = hash_inputs(f_inputs)
    f_dir = reusable_step(cfg, out, "features", f_key)
    keyed_step("features", f_dir, f_key, f_inputs,
               lambda: run_features(f_dir, read_responses(r_dir), lambda: get_bundle().model, layer_ids, cfg,
                                    donor_steps(cfg, out, "features", f_inputs, vary=("responses",))), skipped)
    n_samples = read_marker_stats(f_dir)["samples"]
    train_dir = f_dir
    if cfg.sft.train_samples is not None and cfg.sft.train_samples != n_samples:
        # a data-curve point: the first N samples of the shared step, linked into a directory of their own
        train_dir = subset_features(f_dir, out / f"features-{f_key}-first{cfg.sft.train_samples}", cfg.sft.train_samples)
        n_samples = cfg.sft.train_samples
        print(f"[sft features] training on the first {n_samples} samples (sft.train_samples)", flush=True)
    timings["features"] = time.time() - t0

    # -- train
    t0 = time.time()
    gpus = gpu_count() if on_gpu(cfg) else 0
    dcfg_dict = draft_config_dict(dcfg)
    t_inputs = {"features": f_key, "draft": dcfg_dict, "training": sft_training_inputs(cfg),
                "overrides": cfg.sft.specforge_overrides, "save_interval": cfg.sft.save_interval, "gpus": gpus,
                "init_drafter": cfg.sft.init_drafter, "max_steps": cfg.sft.max_steps}
    if train_dir != f_dir:
        t_inputs["train_samples"] = n_samples
    nodes = nodes_from_env()
    if nodes.nnodes > 1:  # the step counts change with the ranks (one node keeps its earlier keys)
        t_inputs["nnodes"] = nodes.nnodes
    if val_tok:
        t_inputs["validation"] = {"prompts": hash_inputs({"p": val_tok}), "interval": cfg.sft.val_interval,
                                  "select": cfg.sft.select}
    t_key = hash_inputs(t_inputs)
    t_dir = step_dir(out, "train", t_key)

    def train() -> dict:
        dfile = t_dir / "draft_config" / "config.json"
        text = json.dumps(dcfg_dict, indent=2, sort_keys=True) + "\n"
        # SpecForge's resume contract hashes this file: rewrite only when it changed.
        if not dfile.is_file() or dfile.read_text() != text:
            atomic_write_bytes(dfile, text.encode())
        run = specforge_run_config(cfg, target_path=tpath, draft_config_file=dfile, features=train_dir,
                                   out_dir=t_dir / "checkpoints", num_samples=n_samples, mask_token_id=mask, gpus=gpus,
                                   nodes=nodes, init_dir=init_drafter_dir(cfg, t_dir, target_config))
        if not val_tok:
            return run_train(t_dir, run, cfg, gpus)
        from specforge_opd.eval.validation import ValidationSet

        b = get_bundle()
        # eval.cache_dir, when set, shares the trajectories with other runs on the same prompts (keyed, so safe)
        valset = ValidationSet(b.model, tid, [p for _, p in val_tok], max_new_tokens=cfg.sft.max_new_tokens,
                               stop_token_ids=list(b.stop_token_ids),
                               cache_dir=Path(cfg.resolve_path(cfg.eval.cache_dir)) if cfg.eval.cache_dir
                               else out / "val_trajectories")
        responses = read_responses(r_dir)
        init = (FlopsLedger.from_dict(read_drafter_metadata(cfg.resolve_path(cfg.sft.init_drafter)).get("flops"))
                if cfg.sft.init_drafter else FlopsLedger())

        def flops_at(step: int) -> FlopsLedger:
            here = sft_flops(cfg, dcfg, target_config, responses, steps=step,
                             **_made_here(r_dir, f_dir, out))
            return init.add(here)

        # segment ends count the steps of every rank on every node
        return run_train_validated(t_dir, run, cfg, gpus * nodes.nnodes, num_samples=n_samples, valset=valset, target_config=target_config,
                                   flops_at=flops_at, tensorboard_dir=out / "tensorboard" if cfg.output.tensorboard else None,
                                   plot_path=out / "sft_curve.png")

    from specforge_opd.models.drafter import (
        METADATA_FILE,
        load_specforge_checkpoint,
        read_drafter_metadata,
        save_drafter,
    )

    _reopen_if_rule_loosened(t_dir, t_key, cfg)
    train_stats = keyed_step("train", t_dir, t_key, t_inputs, train, skipped)
    ckpt = Path(train_stats["checkpoint"])
    chosen = train_stats.get("selected")
    timings["train"] = time.time() - t0

    # -- export
    t0 = time.time()

    final = out / "final"
    meta = read_drafter_metadata(final) if final.is_dir() else {}
    validation = None if chosen is None else {
        "select": cfg.sft.select, "selected_step": int(chosen["step"]), "selected_tau": chosen["tau"],
        "curve": train_stats["curve"], "val_prompts": len(val_tok), "plateau_step": train_stats.get("plateau_step"),
        "paused_at": train_stats.get("paused_at")}
    if (meta.get("sft_key") == t_key and meta.get("verify") is not None
            and (chosen is None or meta.get("step") == chosen["step"])):
        skipped.append("export")
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
        if chosen is not None:  # the validated checkpoint, exported before SpecForge could prune it
            from specforge_opd.models.drafter import load_drafter

            model = load_drafter(chosen["export"], target_config=target_config, target_dtype=cfg.target.dtype)
            ckpt = Path(chosen["checkpoint"])
        else:
            model = load_specforge_checkpoint(ckpt, target_config)
        b = get_bundle()
        held = [p for _, p in tokenized[-cfg.sft.verify_prompts:]] if cfg.sft.verify_prompts else []
        verify = verify_export(model, b.model, held, list(b.stop_token_ids), cfg.sft.verify_max_new_tokens)
        if verify["prompts"]:
            print(f"[sft export] speculative decode == greedy on {verify['prompts']} prompts; tau {verify['tau']:.3f}",
                  flush=True)
        else:
            print("[sft export] lossless check skipped (sft.verify_prompts=0)", flush=True)
        responses = read_responses(r_dir)
        step = int(chosen["step"] if chosen is not None else train_stats["step"])
        ledger = sft_flops(cfg, dcfg, target_config, responses, steps=step,
                           **_made_here(r_dir, f_dir, out))
        if cfg.sft.init_drafter:
            ledger = FlopsLedger.from_dict(read_drafter_metadata(cfg.resolve_path(cfg.sft.init_drafter)).get("flops")).add(ledger)
        save_drafter(model, final, metadata={"stage": "sft", "sft_key": t_key, "specforge_checkpoint": str(ckpt),
                                             "target": tpath, "target_identity": tid, "target_dtype": cfg.target.dtype,
                                             "samples": n_samples,
                                             "step": step, "verify": verify,
                                             "init_drafter": cfg.sft.init_drafter, "flops": ledger.to_dict(),
                                             "validation": validation, "precision": precision.record(),
                                             "recipe": sft_recipe(cfg),
                                             "machine": machine_info()},
                     dtype=cfg.target.dtype)
        from specforge_opd.models.drafter import load_drafter

        load_drafter(final, target_config=target_config, target_dtype=cfg.target.dtype)  # the export must load back through the public loader
    timings["export"] = time.time() - t0

    report = {"final": str(final), "precision": precision.record(), "machine": machine_info(),
              "timings_s": timings, "skipped": skipped, "verify": verify,
              "validation": None if chosen is None else {"selected": chosen, "curve": train_stats["curve"]},
              "disk_bytes": {d.name: dir_bytes(d) for d in (r_dir, f_dir, t_dir, final)}}
    report["disk_bytes"]["total"] = dir_bytes(out)
    atomic_write_json(out / "sft_report.json", report)
    print(f"[sft] done: {final} | " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())
          + f" | disk {report['disk_bytes']['total'] / 2**20:.1f} MiB", flush=True)
    return final


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
            from specforge_opd.data import assets

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
