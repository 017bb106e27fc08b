"""Resumable steps keyed by their inputs, and the SFT stage's error.

A step's output lives in ``<out>/<step>-<key[:12]>``, where the key is the SHA-256 of
the JSON-canonical dict of everything the output depends on; ``DONE.json`` (``MARKER``),
written last, records the key, the inputs and the step's stats. A rerun skips a finished
step, a changed input gets a new directory, and a killed step resumes from what it wrote.
The keys must not change between releases: runs in progress resume from them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from specforge_opd.atomic import atomic_write_json
from specforge_opd.config import ExperimentConfig
from specforge_opd.errors import UserError

#: The marker a finished step writes last: ``{"key", "inputs", "stats", "finished_at"}``.
MARKER = "DONE.json"


class SFTError(UserError, RuntimeError):
    """The SFT stage cannot go on; the message names the step, the cause and the fix."""


def hash_inputs(inputs: dict) -> str:
    """SHA-256 (64 hex digits) of a JSON-canonical dict: the key a step's output is stored under.

    Keys are sorted and anything JSON cannot encode is written as its ``str``.
    """
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def step_dir(out: Path, step: str, key: str) -> Path:
    """``out / "<step>-<first 12 hex digits of key>"``."""
    return out / f"{step}-{key[:12]}"


def target_key(tdir: str) -> str:
    """A cheap identity of the target for step keys: 16 hex digits over its ``config.json`` and its
    weight files' names and sizes; ``hub:<id>`` when ``tdir`` is not a local directory.

    Reading no weights keeps the skip decision instant; a re-converted or
    replaced checkpoint changes the sizes or the config and redoes the steps.
    """
    p = Path(tdir)
    if not p.is_dir():
        return f"hub:{tdir}"
    h = hashlib.sha256()
    cfg_file = p / "config.json"
    if cfg_file.is_file():
        h.update(cfg_file.read_bytes())
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def is_done(d: Path, key: str) -> bool:
    """True when ``d`` holds a finished step whose marker records ``key`` (an unreadable marker is not done)."""
    m = d / MARKER
    if not m.is_file():
        return False
    try:
        return json.loads(m.read_text()).get("key") == key
    except (OSError, json.JSONDecodeError):
        return False


def mark_done(d: Path, key: str, inputs: dict, stats: dict) -> None:
    """Write ``d``'s marker (atomically): the step under ``key`` is finished with these stats."""
    atomic_write_json(d / MARKER, {"key": key, "inputs": inputs, "stats": stats, "finished_at": time.time()})


def reuse_roots(cfg: ExperimentConfig) -> list[Path]:
    """``sft.reuse_from`` as directories, in the order given (one path or a list; none when unset)."""
    r = cfg.sft.reuse_from
    return [Path(cfg.resolve_path(p)) for p in ([r] if isinstance(r, str) else (r or []))]


def step_roots(cfg: ExperimentConfig, out: Path) -> list[Path]:
    """Where an SFT run's steps may be: its own ``out``, then each ``sft.reuse_from`` directory."""
    return [Path(out)] + reuse_roots(cfg)


def reusable_step(cfg: ExperimentConfig, out: Path, step: str, key: str) -> Path:
    """``out``'s directory for ``step``, or else the first finished one with the same key under an
    ``sft.reuse_from`` directory (in their order).

    Continued SFT (the matched-FLOPs baseline, a second stage) trains on the first stage's cached
    features instead of generating and capturing them again.
    """
    for root in step_roots(cfg, out):
        d = step_dir(root, step, key)
        if is_done(d, key):
            return d
    return step_dir(out, step, key)


def donor_steps(cfg: ExperimentConfig, out: Path, step: str, inputs: dict, vary: tuple[str, ...]) -> list[Path]:
    """Finished ``step`` directories under ``out`` (and ``sft.reuse_from``) whose inputs equal ``inputs``
    except the fields ``vary``: their parts that match item by item can be reused (a larger pool whose
    first prompts a finished run already answered). Newest first; unreadable markers are skipped."""
    roots = step_roots(cfg, out)
    same = json.loads(json.dumps({k: v for k, v in inputs.items() if k not in vary}, sort_keys=True, default=str))
    found = []
    for root in roots:
        for d in root.glob(f"{step}-*"):
            try:
                m = json.loads((d / MARKER).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if {k: v for k, v in (m.get("inputs") or {}).items() if k not in vary} == same:
                found.append((m.get("finished_at", 0), d))
    return [d for _, d in sorted(found, key=lambda x: -x[0])]


def keyed_step(name: str, d: Path, key: str, inputs: dict, run: Callable[[], dict], skipped: list[str]) -> dict:
    """Run one resumable step: skip it when ``d`` is done under ``key`` (appending ``name`` to ``skipped``),
    else ``run()`` -> stats and mark it done, unless the stats say it paused (``paused_at`` not None: the
    same command continues it). Returns the stats (the recorded ones when skipped)."""
    if is_done(d, key):
        skipped.append(name)
        print(f"[sft {name}] done already: {d}", flush=True)
        return read_marker_stats(d)
    stats = run()
    if stats.get("paused_at") is None:
        mark_done(d, key, inputs, stats)
    return stats


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (symlinks not followed; 0 for a missing path)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def read_marker_stats(d: Path) -> dict[str, Any]:
    """The stats a finished step recorded in its marker.

    Raises:
        OSError, json.JSONDecodeError, KeyError: ``d`` holds no readable marker.
    """
    return json.loads((d / MARKER).read_text())["stats"]
