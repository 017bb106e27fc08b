"""Sizing a launched SGLang server: its start-up time, its share of the GPU, its KV pool and the rollouts it holds at once.

``verify_client.for_each_prompt`` bounds the requests in flight per server by the
pool the server reports and its running slots (logged once a server runs);
``plan_line`` says what that bound will be before one starts. SGLang 0.5.23 resets
DFLASH's ``max_running_requests`` to 48 unless set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from specforge_opd.config import SGLangConfig


def request_tokens(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """KV-pool tokens one native request may hold: prompt, response, and DFLASH's reserve of two blocks."""
    return int(prompt_len) + int(max_new_tokens) + 2 * int(block_size)


#: DFLASH's running-request default in 0.5.23 (``speculative_hook._handle_dflash``).
DFLASH_RUNNING_SLOTS = 48


def request_concurrency(pool_tokens: Optional[int], request_tokens: int, running_slots: Optional[int],
                        max_in_flight: int) -> int:
    """Requests one server holds at once: min(pool // request tokens, running slots, ``sglang.max_in_flight``).

    ``pool_tokens`` / ``running_slots`` None: not bounded by that term.
    """
    n = int(max_in_flight)
    if pool_tokens is not None:
        n = min(n, int(pool_tokens) // max(1, int(request_tokens)))
    if running_slots is not None:
        n = min(n, int(running_slots))
    return max(0, n)


def kv_bytes_per_token(tconf, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache per token of the target: 2 (K and V) x layers x KV heads x head dim x ``dtype_bytes``."""
    heads = int(getattr(tconf, "num_key_value_heads", None) or tconf.num_attention_heads)
    head_dim = int(getattr(tconf, "head_dim", None) or tconf.hidden_size // tconf.num_attention_heads)
    return 2 * int(tconf.num_hidden_layers) * heads * head_dim * int(dtype_bytes)


def estimate_pool_tokens(free_gib: float, weights_gib: float, reserve_gib: float, tconf, dtype_bytes: int = 2) -> int:
    """The KV pool (tokens) SGLang sizes from ``free_gib`` free at its start: what its weights and the
    reserve (``sglang.gpu_reserve_gb``) leave, over ``kv_bytes_per_token`` (the drafter's own small KV ignored)."""
    rest = (float(free_gib) - float(weights_gib) - float(reserve_gib)) * 2**30
    return max(0, int(rest // kv_bytes_per_token(tconf, dtype_bytes)))


def plan_line(cfg, tconf, prompt_tokens: int, *, free_gib: float, weights_gib: float) -> str:
    """One line for a ``--dry-run`` plan: the pool, one request's tokens and the resulting concurrency.

    ``free_gib``: GPU memory free when the server starts (the GPU's minus what the trainer keeps
    there during the rollout); ``weights_gib``: the target's (and drafter's) weights.
    """
    sg = cfg.sglang
    need = request_tokens(prompt_tokens, cfg.rollout.max_new_tokens, cfg.draft.block_size)
    if sg.max_total_tokens is not None:
        pool, how = int(sg.max_total_tokens), "sglang.max_total_tokens"
    else:
        pool = estimate_pool_tokens(free_gib, weights_gib, sg.gpu_reserve_gb, tconf)
        how = f"sized by SGLang from {free_gib:.0f} GiB free, {weights_gib:.0f} GiB weights, {sg.gpu_reserve_gb:g} GiB reserve"
    n = request_concurrency(pool, need, DFLASH_RUNNING_SLOTS, sg.max_in_flight)
    return (f"sglang: KV pool {pool} tokens ({how}); one request {need} tokens (prompt {prompt_tokens} + "
            f"{cfg.rollout.max_new_tokens} + two blocks): {n} rollouts at once per server (of {DFLASH_RUNNING_SLOTS} "
            f"DFLASH slots, sglang.max_in_flight {sg.max_in_flight})")


def weights_gib(model_dir: Optional[str]) -> float:
    """GiB of weight files (``*.safetensors``, ``*.bin``, ``*.pt``) directly in ``model_dir``; 0 when it is no directory."""
    if model_dir is None or not Path(model_dir).is_dir():
        return 0.0
    return sum(f.stat().st_size for f in Path(model_dir).iterdir() if f.suffix in (".safetensors", ".bin", ".pt")) / 2**30


#: Start-up time allowed: a floor plus seconds per GiB of weights (target and drafter).
STARTUP_FLOOR_S = 600.0
STARTUP_S_PER_GIB = 20.0


def startup_timeout_for(cfg: SGLangConfig, model_path: Optional[str] = None, draft_path: Optional[str] = None) -> float:
    """``sglang.startup_timeout_s``, or when None: 600 s plus 20 s per GiB of the target's and drafter's weights.

    DFLASH start-up loads both models, captures CUDA graphs for target and draft and
    compiles kernels; the server restarts for every new drafter. Qwen3-8B (16 GB of
    bf16 weights) gets about 900 s, Qwen3-30B-A3B (61 GB) about 1700 s.
    """
    if cfg.startup_timeout_s is not None:
        return float(cfg.startup_timeout_s)
    return STARTUP_FLOOR_S + STARTUP_S_PER_GIB * (weights_gib(model_path) + weights_gib(draft_path))


#: Below this share of the free GPU memory a launched server's weights and KV pool would not fit anyway.
MIN_MEM_FRACTION = 0.2


def mem_fraction_for(free_bytes: int, reserve_gb: float) -> float:
    """``--mem-fraction-static`` that leaves ``reserve_gb`` GiB of ``free_bytes`` (free at the server's start) unclaimed.

    SGLang 0.5.23 sizes its KV pool as the memory free after loading its weights
    minus ``(1 - fraction)`` times the memory free before loading
    (``KVCacheConfigurator._profile_available_bytes``): the trainer's drafter and
    optimizer are already out of what is free, and ``1 - reserve / free`` keeps
    ``reserve_gb`` for SGLang's activations and this process. Capped at 0.95.

    Raises:
        ValueError: the fraction would be under 0.2 (names the fields).
    """
    free_gib = float(free_bytes) / 2**30
    frac = 1.0 - float(reserve_gb) / free_gib if free_gib > 0 else 0.0
    if frac < MIN_MEM_FRACTION:
        raise ValueError(
            f"sglang.gpu_reserve_gb={reserve_gb}: only {free_gib:.1f} GiB of the GPU are free when the server starts (the "
            f"trainer holds the rest), which leaves SGLang under {MIN_MEM_FRACTION:.0%} of it for weights and KV pool; "
            "lower sglang.gpu_reserve_gb or set sglang.mem_fraction_static, or free GPU memory (sglang.offload_target)"
        )
    return round(min(frac, 0.95), 3)


def launch_mem_fraction(cfg: SGLangConfig) -> Optional[float]:
    """The ``--mem-fraction-static`` to launch with: ``sglang.mem_fraction_static``, else ``mem_fraction_for``
    the memory free on this process's CUDA device now, else None (no GPU here: SGLang's default)."""
    if cfg.mem_fraction_static is not None:
        return float(cfg.mem_fraction_static)
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return mem_fraction_for(int(free), cfg.gpu_reserve_gb)
