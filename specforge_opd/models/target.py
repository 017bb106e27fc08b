"""Loading the target model (DESIGN.md sections 5 and 7).

``load_target(cfg.target)`` is what rollout, SFT capture, evaluation and the
trainer's frozen target call; ``path: null`` means the embedded SmolLM2 target,
converted on first use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge_opd.data import assets
from specforge_opd.errors import UserError

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class TargetError(UserError, ValueError):
    """The target cannot be loaded; the message names the setting and the fix."""


@dataclass
class TargetBundle:
    """A loaded target.

    Attributes:
        model: HF causal LM in eval mode, on the configured device and dtype, sdpa attention.
        tokenizer: its tokenizer (with the chat template).
        path: the HF directory it came from.
        identity: 12 hex chars: sha256 of config.json and the weight files' names and
            sizes; shards and checkpoints record it to refuse a different target.
        stop_token_ids: eos of the tokenizer, config and generation config, ``<|im_end|>``
            when the vocabulary has it, and ``target.stop_token_ids``; sorted, unique
            (``stop_token_ids``: the set SGLang stops on too).
    """

    model: Any
    tokenizer: Any
    path: Path
    identity: str
    stop_token_ids: list[int]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_count(requested: int) -> int:
    """``target.threads`` capped at this process's share of the cores.

    The share is the usable cores divided by the processes per node (torchrun's
    ``LOCAL_WORLD_SIZE``, 1 outside torchrun): oversubscribed OpenMP threads slow
    small matmuls by an order of magnitude on a 2-core machine.
    """
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(int(requested), usable_cores() // local))


def apply_threads(requested: int) -> int:
    """Set this process's torch intra-op threads to ``thread_count(requested)``; returns that count.

    Also exports ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, so subprocesses (the SpecForge
    trainer the SFT stage starts) get the same setting; when torch is not imported yet
    that is all it does, so a verb that never needs torch does not import it.
    """
    import sys

    n = thread_count(requested)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else as given."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def target_identity(path: Path) -> str:
    """Short hash of ``config.json`` plus the weight files' names and sizes (no weight read).

    Raises:
        TargetError: the directory has no config.json.
    """
    cfg = path / "config.json"
    if not cfg.is_file():
        raise TargetError(f"target.path: {path} has no config.json; point it at a Hugging Face model directory")
    h = hashlib.sha256(cfg.read_bytes())
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt", ".gguf") or f.name.endswith(".index.json"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:12]


def stop_token_ids(tokenizer, config, extra: list[int], generation_config=None) -> list[int]:
    """The ids decoding stops at, sorted: eos of the tokenizer, the model config and its generation config,
    ``<|im_end|>`` if the vocabulary has it, plus ``extra``.

    SGLang stops on the eos ids of ``config.json`` and ``generation_config.json`` together
    (0.5.23 ``ModelConfig._get_hf_eos_token_id``; Qwen3's generation config adds 151643),
    whatever the request's ``stop_token_ids``: every backend uses this set so that a
    record says ``finished`` where SGLang stopped.
    """
    ids: set[int] = set(int(i) for i in extra)
    for src in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None),
                getattr(generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    return sorted(ids)


def cut_at_stop(ids: list[int], stop_ids: set[int], max_new: int) -> tuple[list[int], bool]:
    """``(ids[:max_new] up to and including the first stop id, whether a stop id was found)``.

    ``ids``: the target's new token ids (any iterable of ints); the returned list is a new one.
    """
    ids = list(ids)[:max_new]
    for j, t in enumerate(ids):
        if t in stop_ids:
            return ids[: j + 1], True
    return ids, False


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` (one slash, no leading ``/``, ``.`` or ``~``) that is not a local path."""
    p = str(path)
    return (p.count("/") == 1 and not p.startswith(("/", ".", "~")) and not p.endswith("/")
            and not Path(p).expanduser().exists())


def resolve_target_path(path: str) -> Path:
    """A local HF model directory for ``target.path``: the directory itself, or a hub id's snapshot.

    A hub id (``Qwen/Qwen3-8B``) is fetched with ``huggingface_hub.snapshot_download``
    into the Hugging Face cache (its progress bars show; a cached snapshot is used
    without the network). Only the files a causal LM needs are fetched.

    Raises:
        TargetError: the directory does not exist, or the hub id cannot be fetched
            (offline and not cached, unknown repository, gated without a token).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if not looks_like_hub_id(path):
        raise TargetError(f"target.path: {p} does not exist; set it to a Hugging Face model directory or hub id "
                          "(org/name), or leave it null for the embedded SmolLM2 target")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(str(path), allow_patterns=patterns, local_files_only=True))
    except Exception:  # not cached yet: fetch it
        pass
    try:
        log.info("target %s: downloading into the Hugging Face cache", path)
        return Path(snapshot_download(str(path), allow_patterns=patterns))
    except Exception as e:
        raise TargetError(f"target.path: hub id {path!r} could not be fetched ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "check the network and HF_TOKEN, or download it first and set target.path to the local "
                          "directory") from None


def target_dir(cfg) -> str:
    """The target's local HF directory for an ``ExperimentConfig``, as SpecForge's ``model.target_model_path``.

    ``target.path`` unset: the embedded target (``assets.ensure_target``); a local directory
    as resolved against the config; a hub id: its snapshot (``resolve_target_path``), so
    SpecForge reads local files.

    Raises:
        TargetError: a hub id that cannot be fetched, or a path that does not exist.
        assets.AssetError: the embedded target could not be prepared.
    """
    if cfg.target.path is None:
        return str(assets.ensure_target())
    p = cfg.resolve_path(cfg.target.path)
    if p is not None and p.exists():
        return str(p)
    return str(resolve_target_path(cfg.target.path))


def load_target(tcfg) -> TargetBundle:
    """Load the target of ``tcfg`` (a ``TargetConfig``).

    ``tcfg.path`` None: the embedded SmolLM2-135M-Instruct (``assets.ensure_target``,
    under ``tcfg.cache_dir`` if set). ``tcfg.device`` "auto": cuda if available,
    else cpu. ``tcfg.dtype``: the weights' dtype (``float32`` on a CPU is what
    the tests and pinned facts use).

    ``tcfg.path`` may be a local directory or a hub id (``resolve_target_path``).

    Raises:
        TargetError: the path does not exist or is not an HF model directory, a
            hub id cannot be fetched, or ``target.stop_token_ids`` lie outside the vocabulary.
        assets.AssetError: the embedded target could not be prepared.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tcfg.path is None:
        path = assets.ensure_target(getattr(tcfg, "cache_dir", None))
    else:
        path = resolve_target_path(tcfg.path)
    identity = target_identity(path)
    device = resolve_device(tcfg.device)
    dtype = getattr(torch, _DTYPES[tcfg.dtype])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = model.get_input_embeddings().weight.shape[0]
    bad = [i for i in tcfg.stop_token_ids if not 0 <= i < vocab]
    if bad:
        raise TargetError(f"target.stop_token_ids {bad} lie outside the target vocabulary (size {vocab})")
    stops = stop_token_ids(tokenizer, model.config, list(tcfg.stop_token_ids), getattr(model, "generation_config", None))
    log.info("target %s (%s) on %s/%s, stop ids %s", path, identity, device, tcfg.dtype, stops)
    return TargetBundle(model=model, tokenizer=tokenizer, path=path, identity=identity, stop_token_ids=stops)


def describe(bundle: TargetBundle) -> dict:
    """A JSON-able summary (for run reports and shard metadata)."""
    c = bundle.model.config
    return json.loads(
        json.dumps(
            {
                "path": str(bundle.path),
                "identity": bundle.identity,
                "num_hidden_layers": c.num_hidden_layers,
                "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size,
                "stop_token_ids": bundle.stop_token_ids,
            }
        )
    )
