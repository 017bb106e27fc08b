"""The DFlash drafter: derive its config from the target, load it in any accepted form, export it, check it fits.

``load_drafter`` is the one loader behind every verb that takes a drafter: an HF DFlash
directory, ``published:NAME`` or a SpecForge checkpoint (read weights-only).

One exporter serves the SFT stage, the OPD trainer and every other writer of
drafters: ``save_drafter`` writes the HF layout SGLang loads unchanged
(DESIGN.md section 6): ``config.json`` with ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``dflash_config.{mask_token_id, target_layer_ids}``, no
``auto_map``, no tied embeddings; weights ``layers.*``, ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` in ``model.safetensors`` (no embedding,
no lm_head: the drafter borrows the target's).

Exports are written in the target's dtype and say so in ``config.json`` (``dtype``):
SGLang under ``--dtype auto`` serves a drafter whose config has no dtype, or
``float32``, in float16, next to a bf16 Qwen3 target.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from specforge_opd.atomic import private_dir_to_umask
from specforge_opd.errors import DiskFullError, UserError, is_disk_full, process_umask
from specforge_opd.models.adapter import DFlashDraftModel, Qwen3Config, build_target_layer_ids
from specforge_opd.models.published import SCHEME, resolve
from specforge_opd.models.specforge_checkpoint import SpecForgeCheckpointError, read_specforge_checkpoint

#: Fields copied from the target config into a derived drafter config.
_TARGET_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "rope_theta",
    "rope_parameters",
    "head_dim",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

METADATA_FILE = "specforge_opd.json"

#: The dtypes an export may be written in, by the name ``config.json`` records.
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ``dflash_config`` extensions of newer DFlash drafters that SpecForge's ``DFlashDraftModel``
#: (and so the OPD replay) does not implement, with the value that means "not used".
_UNSUPPORTED_DFLASH_KEYS = {
    "conv_kernel_size": 0,
    "conv_group_size": 0,
    "selector_rank": 0,
    "selector_top_k": 0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": 0.0,
    "input_embedding_scale": 1.0,
    "attention_sink_bias": False,
    "attention_value_scale": None,
    "projector_type": None,
}


class DrafterError(UserError, ValueError):
    """A drafter does not load or does not fit the target; the message says what and how to fix it."""


def _text_config(cfg):
    return getattr(cfg, "text_config", cfg)


def derive_draft_config(
    target_config,
    *,
    num_hidden_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int,
    target_layer_ids: Optional[list[int]] = None,
    intermediate_size: Optional[int] = None,
) -> Qwen3Config:
    """Build a DFlash drafter config from the target's HF config.

    Hidden size, head layout and vocabulary come from the target (the drafter
    reads the target's embedding and lm_head); ``target_layer_ids`` default to
    SpecForge's ``build_target_layer_ids(num_target_layers, num_hidden_layers)``.

    Raises:
        DrafterError: a layer id outside the target, or a mask id outside its vocabulary.
    """
    t = _text_config(target_config)
    payload: dict[str, Any] = {}
    for f in _TARGET_FIELDS:
        v = getattr(t, f, None)
        if v is not None:
            payload[f] = v
    if "head_dim" not in payload:
        payload["head_dim"] = t.hidden_size // t.num_attention_heads
    if intermediate_size is not None:
        payload["intermediate_size"] = intermediate_size
    n_target = int(t.num_hidden_layers)
    ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(n_target, num_hidden_layers)
    bad = [i for i in ids if not 0 <= i < n_target]
    if bad:
        raise DrafterError(
            f"draft.target_layer_ids {bad} are outside the target's {n_target} decoder layers (0..{n_target - 1})"
        )
    if not 0 <= mask_token_id < t.vocab_size:
        raise DrafterError(f"draft.mask_token_id={mask_token_id} is outside the target vocabulary ({t.vocab_size})")
    payload.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=num_hidden_layers,
        num_target_layers=n_target,
        block_size=block_size,
        layer_types=["full_attention"] * num_hidden_layers,
        sliding_window=None,
        use_sliding_window=False,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        use_cache=True,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in ids]},
    )
    if payload.get("pad_token_id") is None:
        payload["pad_token_id"] = 0
    return Qwen3Config(**payload)


def build_drafter(draft_config: Qwen3Config, attention_backend: str = "sdpa", seed: Optional[int] = None) -> DFlashDraftModel:
    """A freshly initialized ``DFlashDraftModel`` (fp32) for ``draft_config``."""
    draft_config._attn_implementation = attention_backend
    if seed is not None:
        torch.manual_seed(seed)
    model = DFlashDraftModel(draft_config)
    return model.float()


def drafter_layer_ids(model_or_config) -> list[int]:
    cfg = getattr(model_or_config, "config", model_or_config)
    return [int(i) for i in cfg.dflash_config["target_layer_ids"]]


#: The ``draft`` config fields that fix a drafter's shape: a run continuing a drafter must say the same.
SHAPE_FIELDS = ("num_hidden_layers", "block_size", "target_layer_ids", "intermediate_size")


def drafter_shape(model_or_config) -> dict:
    """The drafter's shape as ``draft`` config values: ``{num_hidden_layers, block_size, target_layer_ids,
    intermediate_size}`` (ints; the layer ids a list of ints)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return {"num_hidden_layers": int(cfg.num_hidden_layers), "block_size": int(cfg.block_size),
            "target_layer_ids": drafter_layer_ids(cfg), "intermediate_size": int(cfg.intermediate_size)}


