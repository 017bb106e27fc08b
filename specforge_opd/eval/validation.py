"""The SFT stage's validation curve: tau of its checkpoints on a held-out slice of the training pool.

Picking an SFT checkpoint by loss is what field reports warn against (tau peaks
while the loss still falls), and the curve of tau against training compute is
where SFT plateaus (the paper's Figure 1). So the SFT stage trains in segments of
``sft.val_interval`` optimizer steps; after each one the checkpoint is exported
(before SpecForge prunes it) and its tau measured by exact offline replay
(``replay.offline_tau``) on ``sft.val_prompts`` prompts of the training pool that
SFT does not train on. They are never the evaluation sets: the pool already drops
prompts that overlap those. The points go to ``curve.jsonl`` and TensorBoard, and
``sft_curve.png`` plots tau against cumulative drafter FLOPs; the export is the
point with the best tau (``sft.select: best_val``) or the last (``last``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from specforge_opd.atomic import atomic_write_text
from specforge_opd.eval.plots import pyplot
from specforge_opd.eval.replay import TrajectoryCache, offline_tau
from specforge_opd.models.drafter import drafter_layer_ids
from specforge_opd.rollout.records import tau_of

CURVE_FILE = "curve.jsonl"


def segment_ends(total_steps: int, interval: int) -> list[int]:
    """Optimizer steps at which a validation point is taken: every ``interval`` steps, and the last step.

    Raises:
        ValueError: ``interval`` < 1 (``sft.val_interval``).
    """
    if interval < 1:
        raise ValueError(f"sft.val_interval={interval}: must be at least 1 optimizer step")
    ends = list(range(interval, total_steps, interval))
    return ends + [total_steps]


def read_curve(run_dir: Path, name: str = CURVE_FILE) -> list[dict]:
    """The points measured so far (``name`` under ``run_dir``, default ``curve.jsonl``), in step order."""
    p = Path(run_dir) / name
    if not p.is_file():
        return []
    pts = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return sorted(pts, key=lambda x: x["step"])


def add_point(run_dir: Path, point: dict, name: str = CURVE_FILE) -> list[dict]:
    """Record a point (replacing one at the same step) atomically in ``name``; returns the curve."""
    pts = [p for p in read_curve(run_dir, name) if p["step"] != point["step"]] + [point]
    pts.sort(key=lambda x: x["step"])
    atomic_write_text(Path(run_dir) / name, "".join(json.dumps(p) + "\n" for p in pts))
    return pts


def select(points: Sequence[dict], rule: str) -> dict:
    """The point to export: highest tau (the earliest of equals) for ``best_val``, the last for ``last``.

    Raises:
        ValueError: no point, or an unknown rule (``sft.select``).
    """
    if not points:
        raise ValueError("no validation point to select from")
    if rule == "last":
        return max(points, key=lambda p: p["step"])
    if rule != "best_val":
        raise ValueError(f"sft.select={rule!r}: expected best_val or last")
    return max(points, key=lambda p: (p["tau"], -p["step"]))


def plateaued(points: Sequence[dict], patience: int, band: float) -> bool:
    """Whether SFT has plateaued: the last ``patience`` points all fail to beat the best point before
    them by more than ``band`` tau (``sft.plateau_patience`` / ``sft.plateau_band``).

    The band is the noise of a validation tau (the seed spread at this scale is
    0.01-0.04), so a plateau is a run of points that could be noise around the best.
    ``patience`` 0 never stops.
    """
    pts = sorted(points, key=lambda p: p["step"])
    if patience < 1 or len(pts) <= patience:
        return False
    best_before = max(p["tau"] for p in pts[:-patience])
    return max(p["tau"] for p in pts[-patience:]) <= best_before + band


class ValidationSet:
    """Greedy trajectories of the validation prompts, cached once; ``tau(drafter)`` replays a drafter on them.

    Args:
        target_model: the HF target (eval mode).
        target_identity: ``target.target_identity`` (keys the trajectory cache).
        prompts: token id lists of the validation prompts.
        max_new_tokens, stop_token_ids: the trajectories' budget and stops (the SFT responses').
        cache_dir: where the trajectories are kept (safetensors; reused on resume).
    """

    def __init__(self, target_model, target_identity: str, prompts: list[list[int]], *, max_new_tokens: int,
                 stop_token_ids: Sequence[int], cache_dir: Optional[Path]):
        self.model = target_model
        self.prompts = prompts
        self.cache = TrajectoryCache(cache_dir, target_model, target_identity, max_new_tokens=max_new_tokens,
                                     stop_token_ids=stop_token_ids)

    def tau(self, drafter) -> float:
        """Pooled tau (``records.tau_of``) of ``drafter`` on the validation trajectories, exact at T=0."""
        trajs = self.cache.get(self.prompts, drafter_layer_ids(drafter), desc="validation trajectories")
        with torch.no_grad():
            return tau_of(offline_tau(drafter.eval(), self.model, trajs, desc="validation replay"))


def plot_curve(points: Sequence[dict], path: Path, selected_step: Optional[int] = None, *, label: str = "SFT",
               references: Optional[dict[str, Sequence[dict]]] = None) -> Path:
    """A validation-curve plot: tau against cumulative drafter-training FLOPs, the selected point marked.

    ``points``: dicts with ``step``, ``tau``, ``drafter_flops`` (``sft_curve.png``, ``opd_curve.png``).
    ``references``: other curves drawn on the same axes, by label (OPD's plot shows the
    SFT curve of the drafter it started from, so both read against the same compute).
    """
    plt = pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for i, (name, ref) in enumerate((references or {}).items()):
        ref = [p for p in ref if p.get("drafter_flops") is not None]
        ax.plot([p["drafter_flops"] for p in ref], [p["tau"] for p in ref], marker=".", color=f"C{i + 1}", alpha=0.8,
                label=name)
    ax.plot([p["drafter_flops"] for p in points], [p["tau"] for p in points], marker="o", color="C0", label=label)
    for p in points:
        if p["step"] == selected_step:
            ax.plot([p["drafter_flops"]], [p["tau"]], marker="*", markersize=14, color="C3", linestyle="none",
                    label=f"exported (step {p['step']})")
    ax.set_xlabel("cumulative drafter-training FLOPs")
    ax.set_ylabel("validation tau")
    ax.set_title(f"{label} validation curve")
    if selected_step is not None or references:
        ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
