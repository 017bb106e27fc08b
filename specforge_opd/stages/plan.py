"""The stages' plans, fixed before any work: the OPD schedule and spool budget, and memory and disk estimates.

Everything here is arithmetic on the config, the target's HF config and the prompt-pool
size, so ``specforge-opd opd --dry-run`` and ``specforge-opd sft --dry-run`` can print it
for a Qwen3-8B config on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from specforge_opd.config import ExperimentConfig, bonus_teacher_missing
from specforge_opd.data import assets
from specforge_opd.errors import UserError
from specforge_opd.models.drafter import DrafterError, drafter_shape, load_draft_config
from specforge_opd.precision import resolve_sft

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


class PlanError(UserError, ValueError):
    """The configuration cannot run as planned; the message names the setting to change."""


def with_start_shape(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with the ``draft`` shape fields it leaves at their defaults taken from its start drafter.

    The plan sizes shards by ``draft.block_size`` and the captured layers: a bare
    ``draft.path`` to a block-8 drafter under the schema's default block 16 would double
    the spool estimate and could refuse a run that fits. Fields a config sets are its own
    (``preflight.check_drafter_shape`` refuses them when they differ). A start without a
    ``config.json`` (a SpecForge checkpoint) keeps the config's values: the loader reads it
    later, and the plan is an estimate.
    """
    if not cfg.draft.path:
        return cfg
    try:
        shape = drafter_shape(load_draft_config(cfg.resolve_path(cfg.draft.path)))
    except (DrafterError, UserError):
        return cfg
    unset = {k: v for k, v in shape.items() if k not in cfg.draft.model_fields_set}
    return cfg.model_copy(update={"draft": cfg.draft.model_copy(update=unset)}) if unset else cfg


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
    if bonus_teacher_missing(cfg.training.accepted_stream, cfg.rollout.teacher):
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


# ---------------------------------------------------------------------------
# ranks and per-rank memory


def planned_world_size() -> int:
    """Ranks a plan is made for: torchrun's ``WORLD_SIZE``, else ``NNODES`` x ``NPROC`` (what
    ``scripts/train_opd.sh --dry-run`` passes), else 1.

    Raises:
        PlanError: one of them is not a positive integer.
    """
    import os

    def read(name: str) -> int:
        raw = os.environ.get(name, "1") or "1"
        if not raw.isdigit() or int(raw) < 1:
            raise PlanError(f"{name}={raw!r} must be a positive integer (ranks to plan for)")
        return int(raw)

    if os.environ.get("WORLD_SIZE"):
        return read("WORLD_SIZE")
    return read("NNODES") * read("NPROC")


def per_rank_schedule(plan: OPDPlan, world: int) -> dict:
    """What one of ``world`` ranks does: rollout prompts per iteration (rank r takes every
    world-th prompt, so the first ranks may take one more), sequences per optimizer step
    (the accumulation steps of batch 1), and optimizer steps (every rank takes every step).

    Raises:
        PlanError: ``opd.prompts_per_step`` does not split evenly over the ranks.
    """
    if plan.prompts_per_step % world:
        raise PlanError(f"opd.prompts_per_step={plan.prompts_per_step} is not divisible by the {world} ranks; "
                        f"use a multiple of {world}, or another NNODES x NPROC")
    return {
        "world_size": world,
        "rollout_prompts_per_iteration": math.ceil(plan.prompts_per_iteration / world),
        "sequences_per_step": plan.prompts_per_step // world,
        "steps_per_iteration": plan.steps_per_iteration,
        "total_steps": plan.total_steps,
    }


def _target_config(cfg: ExperimentConfig):
    """The target's HF (text) config without loading weights: a local directory, the embedded
    target, or the packaged Qwen3 config fixture matching ``target.path``.

    Raises:
        PlanError: ``target.path`` is neither a directory nor a known Qwen3 size.
    """
    from transformers import AutoConfig

    path = cfg.target.path
    if path is None:
        d = assets.target_entry()
        if not (d / "config.json").is_file():
            d = assets.ensure_target()
        tcfg = AutoConfig.from_pretrained(d)
    elif Path(path).expanduser().is_dir():
        tcfg = AutoConfig.from_pretrained(Path(path).expanduser())
    else:
        size = next((s for s in ("30b-a3b", "8b", "4b") if s in path.lower()), None)
        if size is None:
            raise PlanError(f"target.path={path} is not a local directory and no packaged config fixture matches it")
        tcfg = AutoConfig.from_pretrained(assets.qwen3_fixture_dir(size))
    return getattr(tcfg, "text_config", tcfg)