def shape_overrides(shape: dict) -> list[str]:
    """``draft.<field>=<value>`` overrides that make a config describe a drafter of ``shape`` (``drafter_shape``)."""
    return [f"draft.{k}={str(v).replace(' ', '')}" for k, v in shape.items()]


def shape_mismatch(want: dict, have: dict) -> Optional[str]:
    """``draft.F is A but the drafter has B; ...; set draft.F=B ...`` for the fields of ``want`` (absent or None:
    not compared) that differ from ``have`` (``drafter_shape``); None when every compared field agrees."""
    bad = [k for k in SHAPE_FIELDS if want.get(k) is not None and want[k] != have[k]]
    if not bad:
        return None
    fix = " ".join(o for k, o in zip(have, shape_overrides(have)) if k in bad)
    return "; ".join(f"draft.{k} is {want[k]} but the drafter has {have[k]}" for k in bad) + f"; set {fix}"


def drafter_mask_token_id(model_or_config) -> int:
    cfg = getattr(model_or_config, "config", model_or_config)
    return int(cfg.dflash_config["mask_token_id"])


def check_compatible(draft_config, target_config, *, expected_mask_token_id: Optional[int] = None, where=None) -> None:
    """Raise ``DrafterError`` naming every mismatch between a drafter and the target (and ``where``, the drafter's path).

    Checked: hidden size, number of target layers (and that every layer id
    exists), vocabulary size, and the mask token (inside the vocabulary, and
    equal to ``expected_mask_token_id`` when given).
    """
    t = _text_config(target_config)
    problems = []
    if draft_config.hidden_size != t.hidden_size:
        problems.append(f"hidden size {draft_config.hidden_size} != target {t.hidden_size}")
    n_target = getattr(draft_config, "num_target_layers", None)
    if n_target is not None and n_target != t.num_hidden_layers:
        problems.append(f"num_target_layers {n_target} != target's {t.num_hidden_layers} layers")
    dfc = getattr(draft_config, "dflash_config", None) or {}
    ids = dfc.get("target_layer_ids")
    if not ids:
        problems.append("dflash_config.target_layer_ids is missing")
    elif any(not 0 <= i < t.num_hidden_layers for i in ids):
        problems.append(f"target_layer_ids {ids} exceed the target's {t.num_hidden_layers} layers")
    vocab = getattr(draft_config, "vocab_size", None)
    if vocab is not None and vocab != t.vocab_size:
        problems.append(f"vocab_size {vocab} != target {t.vocab_size}")
    mask = dfc.get("mask_token_id")
    if mask is None:
        problems.append("dflash_config.mask_token_id is missing")
    elif not 0 <= mask < t.vocab_size:
        problems.append(f"mask_token_id {mask} outside the target vocabulary {t.vocab_size}")
    elif expected_mask_token_id is not None and mask != expected_mask_token_id:
        problems.append(f"mask_token_id {mask} != configured draft.mask_token_id {expected_mask_token_id}")
    if problems:
        name = f"drafter {where}" if where is not None else "drafter"
        raise DrafterError(f"{name} does not fit the target: " + "; ".join(problems)
                           + "; use a drafter trained for this target (draft.path), or set target.path to its target")


