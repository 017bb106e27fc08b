"""Checks that run before the target loads, so bad input fails in seconds, not after the load.

``opd``, ``distill`` and ``rollout`` call ``check_before_target``: the output directory is
writable, the drafter exists, loads and fits the target's config (read without its
weights), and the prompt sources are known and reachable. Every failure is a
``UserError`` naming the field or file and the fix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from specforge_opd.config import ConfigError, ExperimentConfig
from specforge_opd.data.prompts import HUB_SOURCES, KNOWN_SOURCES, PromptsError, checked_source_limits
from specforge_opd.data.sources import hub_offline
from specforge_opd.errors import DiskFullError, UserError, is_disk_full
from specforge_opd.models.drafter import DrafterError, drafter_path, drafter_shape, load_any_drafter, shape_mismatch
from specforge_opd.rollout.shards import REPAIR_ADVICE, ShardError, shard_meta, verify_shards
from specforge_opd.run_fingerprint import FILE, check_config_unchanged
from specforge_opd.stages.plan import _target_config


def check_writable(out_dir, field: str = "output.dir") -> Path:
    """Create ``out_dir`` if needed and write (then remove) a probe file in it.

    Raises:
        ConfigError: the directory cannot be created or written (names ``field``).
        DiskFullError: its filesystem is full.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if is_disk_full(e):
            raise DiskFullError(out) from e
        raise ConfigError(f"{field}={out} is not writable ({e.strerror or e}); set {field} (or --out) to a directory "
                          f"you can write") from None
    return out


def check_prompt_sources(cfg: ExperimentConfig) -> None:
    """``data.train_sources`` are known, their local files exist, hub-only ones are reachable offline; slices valid.

    Reads no prompt (the pool is loaded, with the target's tokenizer, after the target).

    Raises:
        PromptsError: as ``data.prompts.training_pool_with_stats`` would, but before any load.
    """
    d = cfg.data
    checked_source_limits(d)
    bad = [s for s in d.slices if not 0 <= s < d.num_slices]
    if bad or not d.slices:
        raise PromptsError(f"data.slices={d.slices} must be a non-empty list of ints in [0, data.num_slices={d.num_slices})")
    if not d.train_sources:
        raise PromptsError(f"data.train_sources is empty; name at least one of {', '.join(KNOWN_SOURCES)}")
    for name in d.train_sources:
        if name not in KNOWN_SOURCES:
            raise PromptsError(f"data.train_sources: unknown prompt source `{name}`; known: {', '.join(KNOWN_SOURCES)}")
        local = d.local_files.get(name)
        if local and not Path(os.path.expanduser(local)).is_file():
            raise PromptsError(f"data.local_files.{name}: {local} does not exist; point it at a JSONL or Parquet file")
        if name in HUB_SOURCES and not local and hub_offline():
            raise PromptsError(f"source `{name}` ({HUB_SOURCES[name].hub_id}) is hub-only and the hub is offline; "
                               f"download it and set data.local_files.{name}=/path/to/{name}.jsonl (JSONL or Parquet)")


def check_drafter(cfg: ExperimentConfig, path, *, field: str = "draft.path") -> None:
    """The drafter at ``path`` exists and loads against the target's config (no target weights).

    Catches a missing path, a drafter of another hidden size or layer count, a missing
    tensor, a bf16/fp16 mismatch. Where the target's config cannot be had without the
    target (a hub id this package has no config fixture for), only existence is checked.

    Raises:
        ConfigError: ``path`` is None (names ``field``).
        DrafterError: as ``models.drafter.load_any_drafter``; the message names the path.
    """
    if path is None:
        raise ConfigError(f"{field} is not set: pass the initial drafter (the SFT stage's export, a DFlash or "
                          f"SpecForge drafter directory, or published:NAME) with {field}=DIR or --drafter DIR")
    p = drafter_path(cfg.resolve_path(str(path)))
    if not p.exists():
        raise DrafterError(f"{field}: drafter path {p} does not exist; point {field} (or --drafter) at a drafter directory")
    try:
        tconf = _target_config(cfg)
    except UserError:
        return  # the target's config needs the target itself: load_target checks it
    model = load_any_drafter(p, tconf, expected_mask_token_id=cfg.draft.mask_token_id, target_dtype=cfg.target.dtype)
    check_drafter_shape(cfg, model.config, field=field, where=p)


def check_drafter_shape(cfg: ExperimentConfig, draft_config, *, field: str = "draft.path", where=None) -> None:
    """The ``draft`` fields a config sets describe the drafter it starts from: layers, block size, target
    layers, MLP width (``models.drafter.SHAPE_FIELDS``).

    A run continues a drafter with that drafter's own shape; the config's ``draft`` fields
    still size the memory plan and the FLOPs ledger, so a config that says 1 layer for a
    3-layer drafter would under-count both without any error. Fields the YAML and the
    overrides leave at their schema defaults are not compared: a bare ``draft.path=DIR``
    takes the drafter as it is.

    Raises:
        ConfigError: names each mismatched ``draft.*`` field, the drafter's value and the overrides that fix them.
    """
    have = drafter_shape(draft_config)
    given = cfg.draft.model_fields_set
    want = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k in have
            if k in given and (v := getattr(cfg.draft, k)) is not None}
    bad = shape_mismatch(want, have)
    if bad:
        raise ConfigError(f"{field} ({where}): {bad} (a run keeps its start drafter's shape)")


def check_shards(shard_dirs) -> None:
    """Every shard directory has a manifest and every listed shard is intact (full sha256); nothing is changed.

    Raises:
        ShardError: names the directory or the damaged file, with advice that works.
    """
    for d in shard_dirs:
        shard_meta(d)  # raises for a missing manifest or another schema
        bad = verify_shards(d)
        if bad:
            b = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ShardError(f"{Path(d) / b['file']}: {b['what']}{more}; {REPAIR_ADVICE}")


def check_before_target(cfg: ExperimentConfig, *, drafter=None, out_dir=None, prompts: bool = True,
                        shard_dirs: Optional[list] = None) -> None:
    """All of the above for one verb: ``out_dir`` (default ``output.dir``), ``drafter``
    (default ``draft.path``; False: no drafter needed), the prompt sources when ``prompts``,
    and ``shard_dirs`` when given.

    Raises:
        UserError: the first problem found (``ConfigError``, ``DrafterError``, ``PromptsError``,
            ``ShardError``, ``DiskFullError``).
    """
    check_writable(out_dir if out_dir is not None else cfg.output.dir, "output.dir")
    if shard_dirs:
        check_shards(shard_dirs)
    if drafter is not False:
        check_drafter(cfg, drafter if drafter is not None else cfg.draft.path,
                      field="draft.path" if drafter is None else "--drafter")
    if prompts:
        check_prompt_sources(cfg)


def before_distill(cfg: ExperimentConfig, shard_dirs: list, drafter=None, *, resume: bool = True,
                   allow_config_change: bool = False) -> None:
    """The ``distill`` verb's checks before the target loads: output dir, shards (in full), drafter,
    and, on a resume, the config against the run's fingerprint (``run_fingerprint``; a fresh
    start, ``resume=False``, records its own).

    Raises:
        UserError: as ``check_before_target``; ConfigError: a changed config without ``allow_config_change``.
    """
    check_before_target(cfg, drafter=drafter, prompts=False, shard_dirs=shard_dirs)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if not resume and rank0:
        (Path(cfg.output.dir) / FILE).unlink(missing_ok=True)
    check_config_unchanged(cfg, cfg.output.dir, "distill", allow_change=allow_config_change, write=rank0,
                           extra={"--drafter": drafter})
