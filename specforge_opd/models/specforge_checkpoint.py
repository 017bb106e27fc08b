"""SpecForge DFlash checkpoints, read weights-only: the state file, its resume contract and whether it fits.

``read_specforge_checkpoint`` finds a SpecForge run's ``training_state.pt`` (the file, a
``<run>-step<N>`` directory, a ``<run>-latest`` link or the run's output directory), reads it with
``torch.load(weights_only=True)`` and returns the drafter's weights and shape;
``drafter.load_specforge_checkpoint`` builds the ``DFlashDraftModel`` from them.

``models.drafter`` imports this module (``load_drafter`` takes a checkpoint as one of its forms), so this
module does not import the drafter: it raises ``SpecForgeCheckpointError``, which
``drafter.load_specforge_checkpoint`` re-raises as ``DrafterError`` with the same message.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specforge_opd.errors import UserError
from specforge_opd.models.adapter import specforge_checkpoint_layout


class SpecForgeCheckpointError(UserError, ValueError):
    """A SpecForge checkpoint is missing, unsafe to read, not DFlash, or does not fit the target."""


@dataclass(frozen=True)
class SpecForgeCheckpoint:
    """A SpecForge DFlash checkpoint as read from disk.

    Attributes:
        state_path: the ``training_state.pt`` read.
        weights: ``draft_state_dict`` without ``embed_tokens``/``lm_head`` (the target's), tensors as stored.
        shape: ``drafter.derive_draft_config`` keywords: ``num_hidden_layers``, ``block_size``,
            ``mask_token_id`` (ints), ``target_layer_ids`` (list of ints) and ``intermediate_size``
            (the MLP width read from the weights, None when they have no MLP).
    """

    state_path: Path
    weights: dict[str, torch.Tensor]
    shape: dict


def _resolve_state_file(path: Path) -> Path:
    """The ``training_state.pt`` of a SpecForge checkpoint given as the file, a step dir, a ``-latest`` link or a run dir.

    Raises:
        SpecForgeCheckpointError: a file of another name, or a directory with no checkpoint.
    """
    state_file, resolve = specforge_checkpoint_layout()
    if path.is_file():
        if path.name != state_file:
            raise SpecForgeCheckpointError(f"{path} is not a SpecForge {state_file}")
        return path
    if (path / state_file).is_file():
        return path / state_file
    try:
        return Path(resolve(str(path))) / state_file
    except (FileNotFoundError, ValueError) as e:
        raise SpecForgeCheckpointError(f"{path}: no config.json (not an HF DFlash directory) and no SpecForge "
                                       f"checkpoint ({state_file}, a -step<N> dir or a -latest link): {e}")


def recorded_draft_config(state: dict) -> Optional[dict]:
    """The draft config.json a SpecForge checkpoint was trained with, if still on disk unchanged.

    SpecForge records ``("file-stat-v2", path, ("sha256", "", size, digest))``
    under ``specforge_model_provenance["draft_config"]``; the file is trusted
    only when its sha256 still matches. Returns the parsed JSON or None.
    """
    try:
        rec = dict(state.get("specforge_model_provenance") or ()).get("draft_config")
        _kind, fpath, (algo, _name, _size, digest) = rec
        data = Path(fpath).read_bytes()
    except (TypeError, ValueError, OSError):
        return None
    if algo != "sha256" or hashlib.sha256(data).hexdigest() != digest:
        return None
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return None


def read_specforge_checkpoint(path: Path, target_config, *, stacklevel: int = 2) -> SpecForgeCheckpoint:
    """Read a SpecForge DFlash checkpoint without unpickling code, and check that it fits the target.

    ``path``: a ``training_state.pt``, a ``<run>-step<N>`` directory, a ``<run>-latest`` link or the run's
    output directory. The state is read with ``torch.load(weights_only=True)``
    (tensors and plain metadata only; SpecForge's own resume uses ``weights_only=False``, which this
    project forbids). Checked against ``target_config`` (an HF config, or one with ``text_config``): the
    hidden size of ``fc.weight`` and, when the draft config.json it was trained with is still on disk
    unchanged (``recorded_draft_config``), its vocabulary, hidden size and target layer count; when that
    file is gone or changed a ``UserWarning`` says so (``stacklevel`` as ``warnings.warn``'s, counted from
    this function).

    Raises:
        SpecForgeCheckpointError: no checkpoint there, not weights-only readable, not a DFlash
            checkpoint (no ``draft_state_dict``, another strategy, no ``dflash_*`` resume contract), or
            weights or a recorded config that do not fit the target.
    """
    state_path = _resolve_state_file(Path(path))
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecForgeCheckpointError(
            f"{state_path} cannot be read safely (torch.load weights_only=True): {e}; "
            "export it to an HF directory with a trusted SpecForge install and pass that instead"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise SpecForgeCheckpointError(f"{state_path} has no draft_state_dict (not a SpecForge training state)")
    if state.get("strategy") not in (None, "dflash"):
        raise SpecForgeCheckpointError(f"{state_path} was trained with strategy {state.get('strategy')!r}, not dflash")
    need = ("dflash_draft_num_hidden_layers", "dflash_target_layer_ids", "dflash_block_size", "dflash_mask_token_id")
    missing = [k for k in need if k not in state]
    if missing:
        raise SpecForgeCheckpointError(f"{state_path} lacks the DFlash resume contract fields {missing}")
    weights = {k: v for k, v in state["draft_state_dict"].items() if "embed_tokens" not in k and "lm_head" not in k}
    t = getattr(target_config, "text_config", target_config)
    fc = weights.get("fc.weight")
    if fc is not None and fc.shape[0] != t.hidden_size:
        raise SpecForgeCheckpointError(f"drafter {state_path} does not fit the target: hidden size {fc.shape[0]} "
                                       f"!= target {t.hidden_size}")
    # The drafter borrows the target's embedding and lm_head, so its weights do not
    # show the vocabulary; the draft config it was trained with does.
    recorded = recorded_draft_config(state)
    if recorded is None:
        warnings.warn(f"{state_path}: its draft config.json is gone or changed; the vocabulary it was trained "
                      "for cannot be checked against the target", stacklevel=stacklevel)
    else:
        problems = [f"{k} {recorded[k]} != target {getattr(t, k)}" for k in ("vocab_size", "hidden_size")
                    if k in recorded and recorded[k] != getattr(t, k)]
        n = recorded.get("num_target_layers")
        if n is not None and n != t.num_hidden_layers:
            problems.append(f"num_target_layers {n} != target's {t.num_hidden_layers} layers")
        if problems:
            raise SpecForgeCheckpointError(f"drafter {state_path} does not fit the target: " + "; ".join(problems))
    gate = weights.get("layers.0.mlp.gate_proj.weight")
    shape = {
        "num_hidden_layers": int(state["dflash_draft_num_hidden_layers"]),
        "block_size": int(state["dflash_block_size"]),
        "mask_token_id": int(state["dflash_mask_token_id"]),
        "target_layer_ids": [int(i) for i in state["dflash_target_layer_ids"]],
        "intermediate_size": int(gate.shape[0]) if gate is not None else None,
    }
    return SpecForgeCheckpoint(state_path=state_path, weights=weights, shape=shape)
