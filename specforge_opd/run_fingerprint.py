"""The config a resumable run started with, and the refusal to resume it with another.

``opd`` and ``distill`` write ``run_fingerprint.json`` in their output directory on the
first start: every config field that changes the result, ``auto`` fields as this
machine resolves them (``target.device`` -> cpu/cuda, ``training.mixed_precision`` ->
fp32/bf16), so a resume on a machine that resolves them differently is caught too.
A resume compares and refuses any difference in one line naming the fields, old and
new values. ``--allow-config-change`` continues on purpose: the change is recorded in
the file (``changes``) and the new values become the reference.

Fields that never change the result are left out: where output goes and how it is
logged (``output.*``, ``name``, ``training.log_interval``/``checkpoint_interval``/
``keep_checkpoints``), threads and caches, the memory bounds (``target.prefill_chunk``,
``training.chunk_slots``/``max_blocks_per_forward``), the spool's place and budget,
SGLang's server settings, and the sections of other stages (``sft.*``, ``eval.*``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from specforge_opd.atomic import atomic_write_json
from specforge_opd.config import ConfigError, ExperimentConfig
from specforge_opd.models import target
from specforge_opd.precision import resolve_trainer

FILE = "run_fingerprint.json"
#: Dotted prefixes that never change a run's result.
_IGNORED = (
    "name", "source_file", "output.", "sft.", "eval.", "sglang.",
    "target.threads", "target.cache_dir",
    "opd.spool_dir", "opd.spool_budget_bytes", "opd.keep_shards", "opd.eval_every", "opd.final_rollout",
    # the export is selected again from the whole curve at every start: a changed rule mixes nothing
    "opd.select",
    "training.log_interval", "training.checkpoint_interval", "training.keep_checkpoints",
    "training.max_nonfinite_steps", "training.num_anchors",
    # memory bounds: the same sums in other groupings (DESIGN.md section 4)
    "target.prefill_chunk", "training.chunk_slots", "training.max_blocks_per_forward",
)
#: Extra prefixes ignored per verb: distill trains on given shards, so how they were made is theirs.
_IGNORED_BY_VERB = {
    # opd_state.json records the initial drafter and refuses another with its own message
    "opd": ("draft.path",),
    "distill": ("data.", "opd.", "rollout.backend", "rollout.batch_size", "rollout.max_new_tokens", "rollout.temperature",
                "rollout.top_p", "rollout.top_k", "rollout.anchors", "rollout.store_features",
                "rollout.sequences_per_shard", "rollout.seed"),
}


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("local_files", "source_limits", "specforge_overrides"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def result_fields(cfg: ExperimentConfig, verb: str) -> dict[str, Any]:
    """The dotted config fields (JSON values) that change the result of ``verb`` (``opd`` or ``distill``),
    ``auto`` fields resolved on this machine."""
    ignored = _IGNORED + _IGNORED_BY_VERB[verb]
    flat = {k: v for k, v in _flatten(cfg.model_dump(mode="json")).items()
            if not any(k == p or (p.endswith(".") and k.startswith(p)) for p in ignored)}
    device = target.resolve_device(cfg.target.device)
    # a rank's own GPU (cuda:3) is the same choice as cuda: compare the kind of device
    flat["target.device"] = "cuda" if device.startswith("cuda") else device
    flat["training.mixed_precision"] = resolve_trainer(cfg.training.mixed_precision, flat["target.device"]).value
    return flat


def _show(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def check_config_unchanged(cfg: ExperimentConfig, out_dir, verb: str, *, allow_change: bool = False,
                           write: bool = True, log=None, extra: Optional[dict] = None) -> Optional[dict]:
    """Compare ``cfg`` with the fingerprint in ``out_dir`` (record it when there is none).

    Args:
        verb: ``opd`` or ``distill``.
        allow_change: continue despite a difference (recorded; one warning line to ``log``).
        write: write the file (rank 0 only, under torchrun).
        extra: more result-changing inputs that are not config fields (e.g. ``--drafter``), JSON values.
    Returns:
        The differences ``{field: (old, new)}`` that were allowed, or None when nothing changed.
    Raises:
        ConfigError: a field differs and ``allow_change`` is off; names the fields, old and new
            values, and the three ways out.
    """
    out = Path(out_dir)
    path = out / FILE
    now = dict(result_fields(cfg, verb), **(extra or {}))
    old = json.loads(path.read_text()) if path.is_file() else None
    if old is None:
        if write:
            atomic_write_json(path, {"verb": verb, "fields": now, "changes": []})
        return None
    before = old.get("fields", {})
    diff = {k: (before.get(k), now.get(k)) for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)}
    if not diff:
        return None
    listed = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in diff.items())
    if not allow_change:
        raise ConfigError(f"{out} was started with another config: {listed}; rerun with the old values, use a fresh "
                          f"output.dir, or pass --allow-config-change to continue with the new ones on purpose")
    (log or (lambda t: print(t, file=sys.stderr)))(
        f"warning: {out}: continuing with a changed config on purpose (--allow-config-change): {listed}")
    if write:
        changes = old.get("changes", []) + [{"time": time.time(), "changed": {k: list(v) for k, v in diff.items()}}]
        atomic_write_json(path, {"verb": verb, "fields": now, "changes": changes})
    return diff
