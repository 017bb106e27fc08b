"""The OPD loop's run object and an iteration's records (``stages.opd.run_opd``).

``OPDRun`` holds what the loop's setup resolves, ``opd_state.json``'s contents among it;
``metrics_row`` and ``record_iteration`` are an iteration's bookkeeping: the metrics row
(``opd_metrics.jsonl``, TensorBoard), the progress line, the spent shards and checkpoints
deleted, and the state advanced last.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specforge_opd.atomic import atomic_write_json
from specforge_opd.config import ExperimentConfig
from specforge_opd.eval.flops import FlopsLedger
from specforge_opd.stages.opd_validation import OPDValidation
from specforge_opd.stages.plan import OPDPlan
from specforge_opd.stepkeys import dir_bytes
from specforge_opd.train.hooks import TrainHooks


def _short(v) -> str:
    """A loss for the progress line: 4 significant digits, or as it is when not a number (None)."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@dataclass
class OPDRun:
    """What ``stages.opd._setup`` resolves once and every iteration and the finish read.

    Fixed after setup except ``state`` (``opd_state.json``: rank 0 advances it at the end of each
    iteration; with several ranks every rank reads it back after the iteration's last barrier) and
    ``flops`` (this stage's FLOPs ledger, grown by each iteration). ``cfg`` is the rank-bound config
    with the gradient accumulation derived from ``opd.prompts_per_step``.
    """

    cfg: ExperimentConfig
    rank: int
    world: int
    out: Path
    bundle: object  # models.target.TargetBundle
    prompts: list[tuple[str, list[int]]]
    plan: OPDPlan
    state: dict
    state_path: Path
    spool_root: Path
    initial_drafter: Path
    initial_meta: dict
    flops: FlopsLedger
    tb: object  # rank 0's TensorBoard SummaryWriter, or None
    validation: Optional[OPDValidation]
    hooks: Optional[TrainHooks]


def metrics_row(run: OPDRun, it: int, ro: dict, res, *, drafter_step: int, train_seconds: float, spool_bytes: int) -> dict:
    """Iteration ``it``'s row of ``opd_metrics.jsonl`` from its rollout stats ``ro`` and ``distill`` result ``res``,
    after ``run.flops`` counts the iteration (the validation tau, where measured, is added by the caller)."""
    return {
        "iteration": it,
        "drafter_step": drafter_step,
        "rollout_tau": ro["tau"],
        "rollout_sequences": ro["sequences"],
        "rollout_completion_tokens": ro["completion_tokens"],
        "rollout_verify_steps": ro["verify_steps"],
        "rollout_histogram": ro["histogram"],
        "rollout_tokens_per_s": ro["tokens_per_s"],
        "rollout_seconds": ro["seconds"],
        "train_steps": res.step,  # the iteration's steps, those of earlier (killed) invocations included
        "train_seconds": train_seconds,
        "train_positions_per_s": res.last_metrics.get("positions_per_s"),
        "loss": res.last_metrics.get("loss"),
        "L_acc": res.last_metrics.get("L_acc"),
        "L_rej": res.last_metrics.get("L_rej"),
        "accepted_fraction": res.last_metrics.get("accepted_fraction"),
        "policy_lag": res.last_metrics.get("policy_lag"),
        "mixed_precision": res.last_metrics.get("mixed_precision"),
        "spool_bytes": spool_bytes,
        "output_bytes": dir_bytes(run.out),
        "flops": run.flops.to_dict(),
    }


def record_iteration(run: OPDRun, it: int, row: dict, ro: dict, res, spool_bytes: int) -> None:
    """Rank 0's end of iteration ``it``: ``row`` to ``opd_metrics.jsonl`` and TensorBoard, the progress line,
    the iteration's shards (unless ``opd.keep_shards``) and the previous iteration's checkpoints deleted, and
    ``run.state`` advanced and written last."""
    cfg, out, state, tb = run.cfg, run.out, run.state, run.tb
    with open(out / "opd_metrics.jsonl", "a") as f:
        f.write(json.dumps(row, default=float) + "\n")
    if tb is not None:
        for k, v in row.items():
            if isinstance(v, (int, float)) and v is not None:
                tb.add_scalar(f"opd/{k}", v, it)
        tb.flush()
    speed = f"{ro['tokens_per_s']:.1f} tok/s" if ro["tokens_per_s"] else "reused from the spool"
    print(f"[iter {it + 1}/{run.plan.iterations}] rollout tau={ro['tau']:.3f} ({ro['sequences']} seq, "
          f"{speed}) | train {res.step} steps, loss={_short(row['loss'])} "
          f"L_acc={_short(row['L_acc'])} L_rej={_short(row['L_rej'])} | spool {spool_bytes / 2**20:.1f} MiB", file=sys.stderr)
    if not cfg.opd.keep_shards:
        shutil.rmtree(run.spool_root / f"iter_{it:03d}", ignore_errors=True)
    # previous iteration's training checkpoints are no longer needed once this one is done
    if it > 0:
        shutil.rmtree(out / f"iter_{it - 1:03d}" / "train" / "checkpoints", ignore_errors=True)
    state.update(iterations_done=it + 1, drafter=str(res.export_dir), flops=run.flops.to_dict())
    state["history"].append({k: row[k] for k in ("iteration", "rollout_tau", "loss", "L_acc", "L_rej")})
    atomic_write_json(run.state_path, state)
