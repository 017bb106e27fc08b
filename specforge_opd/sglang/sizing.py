"""How many native rollouts a launched SGLang server runs at once: its KV pool against one request's tokens.

``verify_client.for_each_prompt`` bounds the requests in flight per server by the
pool the server reports and its running slots; these functions say what that
bound will be before a server starts (the ``--dry-run`` plan) and log it once one
has. SGLang 0.5.23 resets DFLASH's ``max_running_requests`` to 48 unless set.
"""

from __future__ import annotations

from typing import Optional

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
    from specforge_opd.sglang.native import request_tokens

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
