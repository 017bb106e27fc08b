"""OPD's validation curve: the start and every refresh's drafter replayed on held-out prompts.

The paper's baselines report the checkpoint with the best evaluation performance, so a
fair comparison selects every run the same way, on prompts none of them trains on:
``opd.val_prompts`` prompts of the OPD pool right after the ``data.num_prompts`` it rolls
out (never rolled out; the pool already excludes the evaluation sets). After every
on-policy refresh (iteration) the new drafter's tau on their greedy target trajectories
is measured by exact offline replay at T=0 (``eval.validation.ValidationSet``, the SFT
stage's validation), recorded in ``opd_curve.jsonl`` against cumulative drafter-training
FLOPs, and ``opd_curve.png`` draws it on the axes of the start's own SFT curve. The stage
exports the refresh with the best validation tau (``opd.select: best_val``) or the last.

Curve points: ``step`` = refreshes done (0 = the start drafter), ``tau``,
``drafter_flops`` (cumulative, the start's history included, as the SFT curve counts),
``opd_flops`` (this stage's alone), ``export`` (the drafter directory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from specforge_opd.data.prompts import held_out_prompts, prompt_token_ids
from specforge_opd.eval.flops import FlopsLedger
from specforge_opd.eval.validation import ValidationSet, add_point, plot_curve, read_curve, select
from specforge_opd.models.drafter import load_any_drafter, read_drafter_metadata
from specforge_opd.stages.plan import PlanError

OPD_CURVE_FILE = "opd_curve.jsonl"
OPD_CURVE_PLOT = "opd_curve.png"


class OPDValidation:
    """Validation of the OPD stage's drafters on ``opd.val_prompts`` held-out prompts.

    Args:
        cfg: the OPD ``ExperimentConfig`` (``data``, ``opd.val_prompts``, ``rollout.max_new_tokens``).
        bundle: the loaded ``TargetBundle`` (model, tokenizer, identity, stop tokens).
        out: the stage's ``output.dir``: the curve file, plot and trajectory cache go there.
        prompts: the validation prompts as (id, token ids) (None: the pool's held-out ones,
            rendered as the rollout renders its prompts).

    Raises:
        PromptsError: no prompt left in the pool after ``data.num_prompts``.
    """

    def __init__(self, cfg, bundle, out: Path, prompts: Optional[list[tuple[str, list[int]]]] = None):
        if prompts is None:
            tok = bundle.tokenizer
            records = held_out_prompts(cfg.data, cfg.opd.val_prompts, field="opd.val_prompts", cache=cfg.target.cache_dir,
                                       tokenizer=tok)
            prompts = [(str(r.id), prompt_token_ids(tok, r, cfg)) for r in records]
        ids = [list(p) for _, p in prompts]
        self.out = Path(out)
        self.prompt_ids = [i for i, _ in prompts]
        # eval.cache_dir shares the target's trajectories between runs (they are keyed by target,
        # prompt, budget and stop tokens): the variants of a study pay for them once
        cache = Path(cfg.resolve_path(cfg.eval.cache_dir)) if cfg.eval.cache_dir else self.out / "val_trajectories"
        self.valset = ValidationSet(bundle.model, bundle.identity, ids, max_new_tokens=cfg.rollout.max_new_tokens,
                                    stop_token_ids=list(bundle.stop_token_ids), cache_dir=cache)
        self.target_config = bundle.model.config
        self.device = bundle.model.device

    def curve(self) -> list[dict]:
        """The points recorded so far, in step order."""
        return read_curve(self.out, OPD_CURVE_FILE)

    def point(self, step: int, drafter_dir: Path, *, drafter_flops: Optional[float], opd_flops: Optional[float]) -> dict:
        """Measure (or read back, on resume) the validation tau of ``drafter_dir`` as point ``step``."""
        done = next((p for p in self.curve() if p["step"] == step), None)
        # a point measured on another number of validation prompts is not comparable: measure again
        if done is not None and done["export"] == str(drafter_dir) and done.get("val_prompts") == len(self.prompt_ids):
            return done
        drafter = load_any_drafter(str(drafter_dir), self.target_config).to(self.device).eval()
        tau = self.valset.tau(drafter)
        p = {"step": step, "tau": tau, "drafter_flops": drafter_flops, "opd_flops": opd_flops, "export": str(drafter_dir),
             "val_prompts": len(self.prompt_ids)}
        add_point(self.out, p, OPD_CURVE_FILE)
        print(f"[opd val] refresh {step}: validation tau {tau:.3f} on {len(self.prompt_ids)} held-out prompts", flush=True)
        return p


def backfill_refreshes(validation, out: Path, iterations_done: int) -> None:
    """Measure every finished refresh that has no validation point yet.

    A run finished with ``opd.val_prompts`` 0 (or by a version without validation) and
    resumed with it on would otherwise reach the export with no refresh to select. Each
    iteration's export (``out/iter_NNN/train/final``) is kept, and its metadata holds the
    cumulative and stage FLOPs the loop records. Points already measured are read back.

    Args:
        validation: the stage's ``OPDValidation`` (``point(step, drafter_dir, ...)``).
        out: the OPD run's ``output.dir``.
        iterations_done: refreshes finished (``opd_state.json``).

    Raises:
        PlanError: a finished refresh's export is missing.
    """
    for it in range(iterations_done):
        export = Path(out) / f"iter_{it:03d}" / "train" / "final"
        if not (export / "config.json").is_file():
            raise PlanError(f"{export}: refresh {it + 1} is recorded as done but its export is missing; "
                            "restore it or start the run in a fresh output.dir")
        meta = read_drafter_metadata(export)
        # an export from before the ledgers were stamped has none: no FLOPs, not zero
        budget = lambda key: FlopsLedger.from_dict(meta[key]).drafter_budget if meta.get(key) else None  # noqa: E731
        validation.point(it + 1, export, drafter_flops=budget("flops"), opd_flops=budget("opd_flops"))


def select_refresh(curve: list[dict], rule: str) -> dict:
    """The refresh to export among the OPD points (step >= 1) of ``curve`` (``validation.select``'s rules).

    Raises:
        ValueError: no refresh point yet, or an unknown rule (``opd.select``).
    """
    try:
        return select([p for p in curve if p["step"] >= 1], rule)
    except ValueError as e:
        raise ValueError(str(e).replace("sft.select", "opd.select")) from None


def plot_opd_curve(curve: list[dict], path: Path, selected_step: Optional[int], start_meta: dict) -> Path:
    """``opd_curve.png``: the OPD curve (start included) on the axes of the start drafter's own SFT curve.

    The start's SFT curve comes from its export metadata (``validation.curve``) when it
    has one; its tau was measured on the SFT run's validation prompts, so the two curves
    share the FLOPs axis exactly and the tau axis up to the prompt sets.
    """
    sft_curve = ((start_meta or {}).get("validation") or {}).get("curve") or []
    refs = {"start's SFT (its own validation prompts)": sft_curve} if sft_curve else {}
    return plot_curve([p for p in curve if p.get("drafter_flops") is not None], path, selected_step, label="OPD",
                      references=refs)
