"""The OPD schedule and spool budget, fixed at plan time before any work (issue 9).

Everything here is arithmetic on the config and the prompt-pool size, so
``specforge-opd opd --dry-run`` can print it for a Qwen3-8B config on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .config import ExperimentConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class OPDPlan:
    """The OPD stage's schedule.

    One optimizer step per ``prompts_per_step`` rolled-out prompts; an iteration
    rolls out ``prompts_per_iteration`` prompts with the current drafter, then
    trains on them (``steps_per_iteration`` optimizer steps). ``total_steps``
    sets the cosine schedule's length; warmup is ``warmup_steps``.
    """

    pool_size: int
    epochs: int
    prompts_per_step: int
    prompts_per_iteration: int
    iterations: int
    steps_per_iteration: int
    total_steps: int
    warmup_steps: int
    est_shard_bytes_per_sequence: int
    est_spool_bytes_per_iteration: int
    spool_budget_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


class PlanError(ValueError):
    """The configuration cannot run as planned; the message names the setting to change."""


def captured_layers(cfg: ExperimentConfig) -> int:
    """Target layers whose features a shard row carries: ``draft.target_layer_ids``, or
    one per drafter layer (SpecForge's ``build_target_layer_ids`` default)."""
    return len(cfg.draft.target_layer_ids) if cfg.draft.target_layer_ids else cfg.draft.num_hidden_layers


def estimate_sequence_bytes(cfg: ExperimentConfig, hidden_size: int, num_layers_captured: int) -> int:
    """Upper-bound bytes of one rolled-out sequence in a shard.

    Assumes the response runs to ``rollout.max_new_tokens`` and the prompt to
    ``data.max_prompt_tokens``; blocks M <= response tokens (tau >= 1).
    Features: (T-1) * n_layers * H * dtype bytes (when ``rollout.store_features``).
    Teacher per drafted slot: ``full`` H * dtype bytes; ``topk`` k * (8 + 4) + 4;
    ``token`` 4 (also when the trainer recomputes features and teacher:
    ``rollout.store_features: false`` with ``training.feature_source: target``). Tokens/anchors/drafts/accepted: int64.
    """
    dt = _DTYPE_BYTES[cfg.target.dtype]
    T = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    M = cfg.rollout.max_new_tokens
    slots = M * (cfg.draft.block_size - 1)
    feats = (T - 1) * num_layers_captured * hidden_size * dt if cfg.rollout.store_features else 0
    form = cfg.rollout.teacher
    if not cfg.rollout.store_features and cfg.training.feature_source == "target":
        form = "token"  # the trainer recomputes the teacher; shards carry the drafted tokens' log-probs at most
    teacher = {
        "full": hidden_size * dt,
        "topk": cfg.rollout.teacher_topk * 12 + 4,
        "token": 4,
    }[form] * slots
    ints = 8 * (T + 2 * M + slots)
    return int(feats + teacher + ints)


def make_plan(cfg: ExperimentConfig, pool_size: int, hidden_size: int, num_layers_captured: int) -> OPDPlan:
    """Fix the OPD schedule for a prompt pool of ``pool_size`` prompts.

    Raises:
        PlanError: ``training.accepted_stream=verified`` with the ``token`` teacher,
            ``opd.prompts_per_iteration`` not a multiple of
            ``opd.prompts_per_step``, an empty pool, or a spool budget that
            cannot hold one iteration's shards (names ``opd.spool_budget_bytes``
            and the alternatives).
    """
    o = cfg.opd
    if cfg.training.accepted_stream == "verified" and cfg.rollout.teacher == "token":
        raise PlanError(
            "training.accepted_stream=verified trains the bonus slot against the target's distribution, which "
            "rollout.teacher=token does not record; use rollout.teacher=full or topk, or accepted_stream=eq1"
        )
    if pool_size <= 0:
        raise PlanError("the OPD prompt pool is empty: check data.train_sources, data.slices and data.num_prompts")
    if o.prompts_per_iteration % o.prompts_per_step:
        raise PlanError(
            f"opd.prompts_per_iteration={o.prompts_per_iteration} must be a multiple of "
            f"opd.prompts_per_step={o.prompts_per_step}"
        )
    epochs = cfg.training.num_epochs
    total_prompts = pool_size * epochs
    iterations = math.ceil(total_prompts / o.prompts_per_iteration)
    steps_per_iteration = o.prompts_per_iteration // o.prompts_per_step
    # The last iteration may be partial: count its steps exactly.
    total_steps = math.ceil(total_prompts / o.prompts_per_step)
    warmup = int(round(cfg.training.warmup_ratio * total_steps))
    per_seq = estimate_sequence_bytes(cfg, hidden_size, num_layers_captured)
    per_iter = per_seq * o.prompts_per_iteration
    if per_iter > o.spool_budget_bytes:
        raise PlanError(
            f"one iteration's shards need up to {per_iter / 2**30:.2f} GiB but opd.spool_budget_bytes="
            f"{o.spool_budget_bytes / 2**30:.2f} GiB; raise opd.spool_budget_bytes, lower "
            f"opd.prompts_per_iteration or rollout.max_new_tokens, or set rollout.store_features=false "
            f"with training.feature_source=target"
        )
    return OPDPlan(
        pool_size=pool_size,
        epochs=epochs,
        prompts_per_step=o.prompts_per_step,
        prompts_per_iteration=o.prompts_per_iteration,
        iterations=iterations,
        steps_per_iteration=steps_per_iteration,
        total_steps=total_steps,
        warmup_steps=warmup,
        est_shard_bytes_per_sequence=per_seq,
        est_spool_bytes_per_iteration=per_iter,
        spool_budget_bytes=o.spool_budget_bytes,
    )


def iteration_prompt_indices(plan: OPDPlan, iteration: int, seed: int) -> list[int]:
    """Indices into the pool for ``iteration``: epochs are concatenated reshuffles of the pool.

    Deterministic in (seed, epoch), so a resumed run rolls out the same prompts.
    """
    import random

    start = iteration * plan.prompts_per_iteration
    stop = min(start + plan.prompts_per_iteration, plan.pool_size * plan.epochs)
    out = []
    order_cache: dict[int, list[int]] = {}
    for g in range(start, stop):
        epoch, i = divmod(g, plan.pool_size)
        if epoch not in order_cache:
            order = list(range(plan.pool_size))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            order_cache[epoch] = order
        out.append(order_cache[epoch][i])
    return out
