"""Resumable OPD training state and the HF export (DESIGN.md section 6).

Layout under the run's ``out_dir``::

    checkpoints/step-000012/       torch.distributed.checkpoint (DCP) files: model + optimizer
                 trainer_state.json  step counters, data cursor, scheduler state, fingerprint
                 rng-rank<r>.safetensors  each rank's torch RNG state
    checkpoints/latest             name of the newest complete step directory
    final/                         HF DFlash export (``drafter.save_drafter``)

A step directory is written under a temporary name and renamed when every rank
has finished, and ``latest`` is replaced atomically afterwards, so a kill at any
moment leaves the previous checkpoint intact. Nothing from disk is unpickled
freely on load: DCP's ``.metadata`` goes through the allowlist unpickler of
``train.safe_dcp`` and its non-tensor entries through ``torch.load(weights_only=True)``;
the rest is DCP tensors, JSON and safetensors. A full disk while saving raises
``DiskFullError`` naming the checkpoint and removes the partial step directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from specforge_opd.atomic import atomic_write_text
from specforge_opd.errors import DiskFullError, UserError, is_disk_full
from specforge_opd.models.drafter import build_drafter, save_drafter
from specforge_opd.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, load_metadata

STATE_FILE = "trainer_state.json"
LATEST = "latest"


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, incomplete, or belongs to another run; the message says which."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()



def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, model, optimizer, trainer_state: dict, *, keep: Optional[int] = None) -> Path:
    """Write a resumable checkpoint for ``step``; every rank must call it (collective).

    Args:
        ckpt_root: ``<out_dir>/checkpoints``.
        model / optimizer: the (possibly FSDP2-sharded) drafter and its optimizer;
            DCP writes each rank's shards.
        trainer_state: JSON-serializable dict (counters, cursor, scheduler state, fingerprint).
        keep: when set, keep only the ``keep`` newest step directories (``training.keep_checkpoints``);
            older ones are deleted after ``latest`` names the new one, so a kill
            during pruning still leaves a complete latest checkpoint.
    Returns:
        The completed step directory.
    Raises:
        DiskFullError: the disk filled up; the partial step directory is removed and the
            previous checkpoint (``latest``) is intact.
    """
    root = Path(ckpt_root)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        save_file(_rng_state(), str(tmp / f"rng-rank{_rank()}.safetensors"))
    except Exception as e:
        # torch's zip writer reports a short write as "unexpected pos", not ENOSPC
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise DiskFullError(final, f"saving the checkpoint of step {step}; the previous checkpoint is kept") from e
        raise
    _barrier()
    if _rank() == 0:
        atomic_write_text(tmp / STATE_FILE, json.dumps(dict(trainer_state, step=step), indent=2, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / LATEST, final.name + "\n")
        if keep is not None:
            steps = sorted(d for d in root.glob("step-*") if d.is_dir())
            for old in steps[: max(0, len(steps) - keep)]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Optional[Path]:
    """The newest complete step directory under ``ckpt_root``, or None when there is none.

    Raises:
        CheckpointError: ``latest`` names a directory that is missing or incomplete.
    """
    root = Path(ckpt_root)
    marker = root / LATEST
    if not marker.is_file():
        return None
    d = root / marker.read_text().strip()
    if not (d / STATE_FILE).is_file():
        raise CheckpointError(f"{marker} points at {d}, which is missing or incomplete; delete {marker} to restart from scratch")
    return d


def load_checkpoint(step_dir: str | os.PathLike, model, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG from ``step_dir``; return its trainer state.

    Every rank must call it (collective). The model and optimizer must be built
    (and sharded) the same way as when saved; DCP reshards when the world size changed.

    Raises:
        CheckpointError: missing trainer state.
        UnsafeCheckpointError: the DCP metadata names a class a checkpoint never holds
            (refused without running it; ``train.safe_dcp``).
    """
    d = Path(step_dir)
    state_file = d / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{d}: no {STATE_FILE}; not a complete OPD checkpoint")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_metadata(d / ".metadata")  # refuse a planted file here: DCP would wrap the refusal into its own error
    dcp.load(state, checkpoint_id=str(d), storage_reader=SafeFileSystemReader(str(d)), planner=SafeLoadPlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = d / f"rng-rank{_rank()}.safetensors"
    if rng.is_file():
        r = load_file(str(rng))
        torch.set_rng_state(r["cpu"])
        if "cuda" in r and torch.cuda.is_available():
            torch.cuda.set_rng_state(r["cuda"])
    return json.loads(state_file.read_text())


def export_drafter(model, out_dir: str | os.PathLike, metadata: Optional[dict] = None, *, dtype=None) -> Optional[Path]:
    """Gather the full drafter and write the SGLang-loadable HF directory (rank 0 writes).

    Every rank must call it (collective under FSDP2). Uses ``drafter.save_drafter``,
    the one shared exporter; ``dtype`` (the target's, ``target.dtype``) is the weights'
    dtype on disk and ``config.json``'s ``dtype`` (None: fp32). Returns the directory
    on rank 0, None elsewhere.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = None
    if _rank() == 0:
        plain = build_drafter(model.config, getattr(model.config, "_attn_implementation", None) or "sdpa")
        plain.load_state_dict({k: v.float() for k, v in full.items()})
        out = save_drafter(plain, out_dir, metadata=metadata, dtype=dtype)
    _barrier()
    return out