def dtype_name(dtype) -> str:
    """The ``config.json`` name of ``dtype`` (a ``torch.dtype`` or one of ``EXPORT_DTYPES``' names).

    Raises:
        DrafterError: not float32, bfloat16 or float16.
    """
    name = str(dtype).replace("torch.", "") if dtype is not None else None
    if name not in EXPORT_DTYPES:
        raise DrafterError(f"drafter dtype {dtype!r} is not one of {sorted(EXPORT_DTYPES)}; "
                           "export in the target's dtype (target.dtype)")
    return name


def _atomic_dir(out_dir: Path):
    """A fresh sibling of ``out_dir`` to build it in, with ``mkdir``'s mode (not mkdtemp's 0700)."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        return private_dir_to_umask(Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent)))
    except OSError as e:
        if is_disk_full(e):
            raise DiskFullError(out_dir) from e
        raise


def save_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, metadata: Optional[dict] = None, *,
                 dtype=None) -> Path:
    """Export ``model`` as an SGLang-loadable HF DFlash directory, atomically.

    Writes ``config.json``, ``model.safetensors`` and, when given,
    ``specforge_opd.json`` with ``metadata`` (training step, FLOPs, provenance).
    An existing ``out_dir`` is replaced only after the new one is complete.

    Args:
        dtype: the weights' dtype on disk, recorded as ``config.json`` ``dtype`` (and
            ``torch_dtype``, for readers older than transformers 4.56): pass the
            target's dtype (``target.dtype``: bfloat16 for Qwen3), which is what SGLang
            then serves the drafter in. None: the model's own parameter dtype.

    Files and directories get the process umask's modes (0644/0755 under umask 0022).

    Raises:
        DrafterError: ``dtype`` is not float32, bfloat16 or float16.
        DiskFullError: the disk filled up; the partial directory is removed and an
            existing ``out_dir`` is untouched.
    """
    name = dtype_name(dtype if dtype is not None else next(model.parameters()).dtype)
    out = Path(out_dir)
    tmp = _atomic_dir(out)
    try:
        cfg = model.config.to_dict()
        for k in ("auto_map", "_attn_implementation_autoset", "transformers_version", "_name_or_path"):
            cfg.pop(k, None)
        cfg["architectures"] = ["DFlashDraftModel"]
        cfg["tie_word_embeddings"] = False
        cfg["block_size"] = int(model.block_size)
        cfg["dtype"] = cfg["torch_dtype"] = name
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        state = {k: v.detach().to(EXPORT_DTYPES[name]).contiguous().cpu() for k, v in model.state_dict().items()
                 if "embed_tokens" not in k and "lm_head" not in k}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if metadata is not None:
            (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True, default=str))
        for f in tmp.iterdir():  # safetensors' writer makes its file owner-only
            os.chmod(f, 0o666 & ~process_umask())
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, DiskFullError) and is_disk_full(e):
            raise DiskFullError(out, f"exporting the drafter: {str(e).splitlines()[0][:120]}") from e
        raise
    return out


def drafter_path(path: str | os.PathLike) -> Path:
    """A drafter location as a directory: ``published:NAME`` names one shipped in the package.

    Raises:
        DrafterError: ``published:NAME`` names no published drafter.
    """
    if str(path).startswith(SCHEME):
        try:
            return resolve(str(path))
        except ValueError as e:
            raise DrafterError(str(e)) from None
    return Path(path)


def read_drafter_metadata(path: str | os.PathLike) -> dict:
    """The export's ``specforge_opd.json`` (empty for checkpoints that carry none)."""
    p = drafter_path(path) / METADATA_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def check_target_dtype(metadata: dict, target_dtype: str, where) -> None:
    """Refuse a drafter trained against a target of another dtype (its features and teacher differ).

    ``metadata`` is the export's ``specforge_opd.json``; one without ``target_dtype``
    (a published or SpecForge checkpoint) is accepted.

    Raises:
        DrafterError: the recorded dtype is not ``target_dtype``.
    """
    have = metadata.get("target_dtype")
    if have is not None and have != target_dtype:
        raise DrafterError(
            f"drafter {where} was trained against a {have} target, but target.dtype={target_dtype}; "
            f"set target.dtype={have}, or train the drafter again with this dtype"
        )


