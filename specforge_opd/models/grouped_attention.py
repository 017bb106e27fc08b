"""Grouped-query attention through SDPA without repeating the keys and values per query head.

transformers' ``sdpa`` attention repeats every key/value head once per query head of its
group (``repeat_kv``) whenever an attention mask is given, because SDPA's own
``enable_gqa`` falls back to the math kernel with a mask. Over a long cache that copy
costs more than the attention: for the drafter (9 query heads on 3 key/value heads) it
writes three times the cache per layer per step. Here the query heads that share a
key/value head are stacked along the query axis instead, so SDPA reads each cached key
once. Every query row's softmax is its own, so this is the same attention (each row is
the same dot products and the same softmax; only float rounding may differ from the
repeated form).

Used where the DFlash drafter's short query blocks attend over long contexts: the offline
replay (``eval.replay.offline_tau``) and the in-process rollout's drafter
(``rollout.step.CachedDFlashDrafter``). The target's own decode step does the same
grouping in ``rollout.decode._attend``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

#: The name under which the function is registered in transformers' ``AttentionInterface``.
GROUPED_SDPA = "specforge_opd_grouped_sdpa"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the attention output [B, L, H, hd] in
    ``query``'s dtype, and no weights.

    Args:
        query: [B, H, L, hd]; ``H`` a multiple of the key/value heads ``Hkv``. Query head h
            uses key/value head ``h // (H // Hkv)``, as ``repeat_kv`` lays them out.
        key, value: [B, Hkv, S, hd].
        attention_mask: None, or bool [B, 1, L, S] / [B, 1, 1, S] (True: attend) or an
            additive float mask of that shape; a mask per query head is not supported.
    A causal call (no mask, several queries, a causal module, as transformers decides it)
    goes to transformers' own ``sdpa`` attention: the stacked queries would break causality.

    Raises:
        ValueError: ``H`` is not a multiple of ``Hkv``, or the mask has a head axis over 1.
    """
    b, h, q_len, hd = query.shape
    is_causal = kwargs.get("is_causal")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and q_len > 1 and is_causal:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    kv = key.shape[1]
    if h % kv:
        raise ValueError(f"grouped attention: {h} query heads are not a multiple of {kv} key/value heads")
    rep = h // kv
    q = query.reshape(b, kv, rep * q_len, hd)  # heads g*rep .. g*rep+rep-1 share key/value head g
    mask = attention_mask
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"grouped attention: mask of shape {tuple(mask.shape)}; expected [B, 1, L, S]")
        if mask.shape[2] != 1:  # one mask row per query: repeat it for each stacked head (one row broadcasts as it is)
            s = mask.shape[-1]
            mask = mask.expand(b, 1, q_len, s).unsqueeze(2).expand(b, 1, rep, q_len, s).reshape(b, 1, rep * q_len, s)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=False)
    return out.reshape(b, h, q_len, hd).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    if GROUPED_SDPA not in AttentionInterface():  # keep a registration already made (tests count calls through one)
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)


@contextlib.contextmanager
def grouped_attention(model: torch.nn.Module) -> Iterator[None]:
    """While inside, a model whose config asks for ``sdpa`` attends with ``grouped_sdpa_attention``.

    Any other attention implementation (eager, flex) is left as it is. The config is restored
    on exit, also after an error.
    """
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield
        return
    _register()
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before
