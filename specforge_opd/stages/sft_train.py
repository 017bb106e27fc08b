"""SFT's training step: SpecForge's DFlash trainer as a subprocess, its run config, resume and validation segments.

Step 3 of the SFT stage. ``specforge_run_config`` writes SpecForge's run config
(strategy dflash, offline features) from the experiment config; ``run_train`` runs
``python -m specforge.cli train -c run.yaml`` (``sft.lm_head_recompute=false`` on a CPU:
through ``models.specforge_train``, the same loop without the lm_head recompute) and
resumes from SpecForge's ``-latest`` checkpoint when one exists; ``run_train_validated`` runs it in segments
with a validation point after each (``specforge_opd.eval.validation``). Several nodes:
node 0 publishes each launch in ``LAUNCH_FILE`` and the others join it
(``nodes_from_env``, ``follow_node0``).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specforge_opd.atomic import atomic_write_bytes, atomic_write_json
from specforge_opd.config import ConfigError, ExperimentConfig, apply_override
from specforge_opd.eval.validation import add_point, plateaued, plot_curve, read_curve, segment_ends, select
from specforge_opd.models.adapter import specforge_checkpoint_layout, specforge_cli_module, specforge_run_config_class
from specforge_opd.models.drafter import (
    drafter_path,
    drafter_shape,
    load_drafter,
    load_specforge_checkpoint,
    save_drafter,
    shape_mismatch,
)
from specforge_opd.precision import uses_cuda
from specforge_opd.stages.sft_features import drafter_dtype, sft_precision
from specforge_opd.stepkeys import SFTError

#: SpecForge run id: checkpoints are ``<train dir>/checkpoints/sft-step<N>`` and ``sft-latest``.
SPECFORGE_RUN_ID = "sft"


# ---------------------------------------------------------------------------
# several nodes

#: Node 0's record of the SpecForge launch the other nodes join (``<output.dir>/LAUNCH_FILE``).
LAUNCH_FILE = "multinode_launch.json"


@dataclass(frozen=True)
class Nodes:
    """The nodes the SFT train step spans (torchrun's rendezvous, by its environment names).

    Attributes:
        nnodes: ``NNODES`` (1: this node alone); node_rank: ``NODE_RANK`` (0..nnodes-1);
        master_addr: ``MASTER_ADDR``, node 0's address; master_port: ``MASTER_PORT`` (29500).
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: int = 29500


def nodes_from_env(env: Optional[dict] = None) -> Nodes:
    """Read ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``os.environ`` by default).

    Raises:
        SFTError: a value that is not a number in range, or NNODES > 1 without MASTER_ADDR / NODE_RANK.
    """
    env = os.environ if env is None else env

    def num(name: str, default: int, lo: int, hi: Optional[int] = None) -> int:
        raw = str(env.get(name, "") or default)
        if not raw.isdigit() or int(raw) < lo or (hi is not None and int(raw) > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise SFTError(f"{name}={raw!r}: must be an integer {rng}")
        return int(raw)

    nnodes = num("NNODES", 1, 1)
    if nnodes == 1:
        return Nodes()
    if not env.get("MASTER_ADDR"):
        raise SFTError(f"NNODES={nnodes} needs MASTER_ADDR: the address of the node with NODE_RANK=0")
    if not str(env.get("NODE_RANK", "")):
        raise SFTError(f"NNODES={nnodes} needs NODE_RANK: this node's rank, 0..{nnodes - 1}")
    return Nodes(nnodes, num("NODE_RANK", 0, 0, nnodes - 1), str(env["MASTER_ADDR"]), num("MASTER_PORT", 29500, 1, 65535))


def specforge_train_module(lm_head_recompute: bool = True) -> str:
    """The module that runs ``<module> train -c run.yaml``: SpecForge's CLI, or with ``lm_head_recompute``
    False the same CLI through ``models.specforge_train`` (the lm_head objective not recomputed)."""
    return specforge_cli_module() if lm_head_recompute else "specforge_opd.models.specforge_train"


def _specforge_train_cmd(run_yaml: Path, *, lm_head_recompute: bool = True) -> tuple[list[str], dict]:
    """(argv, environment) of `python -m <specforge_train_module> train -c run_yaml`, with unbuffered output."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SpecForge's import-time notice: its DFlash trainer does not use flash_attn (cli.quiet_known_noise)
    quiet = "ignore:flash_attn is not found"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), quiet) if w)
    return [sys.executable, "-m", specforge_train_module(lm_head_recompute), "train", "-c", str(run_yaml)], env


def _publish_launch(out: Path, run_yaml: Optional[Path] = None, *, end: bool = False, error: Optional[str] = None) -> None:
    """Node 0: tell the other nodes to join a SpecForge launch of ``run_yaml``, or (``end``) that the stage is over."""
    import uuid

    atomic_write_json(out / LAUNCH_FILE, {"id": uuid.uuid4().hex, "time": time.time(), "end": end, "error": error,
                                          "run_yaml": None if run_yaml is None else str(run_yaml)})


def follow_node0(out: Path, *, poll_s: float = 5.0, idle_timeout_s: float = 86400.0) -> Path:
    """A node with NODE_RANK > 0: join every SpecForge launch node 0 publishes under ``out``, until it ends.

    Node 0 alone writes responses, features, validation points and the export: they need one
    writer, and the other nodes only add GPUs to SpecForge's training (its torchrun rendezvous
    waits for them). ``out`` (``output.dir``) must be on a filesystem every node sees, with the
    target at the same path. A record that was there before this node started is joined unless it
    is an end record (a finished earlier run).

    Returns:
        ``out / "final"``, which node 0 writes.
    Raises:
        SFTError: a SpecForge launch failed here, node 0 ended with an error, or no launch came
            for ``idle_timeout_s`` seconds.
    """
    f = out / LAUNCH_FILE
    started, seen, waited_since = time.time(), None, time.time()
    print(f"[sft node] following node 0's SpecForge launches in {f}", flush=True)
    while True:
        try:
            rec = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            rec = None
        if rec is not None and rec["id"] != seen:
            seen = rec["id"]
            if rec["end"]:
                if rec["time"] >= started:
                    if rec.get("error"):
                        raise SFTError(f"sft: node 0 stopped with an error ({rec['error']}); fix it there and start every node again")
                    print("[sft node] node 0 finished the stage", flush=True)
                    return out / "final"
            else:
                cmd, env = _specforge_train_cmd(Path(rec["run_yaml"]))
                print(f"[sft node] joining: {' '.join(cmd)}", flush=True)
                rc = subprocess.call(cmd, env=env)
                if rc != 0:
                    raise SFTError(f"sft train: SpecForge exited with status {rc} on this node (its log is above; "
                                   f"run.yaml: {rec['run_yaml']})")
            waited_since = time.time()
        if time.time() - waited_since > idle_timeout_s:
            raise SFTError(f"sft: node 0 published no SpecForge launch in {f} for {idle_timeout_s:.0f} s; is it running "
                           "with the same output.dir on a shared filesystem?")
        time.sleep(poll_s)


# ---------------------------------------------------------------------------
# the SpecForge run


#: The ``training.*`` fields the SFT train step reads (``specforge_run_config``). Only these key
#: it, so a field added for the OPD trainer does not restart every SFT run from scratch.
SFT_TRAINING_FIELDS = ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm", "num_epochs", "batch_size",
                       "accumulation_steps", "num_anchors", "seed", "log_interval", "attention_backend",
                       "mixed_precision")


#: The ``training`` fields of a drafter's SFT recipe: what continued SFT from it repeats by default
#: (``stages.baselines.start_recipe``), besides the resolved precision and SpecForge overrides.
RECIPE_TRAINING_FIELDS = ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm", "batch_size",
                          "accumulation_steps", "num_anchors")


def sft_recipe(cfg: ExperimentConfig) -> dict:
    """The training recipe of an SFT run, recorded in its export: ``training`` (``RECIPE_TRAINING_FIELDS``),
    ``mixed_precision`` as resolved here (bf16 or fp32) and ``specforge_overrides`` (e.g. the slot-loss decay)."""
    return {"training": {k: getattr(cfg.training, k) for k in RECIPE_TRAINING_FIELDS},
            "mixed_precision": sft_precision(cfg).value, "specforge_overrides": dict(cfg.sft.specforge_overrides)}


def sft_training_inputs(cfg: ExperimentConfig) -> dict:
    """The ``training`` part of the SFT train step's key: ``SFT_TRAINING_FIELDS`` only.

    ``mixed_precision`` enters resolved (``sft_precision``): ``auto`` trains bf16 on one CPU and
    fp32 on another, and a run moved between them must not resume the other's checkpoints.
    ``lm_head_recompute`` enters only when off (``sft_lm_head_recompute``), so the keys of runs
    with SpecForge's own objective stay as they were.
    """
    inputs = {k: getattr(cfg.training, k) for k in SFT_TRAINING_FIELDS}
    inputs["mixed_precision"] = sft_precision(cfg).value
    if not sft_lm_head_recompute(cfg):
        inputs["lm_head_recompute"] = False
    return inputs


def sft_lm_head_recompute(cfg: ExperimentConfig) -> bool:
    """Whether the SFT train step uses SpecForge's own DFlash objective (its lm_head recomputed in the backward).

    ``sft.lm_head_recompute`` False selects ``models.adapter.StoredGradDFlashModel`` on a CPU; on
    GPUs it is ignored with a warning (SpecForge's multi-rank launcher starts its own module).
    """
    if cfg.sft.lm_head_recompute:
        return True
    if on_gpu(cfg):
        warnings.warn("sft.lm_head_recompute=false applies on a CPU only; the SFT train step on GPUs uses "
                      "SpecForge's own objective", stacklevel=2)
        return True
    return False


def on_gpu(cfg: ExperimentConfig) -> bool:
    """Whether the SFT stage trains on GPUs: ``target.device`` ``auto`` with CUDA available, or ``cuda*``."""
    return uses_cuda(cfg.target.device)


def gpu_count() -> int:
    """CUDA devices visible to this process (one SpecForge rank each)."""
    import torch

    return torch.cuda.device_count()


def sft_steps(cfg: ExperimentConfig, num_samples: int, gpus: int) -> tuple[int, int, int]:
    """(optimizer steps per epoch, epochs, total steps) of the SFT train step, as SpecForge counts them."""
    t = cfg.training
    # SpecForge drops the last partial batch: steps = samples // (batch * ranks) * epochs // accumulation
    steps_per_epoch = max(1, num_samples // (t.batch_size * max(1, gpus)) // t.accumulation_steps)
    num_epochs = t.num_epochs
    if cfg.sft.max_steps is not None:
        # enough epochs to reach max_steps; SpecForge stops at max_steps and its schedule spans them
        num_epochs = max(num_epochs, math.ceil(cfg.sft.max_steps / steps_per_epoch))
    return steps_per_epoch, num_epochs, cfg.sft.max_steps or steps_per_epoch * num_epochs


def init_drafter_dir(cfg: ExperimentConfig, t_dir: Path, target_config) -> Optional[Path]:
    """The HF DFlash directory SpecForge starts from for ``sft.init_drafter`` given in any drafter form.

    SpecForge's ``draft_checkpoint_path`` takes an HF DFlash directory only. An HF directory
    or ``published:NAME`` is used as it is; a SpecForge checkpoint (``training_state.pt``, a
    step directory, a ``-latest`` link or a run directory) goes through the one loader
    (``models.drafter.load_drafter``) and is exported once, in fp32 (exact), to
    ``<t_dir>/init_drafter``. None when ``sft.init_drafter`` is unset.

    Raises:
        DrafterError: the path holds no drafter, or one that does not fit the target.
    """
    if not cfg.sft.init_drafter:
        return None
    src = drafter_path(cfg.resolve_path(cfg.sft.init_drafter))
    if src.is_dir() and (src / "config.json").is_file():
        return src
    dest = Path(t_dir) / "init_drafter"
    if not (dest / "config.json").is_file():
        model = load_drafter(src, target_config=target_config)
        save_drafter(model, dest, metadata={"exported_from": str(src)}, dtype="float32")
    return dest


def check_init_shape(cfg: ExperimentConfig, draft_config, target_config) -> None:
    """The drafter the SFT stage builds (``draft_config``, from the ``draft`` section) has ``sft.init_drafter``'s shape.

    SpecForge's warm start loads the start's weights by name and checks only for missing
    keys, so a 3-layer start under a 1-layer ``draft`` section trains a 1-layer drafter with
    no error. Every shape field is compared, defaults included: the SFT stage builds its
    drafter from the ``draft`` section, not from the start.

    Raises:
        ConfigError: names each mismatched ``draft.*`` field and the overrides that fix them.
        DrafterError: as ``models.drafter.load_drafter``.
    """
    start = load_drafter(drafter_path(cfg.resolve_path(cfg.sft.init_drafter)), target_config=target_config)
    bad = shape_mismatch(drafter_shape(draft_config), drafter_shape(start))
    if bad:
        raise ConfigError(f"sft.init_drafter={cfg.sft.init_drafter}: {bad} "
                          "(SpecForge would load its weights into a drafter of another shape)")


def specforge_run_config(cfg: ExperimentConfig, *, target_path: str, draft_config_file: Path, features: Path,
                         out_dir: Path, num_samples: int, mask_token_id: int, gpus: int,
                         nodes: Optional[Nodes] = None, init_dir: Optional[Path] = None) -> dict:
    """The SpecForge run config (``specforge/config/schema.py``) of the SFT train step.

    CPU: ``attention_backend: sdpa`` (flex_attention has no CPU backward) and
    ``fsdp_sharding: NO_SHARD`` (FSDP1 refuses a CPU), no loader workers.
    GPU: one process per GPU, SpecForge's FSDP default; with ``nodes`` spanning
    several, ``deployment.trainer.{nnodes, master_addr, master_port}`` (every node's
    SpecForge reads its own rank from ``NODE_RANK``, so one run.yaml serves all) and
    the step counts of ``gpus x nnodes`` ranks. ``sft.specforge_overrides``
    (dotted keys) apply last.

    Raises:
        ConfigError: an override names a key outside the nesting it must extend.
        SFTError: several nodes without GPUs.
    """
    t = cfg.training
    nodes = nodes or Nodes()
    if nodes.nnodes > 1 and gpus == 0:
        raise SFTError(f"NNODES={nodes.nnodes}: a multi-node SFT needs GPUs (target.device); run it on one node on a CPU")
    steps_per_epoch, num_epochs, total = sft_steps(cfg, num_samples, gpus * nodes.nnodes)
    run = {
        "run_id": SPECFORGE_RUN_ID,
        "output_dir": str(out_dir),
        "model": {
            "target_model_path": target_path,
            "draft_model_config": str(draft_config_file),
            "torch_dtype": drafter_dtype(cfg),
            "mask_token_id": int(mask_token_id),
        },
        "data": {
            "hidden_states_path": str(features),
            "max_length": cfg.target.max_context,
        },
        "training": {
            "strategy": "dflash",
            "num_epochs": num_epochs,
            "batch_size": t.batch_size,
            "accumulation_steps": t.accumulation_steps,
            "learning_rate": t.learning_rate,
            "lr_scheduler": t.lr_scheduler,
            "warmup_ratio": t.warmup_ratio,
            "max_grad_norm": t.max_grad_norm,
            "num_anchors": t.num_anchors,
            "seed": t.seed,
            "log_interval": t.log_interval,
            "save_interval": cfg.sft.save_interval or max(1, total // 5),
            # each checkpoint carries the optimizer state (~4x the drafter); resume needs the newest only
            "max_checkpoints": 2,
            "attention_backend": t.attention_backend,
        },
    }
    if cfg.sft.max_steps is not None:
        run["training"]["max_steps"] = int(cfg.sft.max_steps)
    if init_dir is not None or cfg.sft.init_drafter:
        # SpecForge starts from an HF DFlash directory only (init_drafter_dir makes one)
        run["model"]["draft_checkpoint_path"] = str(init_dir if init_dir is not None else cfg.resolve_path(cfg.sft.init_drafter))
    if gpus == 0:
        if t.attention_backend == "flex_attention":
            warnings.warn("training.attention_backend=flex_attention has no CPU backward; SFT uses sdpa on CPU",
                          stacklevel=2)
            run["training"]["attention_backend"] = "sdpa"
        run["training"]["fsdp_sharding"] = "NO_SHARD"
        run["data"]["dataloader_num_workers"] = 0
    else:
        run["deployment"] = {"trainer": {"nproc_per_node": gpus}}
        if nodes.nnodes > 1:
            run["deployment"]["trainer"].update(nnodes=nodes.nnodes, master_addr=nodes.master_addr,
                                                master_port=nodes.master_port)
    if cfg.output.tensorboard and gpus > 0:
        run["tracking"] = {"report_to": "tensorboard"}
    for k, v in cfg.sft.specforge_overrides.items():
        apply_override(run, k, v)
    return run


def validate_specforge_run(run: dict) -> None:
    """Validate ``run`` against SpecForge's schema before spending a subprocess on it.

    Raises:
        ConfigError: SpecForge rejects it (e.g. a bad ``sft.specforge_overrides`` key).
    """
    try:
        specforge_run_config_class().model_validate(run)
    except Exception as e:  # pydantic ValidationError or SpecForge's ValueError
        raise ConfigError(f"SpecForge rejects the SFT run config (check sft.specforge_overrides): {e}") from None


def latest_checkpoint(ckpt_root: Path) -> Optional[Path]:
    """SpecForge's newest complete step directory under ``ckpt_root``, or None."""
    state_file, resolve = specforge_checkpoint_layout()
    if not ckpt_root.is_dir() or not any(ckpt_root.glob(f"{SPECFORGE_RUN_ID}-step*")):
        return None
    try:
        d = Path(resolve(str(ckpt_root)))
    except (FileNotFoundError, ValueError):
        return None
    return d if (d / state_file).is_file() else None


def run_train(d: Path, run: dict, cfg: ExperimentConfig, gpus: int) -> dict:
    """Run ``specforge train -c run.yaml`` (output streamed), resuming from its latest checkpoint.

    Raises:
        SFTError: SpecForge exits non-zero (its output above says why).
    """
    import yaml

    ckpts = Path(run["output_dir"])
    latest = latest_checkpoint(ckpts)
    if latest is not None:
        run = json.loads(json.dumps(run))
        run["training"]["resume_from"] = str(ckpts)
        run["model"].pop("draft_checkpoint_path", None)  # SpecForge: warm start and full resume are exclusive
        print(f"[sft train] resuming SpecForge from {latest.name}", flush=True)
    validate_specforge_run(run)
    run_yaml = d / "run.yaml"
    atomic_write_bytes(run_yaml, yaml.safe_dump(run, sort_keys=False).encode())
    cmd, env = _specforge_train_cmd(run_yaml, lm_head_recompute=sft_lm_head_recompute(cfg))
    if run.get("deployment", {}).get("trainer", {}).get("nnodes", 1) > 1:
        _publish_launch(d.parent, run_yaml)  # the other nodes join this launch (follow_node0)
    print(f"[sft train] {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise SFTError(f"sft train: SpecForge exited with status {rc} (its log is above; run.yaml: {run_yaml}); "
                       "rerunning the same command resumes from its last checkpoint")
    latest = latest_checkpoint(ckpts)
    if latest is None:
        raise SFTError(f"sft train: SpecForge finished but wrote no checkpoint under {ckpts}")
    return {"checkpoint": str(latest), "step": int(re.search(r"-step(\d+)$", latest.name).group(1))}


def run_train_validated(d: Path, run: dict, cfg: ExperimentConfig, gpus: int, *, num_samples: int, valset,
                        target_config, flops_at, tensorboard_dir: Optional[Path], plot_path: Path) -> dict:
    """The train step in segments of ``sft.val_interval`` steps with a validation point after each
    (``specforge_opd.eval.validation``); resumable at any point.

    Every segment is one ``specforge train`` run resumed from the previous one's checkpoint,
    with SpecForge's ``total_steps`` (the LR schedule's horizon) fixed to the whole run and
    ``max_steps`` (its early stop) at the segment's end, so the schedule is the one an
    unsegmented run follows. Each segment's checkpoint is exported to
    ``curve/step_<N>`` before SpecForge may prune it, and its validation tau recorded.

    With ``sft.plateau_patience`` set, training stops before the next segment once the
    curve has plateaued (``validation.plateaued``); ``sft.max_steps`` is then only a cap.

    ``flops_at(step)`` returns the drafter's cumulative ``FlopsLedger`` after ``step``
    optimizer steps (its start's history included); each curve export records it.

    Returns the step's stats: ``checkpoint``/``step`` of the last segment, ``curve``, ``selected``
    ``plateau_step`` (the step at which the plateau rule stopped it, or None) and ``paused_at``
    (``sft.pause_at_step`` reached: the step is not marked done, so the same command continues it).

    Raises:
        SFTError: a segment ended at another step than planned.
    """
    steps_per_epoch, _, total = sft_steps(cfg, num_samples, gpus)
    ends = segment_ends(total, cfg.sft.val_interval or steps_per_epoch)
    curve = read_curve(d)
    tb = None
    stopped = paused = None
    for end in ends:
        if any(p["step"] == end for p in curve):
            continue
        done = max((p["step"] for p in curve), default=0)
        if cfg.sft.pause_at_step is not None and done >= cfg.sft.pause_at_step:
            paused = done
            print(f"[sft val] pausing at step {done} (sft.pause_at_step={cfg.sft.pause_at_step}); the same command "
                  "with a later or no sft.pause_at_step continues", flush=True)
            break
        if plateaued(curve, cfg.sft.plateau_patience, cfg.sft.plateau_band):
            stopped = done
            print(f"[sft val] plateau at step {stopped}: the last {cfg.sft.plateau_patience} validation points are "
                  f"within {cfg.sft.plateau_band} tau of the best before them; stopping", flush=True)
            break
        seg = json.loads(json.dumps(run))
        seg["training"]["total_steps"] = total
        seg["training"]["max_steps"] = end
        seg_stats = run_train(d, seg, cfg, gpus)
        if seg_stats["step"] != end:
            raise SFTError(f"sft train: the segment to step {end} ended at step {seg_stats['step']} "
                           f"({seg_stats['checkpoint']}); delete that train directory to start the step again")
        model = load_specforge_checkpoint(seg_stats["checkpoint"], target_config)
        # a curve export is a drafter in its own right (a baseline's matched point, a long run's
        # budget point): it carries its cumulative FLOPs ledger as the final export does
        ledger = flops_at(end)
        export = save_drafter(model, d / "curve" / f"step_{end:07d}", metadata={"stage": "sft", "step": end,
                                                                                 "target_dtype": cfg.target.dtype,
                                                                                 "flops": ledger.to_dict()},
                              dtype=cfg.target.dtype)
        tau = valset.tau(model)
        curve = add_point(d, {"step": end, "tau": tau, "drafter_flops": ledger.drafter_budget, "export": str(export),
                              "checkpoint": seg_stats["checkpoint"]})
        print(f"[sft val] step {end}/{total}: validation tau {tau:.3f} on {len(valset.prompts)} prompts", flush=True)
        if tensorboard_dir is not None:
            if tb is None:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(tensorboard_dir))
            tb.add_scalar("sft/val_tau", tau, end)
            tb.flush()
    if tb is not None:
        tb.close()
    last = max(curve, key=lambda p: p["step"])  # the newest segment, whether it ran now or before
    stats = {"checkpoint": last["checkpoint"], "step": last["step"]}
    if stopped is None and plateaued(curve, cfg.sft.plateau_patience, cfg.sft.plateau_band):
        stopped = max(p["step"] for p in curve)
    stats["plateau_step"] = stopped
    stats["paused_at"] = paused
    chosen = select(curve, cfg.sft.select)
    plot_curve(curve, plot_path, chosen["step"])
    print(f"[sft val] exporting step {chosen['step']} (sft.select={cfg.sft.select}: validation tau {chosen['tau']:.3f}); "
          f"curve: {plot_path}", flush=True)
    return dict(stats, curve=curve, selected=chosen)