def _config_dtype(payload: dict, where) -> Optional[str]:
    """``config.json``'s ``dtype`` (or the older ``torch_dtype``) as a name, None when absent."""
    names = {k: payload[k] for k in ("dtype", "torch_dtype") if payload.get(k) is not None}
    if len(set(names.values())) > 1:
        raise DrafterError(f"drafter {where}: config.json dtype={names['dtype']!r} and torch_dtype={names['torch_dtype']!r} "
                           "disagree; set both to the dtype the weights were trained for")
    if not names:
        return None
    value = next(iter(names.values()))
    if value not in EXPORT_DTYPES:
        raise DrafterError(f"drafter {where}: config.json {next(iter(names))}={value!r} is not one of "
                           f"{sorted(EXPORT_DTYPES)}; set it to the target's dtype")
    return value


def _block_size(payload: dict, dfc: dict, where) -> int:
    """``block_size`` at the top level (older DFlash configs) or in ``dflash_config`` (newer ones)."""
    top, inner = payload.get("block_size"), dfc.get("block_size")
    if top is None and inner is None:
        raise DrafterError(f"drafter {where}: config.json lacks block_size (at the top level or in dflash_config)")
    if top is not None and inner is not None and int(top) != int(inner):
        raise DrafterError(f"drafter {where}: config.json block_size={top} and dflash_config.block_size={inner} "
                           "disagree (SGLang uses dflash_config.block_size); make them equal")
    value = int(inner if inner is not None else top)
    if value < 2:
        raise DrafterError(f"drafter {where}: block_size={value}; a DFlash block needs at least 2 slots")
    return value


def _check_supported(config: Qwen3Config, dfc: dict, where) -> None:
    """Refuse drafter features the OPD replay does not implement, by name (instead of training them wrongly)."""
    types = list(config.layer_types or [])
    other = {i: t for i, t in enumerate(types) if t != "full_attention"}
    if other:
        raise DrafterError(
            f"drafter {where}: layer_types has {sorted(set(other.values()))} at layers {sorted(other)} "
            f"(sliding_window={getattr(config, 'sliding_window', None)}); the OPD replay gives every drafter layer the "
            "full block mask, so sliding-window drafters are not supported; start from a drafter whose layer_types "
            "are all full_attention")
    if getattr(config, "is_causal", None):
        raise DrafterError(f"drafter {where}: config.json is_causal=true (causal attention inside the block) is not "
                           "supported: DFlash replay attends to every slot of a block; use a drafter without is_causal")
    used = [f"{k}={dfc[k]!r}" for k, off in _UNSUPPORTED_DFLASH_KEYS.items() if dfc.get(k) is not None and dfc[k] != off]
    if used:
        raise DrafterError(f"drafter {where}: dflash_config uses {', '.join(used)}, which SpecForge's DFlashDraftModel "
                           "does not implement; use a plain DFlash drafter (architectures [DFlashDraftModel] without them)")