def _dims(target_config) -> dict:
    t = getattr(target_config, "text_config", target_config)
    H, heads = int(t.hidden_size), int(t.num_attention_heads)
    hd = int(getattr(t, "head_dim", None) or H // heads)
    n_exp = int(getattr(t, "num_experts", 0) or 0)
    moe_inter = int(getattr(t, "moe_intermediate_size", 0) or 0)
    inter = int(getattr(t, "intermediate_size", 4 * H))
    return dict(H=H, V=int(t.vocab_size), L=int(t.num_hidden_layers), heads=heads, kv=int(t.num_key_value_heads), hd=hd,
                inter=inter, mlp_inter=moe_inter * n_exp if n_exp else inter,
                # an MoE layer runs one routed batch through its experts at a time: its transient width
                act_inter=max(inter if not n_exp else 0, moe_inter * int(getattr(t, "num_experts_per_tok", 1) or 1)))


def estimate_rank_memory(cfg: ExperimentConfig, target_config, world: int = 1, *, num_blocks=None,
                         on_gpu: bool = True) -> dict:
    """Estimated peak GPU memory (bytes) of one OPD trainer rank, for replay and for the recompute.

    Counted for the longest sequence the config allows: S = ``data.max_prompt_tokens`` +
    ``rollout.max_new_tokens`` - 1 context rows and ``num_blocks`` blocks (default
    ``rollout.max_new_tokens``: tau 1, the most blocks); one replay forward takes
    g = min(M, ``training.max_blocks_per_forward``) blocks, Q = g * block_size query rows
    over K = S + Q keys. Element sizes: the target's ``target.dtype``; drafter
    activations in bf16 on a GPU (``training.mixed_precision`` auto or bf16: FSDP2
    computes in bf16), fp32 otherwise; ``on_gpu=False`` estimates a CPU run instead
    (fp32 unless bf16 is asked for, and the dense SDPA mask even with flex_attention,
    which has no CPU backward). Terms (each a key of the result):

    - ``target_weights``: the whole frozen target on every rank (params x dtype).
    - ``drafter_state``: fp32 params, grads and two Adam moments, 16 B/param, sharded
      over the ranks, plus the gathered params in the compute dtype.
    - ``sequence_inputs``: the sequence's features [S, n_layers*H] and ``full`` teacher
      hidden [M, bs-1, H] (top-k: [M, bs-1, k] ids and log-probs).
    - ``replay_activations``: what one group's forward keeps for backward: per drafter
      layer Q*(7H + 6*heads*hd + 4*I) + K*(7*kv*hd + 2*heads*hd) (norms, q/k/v with
      RoPE, K/V repeated to all heads for SDPA, the MLP's four I-wide tensors), plus the
      context projection 2*S*H, the noise embedding and final norm 3*Q*H, and the
      gradient buffer of the trained slots [g*(bs-1), H] (the fused lm_head/KL keeps it).
    - ``replay_mask``: the dense SDPA mask of one group, Q*K bools plus its additive copy
      in the compute dtype (0 with flex_attention, whose BlockMask is tiny).
    - ``kl_chunk``: fp32 [C, V] buffers alive at once in one lm_head/KL chunk, C =
      min(``training.chunk_slots``, g*(bs-1)): 4 for ``full`` (student and teacher logits,
      the in-place gradient and a softmax), 3 for ``token``, 2 for ``topk`` (as measured on
      a CPU, ``tests/test_plan.py``).
    - ``recompute_*`` (``training.feature_source: target``): the target's KV cache over S + R
      rows, R = max(min(S, g*(bs-1)), g*(bs-1)) rows per forward; one forward's widest
      activations at R rows; the verify mask R*(S+R) bools; topk/token lm_head chunks.

    ``trainer_peak`` = target + drafter state + inputs + replay terms; ``recompute_peak`` =
    target + drafter state + inputs + the recompute's own terms (it runs before the replay
    of the same sequence, so the two do not add). Not counted: the CUDA context and
    allocator fragmentation (leave some GiB), the rollout's own engine.
    """
    d = _dims(target_config)
    H, V, heads, kv, hd = d["H"], d["V"], d["heads"], d["kv"], d["hd"]
    dt = _DTYPE_BYTES[cfg.target.dtype]
    mp = cfg.training.mixed_precision
    c = 2 if (mp == "bf16" or (mp == "auto" and on_gpu)) else 4
    bs = cfg.draft.block_size
    n = bs - 1
    S = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    M = int(num_blocks if num_blocks is not None else cfg.rollout.max_new_tokens)
    g = min(M, cfg.training.max_blocks_per_forward)
    Q, K = g * bs, S + g * bs
    n_ids = captured_layers(cfg)
    dl = cfg.draft.num_hidden_layers
    I = int(cfg.draft.intermediate_size or d["inter"])

    attn = H * hd * (2 * heads + 2 * kv)
    target_params = d["L"] * (attn + 3 * H * d["mlp_inter"]) + 2 * V * H
    drafter_params = dl * (attn + 3 * H * I + 2 * H + 2 * hd) + n_ids * H * H + 2 * H

    out = {
        "world_size": world,
        "sequence_tokens": S + 1,
        "blocks": M,
        "blocks_per_forward": g,
        "target_params": target_params,
        "drafter_params": drafter_params,
        "target_weights": target_params * dt,
        "drafter_state": 16 * drafter_params // world + c * drafter_params,
    }
    teacher = {"full": M * n * H * dt, "topk": M * n * cfg.rollout.teacher_topk * 12, "token": M * n * 4}[cfg.rollout.teacher]
    out["sequence_inputs"] = S * n_ids * H * dt + teacher
    per_layer = Q * (7 * H + 6 * heads * hd + 4 * I) + K * (7 * kv * hd + 2 * heads * hd)
    out["replay_activations"] = c * (dl * per_layer + 2 * S * H + 3 * Q * H + g * n * H)
    out["replay_mask"] = 0 if cfg.training.attention_backend == "flex_attention" and on_gpu else Q * K * (1 + c)
    C = min(cfg.training.chunk_slots, g * n)
    out["kl_chunk"] = C * V * 4 * {"full": 4, "topk": 2, "token": 3}[cfg.rollout.teacher]
    resident = out["target_weights"] + out["drafter_state"] + out["sequence_inputs"]
    out["trainer_peak"] = resident + out["replay_activations"] + out["replay_mask"] + out["kl_chunk"]
    R = max(min(S, g * n), g * n)
    out["recompute_kv_cache"] = d["L"] * 2 * (S + R) * kv * hd * dt
    out["recompute_activations"] = R * dt * max(2 * d["act_inter"], 2 * heads * hd + 2 * H) + 2 * (S + R) * heads * hd * dt
    out["recompute_mask"] = R * (S + R)
    out["recompute_lm_head"] = 0 if cfg.rollout.teacher == "full" else min(cfg.training.chunk_slots, M * n) * V * 4 * 2
    out["recompute_peak"] = (resident + out["recompute_kv_cache"] + out["recompute_activations"] + out["recompute_mask"]
                             + out["recompute_lm_head"]) if cfg.training.feature_source == "target" else None
    return out


def estimate_sft(cfg: ExperimentConfig, target_config, draft_config, num_prompts: Optional[int]) -> dict:
    """Upper-bound memory and disk estimates of the SFT stage (bytes; no weights loaded).

    Returns ``{"target_params", "target_weights_bytes", "drafter_params",
    "train_memory_bytes_per_rank", "feature_bytes_per_sample_max", "features_disk_bytes_max",
    "responses_disk_bytes_max", "max_sequence_tokens", "precision"}`` (the two disk totals None without
    ``num_prompts``).

    Sequences are assumed to fill ``data.max_prompt_tokens + sft.max_new_tokens``
    (capped by ``target.max_context``). Features: S * n_layers * H * bytes of the
    drafter's dtype (``resolve_sft`` for the planned device) per sample. Train: fp32 drafter weights + grads + Adam moments (16 B/param),
    the frozen embedding and lm_head in the run dtype, and SpecForge's DFlash
    logits chunk of min(num_anchors, 128) blocks * block_size * vocab fp32 (x3 for
    softmax and its gradient).

    The plan is for GPUs unless ``target.device`` is ``cpu``, so a laptop's ``--dry-run`` of a
    cluster config plans the cluster's run. ``precision`` in the result is
    ``training.mixed_precision`` resolved for that device (``precision.resolve_sft``).
    """
    plan_device = "cpu" if cfg.target.device == "cpu" else "cuda"
    precision = resolve_sft(cfg.training.mixed_precision, cfg.target.dtype, plan_device)

    t = getattr(target_config, "text_config", target_config)
    H, V, L = int(t.hidden_size), int(t.vocab_size), int(t.num_hidden_layers)
    dt = _DTYPE_BYTES[cfg.target.dtype]
    S = min(cfg.target.max_context, cfg.data.max_prompt_tokens + cfg.sft.max_new_tokens)
    n_ids = len(draft_config.dflash_config["target_layer_ids"])
    inter = int(getattr(t, "intermediate_size", 4 * H))
    n_experts = int(getattr(t, "num_experts", 0) or 0)
    moe_inter = int(getattr(t, "moe_intermediate_size", 0) or 0)
    heads, kv, hd = int(t.num_attention_heads), int(t.num_key_value_heads), int(getattr(t, "head_dim", H // t.num_attention_heads) or H // t.num_attention_heads)
    attn = H * hd * (heads * 2 + kv * 2)
    mlp = 3 * H * (moe_inter * n_experts if n_experts else inter)
    target_params = L * (attn + mlp) + 2 * V * H
    dl = draft_config.num_hidden_layers
    d_inter = int(draft_config.intermediate_size)
    d_attn = H * int(draft_config.head_dim) * (draft_config.num_attention_heads * 2 + draft_config.num_key_value_heads * 2)
    draft_params = dl * (d_attn + 3 * H * d_inter) + n_ids * H * H
    blocks = min(cfg.training.num_anchors, 128)
    logits = blocks * draft_config.block_size * V * 4 * 3
    per_sample = S * (n_ids * H * _DTYPE_BYTES[precision.dtype] + 16)
    n = num_prompts
    return {
        "target_params": target_params,
        "target_weights_bytes": target_params * dt,
        "drafter_params": draft_params,
        "train_memory_bytes_per_rank": draft_params * 16 + 2 * V * H * dt + logits * cfg.training.batch_size,
        "feature_bytes_per_sample_max": per_sample,
        "features_disk_bytes_max": per_sample * n if n else None,
        "responses_disk_bytes_max": S * 8 * n if n else None,
        "max_sequence_tokens": S,
        "precision": precision.record(),
    }
