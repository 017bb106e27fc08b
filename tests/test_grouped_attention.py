"""Grouped-query SDPA without repeated keys equals transformers' sdpa, and the offline replay uses it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specforge_opd.eval import replay
from specforge_opd.models import grouped_attention as ga


class _Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = False


@pytest.mark.parametrize("mask_shape", ["per_query", "broadcast", None])
def test_grouped_sdpa_equals_repeated_sdpa(mask_shape):
    g = torch.Generator().manual_seed(0)
    b, kv, rep, L, S, hd = 4, 2, 3, 8, 37, 16
    q = torch.randn(b, kv * rep, L, hd, generator=g)
    k, v = torch.randn(b, kv, S, hd, generator=g), torch.randn(b, kv, S, hd, generator=g)
    valid = torch.arange(S)[None, :] < torch.tensor([37, 20, 9, 30])[:, None]  # right-padded contexts
    mask = {"per_query": valid[:, None, None, :].expand(b, 1, L, S), "broadcast": valid[:, None, None, :], None: None}[mask_shape]
    m = _Attn()
    m.num_key_value_groups = rep
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=hd ** -0.5)
    got, _ = ga.grouped_sdpa_attention(m, q, k, v, mask, scaling=hd ** -0.5)
    assert got.shape == want.shape == (b, L, kv * rep, hd)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grouped_sdpa_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match="not a multiple"):
        ga.grouped_sdpa_attention(_Attn(), torch.zeros(1, 5, 2, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), None)


def test_replay_attends_grouped_and_restores_the_config(tiny_target, tiny_drafter, monkeypatch):
    """offline_tau routes the drafter's attention through the grouped form while it runs, gives the same
    records in groups of any size, and leaves the drafter's config as it found it."""
    assert tiny_drafter.config._attn_implementation == "sdpa"
    cache = replay.TrajectoryCache(None, tiny_target, "tiny", max_new_tokens=12, stop_token_ids=[1])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (int(n),), generator=g).tolist() for n in (4, 9, 6, 11, 5)]
    trajs = cache.get(prompts, replay.drafter_layer_ids(tiny_drafter))
    calls = []
    real = ga.grouped_sdpa_attention

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setitem(__import__("transformers").AttentionInterface._global_mapping, ga.GROUPED_SDPA, counting)
    whole = replay.offline_tau(tiny_drafter, tiny_target, trajs)
    assert calls and tiny_drafter.config._attn_implementation == "sdpa"
    monkeypatch.setattr(replay, "REPLAY_GROUP", 2)
    pairs = replay.offline_tau(tiny_drafter, tiny_target, trajs)
    for a, b in zip(whole, pairs):
        assert a.anchors.tolist() == b.anchors.tolist() and a.accepted.tolist() == b.accepted.tolist()
        assert torch.equal(a.drafts, b.drafts)


def test_a_causal_call_is_left_to_transformers_sdpa():
    """Stacked query heads would let a query see the next head's later positions: causal calls fall back."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 6, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    m = _Attn()
    m.is_causal = True
    want, _ = sdpa_attention_forward(m, q, k, v, None)
    got, _ = ga.grouped_sdpa_attention(m, q, k, v, None)
    torch.testing.assert_close(got, want)