def load_draft_config(path: str | os.PathLike) -> Qwen3Config:
    """Read a DFlash ``config.json`` (directory or file) into a ``Qwen3Config``.

    Both published layouts are accepted: ``block_size`` at the top level or inside
    ``dflash_config`` (SGLang reads either, ``dflash_config`` first); the result has
    it at the top level, where SpecForge's model reads it. ``mask_token_id``,
    ``target_layer_ids`` and ``num_target_layers`` may likewise sit at either level (the
    result has them in ``dflash_config``, and ``num_target_layers`` at the top level too). ``layer_types`` are the
    ones transformers derives when the file has none (``use_sliding_window``,
    ``max_window_layers``), as SGLang sees them.

    Raises:
        DrafterError: missing file, wrong architecture, missing ``dflash_config`` fields,
            ``block_size`` (or another field of either level) missing or given twice with two values, a ``dtype`` that is not
            float32/bfloat16/float16, or a feature the OPD replay does not implement
            (sliding-window or causal layers, DFlash2-style ``dflash_config`` extensions).
    """
    p = drafter_path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise DrafterError(f"drafter {path}: no config.json (expected an HF DFlash directory)")
    payload = json.loads(cfg_file.read_text())
    arch = payload.get("architectures") or []
    if arch != ["DFlashDraftModel"]:
        raise DrafterError(f"drafter {path}: architectures={arch}, expected ['DFlashDraftModel'] "
                           "(other DFlash variants, such as DFlash2DraftModel, are not supported)")
    dfc = dict(payload.get("dflash_config") or {})
    for k in ("mask_token_id", "target_layer_ids", "num_target_layers"):
        # SGLang reads these from dflash_config first, then from the top level; SpecForge's model
        # reads dflash_config only: gather them there (num_target_layers at the top level too)
        if k in dfc and payload.get(k) is not None and payload[k] != dfc[k]:
            raise DrafterError(f"drafter {path}: config.json {k}={payload[k]} and dflash_config.{k}={dfc[k]} disagree "
                               "(SGLang uses dflash_config's); make them equal")
        if k not in dfc and payload.get(k) is not None:
            dfc[k] = payload[k]
    for k in ("mask_token_id", "target_layer_ids"):
        if k not in dfc:
            raise DrafterError(f"drafter {path}: config.json lacks dflash_config.{k}")
    payload["dflash_config"] = dfc
    payload["block_size"] = _block_size(payload, dfc, path)
    dtype = _config_dtype(payload, path)
    payload.pop("torch_dtype", None)
    if dtype is not None:
        payload["dtype"] = dtype
    payload.pop("auto_map", None)
    payload["tie_word_embeddings"] = False
    payload["num_target_layers"] = dfc.get("num_target_layers", max(dfc["target_layer_ids"]) + 1)
    config = Qwen3Config(**payload)
    _check_supported(config, dfc, path)
    return config


def drafter_dtype(config) -> Optional[str]:
    """The dtype a drafter config declares (``config.json`` ``dtype``) as a name, or None."""
    d = getattr(config, "dtype", None)
    return None if d is None else dtype_name(d)


