"""FLOPs formulas checked against torch's own FlopCounterMode on tiny models (eager attention,
so the attention products are visible to the counter as full [q, k] matmuls)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from specforge_opd.eval import flops as F
from specforge_opd.models.adapter import extract_context_feature

from conftest import make_tiny_drafter, make_tiny_target


def _counted(fc: FlopCounterMode) -> int:
    """Total FLOPs minus the rotary embedding's inv_freq outer product, which flops.py
    leaves out on purpose (O(positions * head_dim / 2), not a weight matmul)."""
    rope = sum(sum(v.values()) for k, v in fc.get_flop_counts().items() if k.endswith("rotary_emb"))
    return fc.get_total_flops() - rope


def _eager(model):
    model.config._attn_implementation = "eager"
    return model


def test_target_forward_matches_flop_counter():
    t = _eager(make_tiny_target())
    n = 10
    ids = torch.randint(0, 90, (1, n))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        t(ids)
    # eager attention multiplies the full [n, n] score matrix (the causal mask is additive)
    assert F.target_forward_flops(t.config, tokens=n, attended_keys=n * n, lm_head_tokens=n) == _counted(fc)


def test_drafter_training_matches_flop_counter():
    t = make_tiny_target()
    d = _eager(make_tiny_drafter(t, block_size=4, layers=2))
    d.train()
    for p in t.parameters():
        p.requires_grad_(False)  # frozen target: embedding and lm_head
    ctx_len, bs = 7, d.block_size
    ids = torch.randint(0, 90, (1, ctx_len + 1))
    with torch.no_grad():
        feats = extract_context_feature(t(ids, output_hidden_states=True).hidden_states, d.target_layer_ids)[:, :ctx_len]
    block = torch.full((1, bs), 96)
    block[0, 0] = ids[0, -1]
    noise = t.model.embed_tokens(block)
    pos = torch.arange(ctx_len + bs).unsqueeze(0)
    with FlopCounterMode(display=False) as fc:
        h = d(position_ids=pos, noise_embedding=noise, target_hidden=feats, attention_mask=None, is_causal=False)
        logits = t.lm_head(h[:, 1:])
        logits.float().logsumexp(-1).sum().backward()
    want = F.drafter_training_flops(
        d.config,
        query_slots=bs,
        context_rows=ctx_len,
        attended_keys=F.dflash_block_attended_keys([ctx_len], bs),
        lm_head_slots=bs - 1,
    )
    assert want["total"] == _counted(fc)


def test_rollout_and_capture_counts_are_consistent():
    t = make_tiny_target()
    # a rollout whose blocks cover the same tokens as a capture costs more than the capture
    # (verify slots beyond the accepted ones, logits at every slot) but the same order of magnitude
    P, bs = 20, 4
    anchors = [20, 22, 23, 27]
    roll = F.rollout_target_flops(t.config, prompt_len=P, anchors=anchors, block_size=bs)
    cap = F.capture_target_flops(t.config, seq_len=28)
    assert cap < roll < 4 * cap
    # AR decoding of N tokens = prefill + N-1 single steps; each step = one token's matmuls + attention + lm_head
    ar = F.autoregressive_target_flops(t.config, prompt_len=P, new_tokens=3)
    step = lambda keys: F.target_forward_flops(t.config, tokens=1, attended_keys=keys, lm_head_tokens=1)
    prefill = F.target_forward_flops(t.config, tokens=P, attended_keys=P * (P + 1) // 2, lm_head_tokens=1)
    assert ar == prefill + step(P + 1) + step(P + 2)


def test_opd_replay_adds_teacher_lm_head_for_full_form_only():
    t = make_tiny_target()
    d = make_tiny_drafter(t, block_size=4)
    full = F.opd_replay_flops(d.config, [10, 12], teacher_form="full")
    tok = F.opd_replay_flops(d.config, [10, 12], teacher_form="token")
    assert full["teacher_lm_head"] == 2 * 64 * 97 * 2 * 3
    assert full["total"] - tok["total"] == full["teacher_lm_head"]
    assert tok["teacher_lm_head"] == 0


def test_ledger_roundtrip_and_bad_metadata():
    a = F.FlopsLedger(drafter_train=1e18, teacher_lm_head=2e17, target_rollout=3e18)
    b = F.FlopsLedger.from_dict(a.to_dict())
    assert b.drafter_budget == pytest.approx(1.2e18)
    assert a.add(b).target_total == pytest.approx(6e18)
    with pytest.raises(ValueError, match="drafter_train"):
        F.FlopsLedger.from_dict({"drafter_train": "lots"})


def test_sft_flops_counts_generation_and_capture_only_where_this_run_made_them(tmp_path):
    """A run that reuses a packed responses step but captures its own features counts the capture
    forward and not the generation; the default keeps both together."""
    from sft_helpers import tiny_cfg
    from specforge_opd.rollout.responses import ResponseRecord

    t = make_tiny_target()
    d = make_tiny_drafter(t)
    cfg = tiny_cfg(tmp_path)
    recs = [ResponseRecord("a", [1, 2, 3], [4, 5], True), ResponseRecord("b", [1, 2], [6, 7, 8], False)]
    gen = sum(F.autoregressive_target_flops(t.config, prompt_len=len(r.prompt_ids), new_tokens=len(r.response_ids)) for r in recs)
    cap = sum(F.capture_target_flops(t.config, seq_len=len(r.prompt_ids) + len(r.response_ids)) for r in recs)
    run = lambda **kw: F.sft_flops(cfg, d.config, t.config, recs, steps=3, **kw)
    assert run().target_capture == gen + cap
    assert run(captured_here=False).target_capture == 0
    assert run(generated_here=False, captured_here=True).target_capture == cap
    assert run(generated_here=True, captured_here=False).target_capture == gen
    assert len({run(**kw).drafter_train for kw in ({}, {"captured_here": False}, {"generated_here": False})}) == 1