def load_drafter(path: str | os.PathLike, attention_backend: str = "sdpa", target_config=None, *,
                 target_dtype: Optional[str] = None, expected_mask_token_id: Optional[int] = None) -> DFlashDraftModel:
    """Load a drafter in any accepted form: the one loader every verb that takes a drafter goes through.

    Forms of ``path``:

    - an HF DFlash directory (``config.json`` + ``*.safetensors``): this project's export, a
      SpecForge HF export or a published DFlash drafter;
    - ``published:NAME``: a drafter shipped in the package (``drafter_path``);
    - a SpecForge checkpoint: a ``training_state.pt``, a ``<run>-step<N>`` directory, a
      ``<run>-latest`` link or the run's output directory (``load_specforge_checkpoint``:
      read weights-only, its architecture derived from ``target_config``, which it needs).

    With ``target_config`` given, ``check_compatible`` runs before the weights load (hidden
    size, target layers, vocabulary, the mask token, and ``expected_mask_token_id`` when
    given). The model is fp32 on CPU whatever the file holds (fp32, bf16 or fp16 weights:
    training keeps fp32 master weights).

    Args:
        target_dtype: ``target.dtype`` of this run. An HF drafter whose ``config.json`` declares
            the other half precision (bfloat16 against float16) is refused: it was exported
            for a target served in that dtype. float32 on either side is accepted (SpecForge's
            own exports always declare bfloat16, and loading into the fp32 model is exact);
            ``save_drafter`` re-exports in the target's dtype. None: not checked.

    Raises:
        DrafterError: the path does not exist or holds no drafter, a SpecForge checkpoint without
            ``target_config``, incompatible with the target, bfloat16 against float16, or weights
            that do not match the architecture.
    """
    p = drafter_path(path)
    if not p.exists():
        raise DrafterError(f"drafter path {p} does not exist (draft.path)")
    if not (p.is_dir() and (p / "config.json").is_file()):
        # no HF config.json: a SpecForge checkpoint, whose architecture only the target can complete
        if target_config is None:
            raise DrafterError(f"drafter {p} has no config.json, so it is read as a SpecForge checkpoint, "
                               "whose architecture is derived from the target: pass the target's config")
        model = load_specforge_checkpoint(p, target_config, attention_backend)
        check_compatible(model.config, target_config, expected_mask_token_id=expected_mask_token_id, where=p)
        return model
    config = load_draft_config(p)
    have = drafter_dtype(config)
    if {have, target_dtype} == {"bfloat16", "float16"}:
        raise DrafterError(f"drafter {p}: config.json dtype={have}, but target.dtype={target_dtype}; set "
                           f"target.dtype={have} (the dtype it was exported for), or re-export it with save_drafter(..., dtype={target_dtype!r})")
    if target_config is not None:
        check_compatible(config, target_config, expected_mask_token_id=expected_mask_token_id, where=p)
    model = build_drafter(config, attention_backend)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"drafter {p}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if "embed_tokens" not in k and "lm_head" not in k}
    bad = sorted({str(v.dtype) for v in state.values() if v.dtype not in EXPORT_DTYPES.values()})
    if bad:
        raise DrafterError(f"drafter {p}: weights in {bad} (quantized?); only float32/bfloat16/float16 drafters load")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise DrafterError(f"drafter {p}: weights do not match the architecture (missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return model.float()


def load_any_drafter(path: str | os.PathLike, target_config, *, expected_mask_token_id: Optional[int] = None,
                     attention_backend: str = "sdpa", target_dtype: Optional[str] = None) -> DFlashDraftModel:
    """``load_drafter`` with the target config required (so every form, SpecForge checkpoints included, loads).

    Raises:
        DrafterError: as ``load_drafter``.
    """
    return load_drafter(path, attention_backend, target_config, target_dtype=target_dtype,
                        expected_mask_token_id=expected_mask_token_id)


# ---------------------------------------------------------------------------
# SpecForge checkpoints -> DFlashDraftModel (reading them: models/specforge_checkpoint.py)


def load_specforge_checkpoint(path: str | os.PathLike, target_config, attention_backend: str = "sdpa"):
    """Load the drafter of a SpecForge DFlash checkpoint without unpickling code.

    ``path``: a ``training_state.pt``, a ``<run>-step<N>`` directory, a
    ``<run>-latest`` link, or the run's output directory. The state is read with
    ``torch.load(weights_only=True)`` (tensors and plain metadata only; SpecForge's
    own resume uses ``weights_only=False``, which this project forbids). The
    architecture comes from the checkpoint's ``dflash_*`` resume contract and
    the target config (hidden size, heads, vocabulary); the MLP width from the
    weights. Returns a ``DFlashDraftModel`` in fp32 on CPU.

    Raises:
        DrafterError: no checkpoint there, not weights-only readable, not a
            DFlash checkpoint, or weights that do not fit the target.
    """
    try:
        # stacklevel 3: the warning names this function's caller
        ckpt = read_specforge_checkpoint(Path(path), target_config, stacklevel=3)
    except SpecForgeCheckpointError as e:
        raise DrafterError(str(e)) from None
    state_path = ckpt.state_path
    try:
        dcfg = derive_draft_config(target_config, **ckpt.shape)
    except DrafterError as e:
        raise DrafterError(f"drafter {state_path} does not fit the target: {e}") from None
    check_compatible(dcfg, target_config)
    model = build_drafter(dcfg, attention_backend)
    try:
        missing_k, unexpected = model.load_state_dict({k: v.float() for k, v in ckpt.weights.items()}, strict=False)
    except RuntimeError as e:
        raise DrafterError(f"drafter {state_path} weights do not fit the target-derived architecture: {e}") from None
    missing_k = [k for k in missing_k if "embed_tokens" not in k and "lm_head" not in k]
    if missing_k or unexpected:
        raise DrafterError(f"drafter {state_path}: weights do not match (missing {missing_k[:5]}, "
                           f"unexpected {list(unexpected)[:5]})")
    return model.float()
