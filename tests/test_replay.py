"""Replay alignment: all blocks in one drafter forward equal per-block drafting; slot k predicts a_m + k."""

import torch

from specforge_opd.models.drafter import drafter_layer_ids
from specforge_opd.train.losses import plan_slots
from specforge_opd.train.replay import recompute_from_target, replay_hidden, replay_inputs, slot_teacher

from opd_helpers import make_record

MASK = 96


def test_replay_equals_drafting_each_block_alone(tiny_target, tiny_drafter):
    """What the rollout did for block m: context features of positions < a_m, one block
    [token at a_m, MASK...] at positions a_m..a_m+bs-1. One replay forward must give the same."""
    layers = drafter_layer_ids(tiny_drafter)
    rec = make_record(tiny_target, layers, seed=3, block_size=4)
    emb = tiny_target.model.embed_tokens
    with torch.no_grad():
        h = replay_hidden(tiny_drafter, emb, rec, MASK)
        bs = rec.block_size
        assert h.shape == (rec.num_blocks, bs, 64)
        for m, a in enumerate(rec.anchors.tolist()):
            block = torch.full((1, bs), MASK)
            block[0, 0] = rec.input_ids[a]
            pos = torch.arange(a + bs).view(1, -1)  # context 0..a-1, then the block at a..a+bs-1
            alone = tiny_drafter(
                position_ids=pos,
                noise_embedding=emb(block),
                target_hidden=rec.features[:a].unsqueeze(0),
                attention_mask=None,
                is_causal=False,
            )[0]
            torch.testing.assert_close(h[m], alone, atol=1e-5, rtol=1e-5)


def test_replay_inputs_layout():
    from specforge_opd.rollout.records import RolloutRecord

    rec = RolloutRecord(
        sample_id="x",
        input_ids=torch.arange(10, 20),
        prompt_len=4,
        anchors=torch.tensor([4, 6]),
        drafts=torch.zeros(2, 3, dtype=torch.long),
        accepted=torch.tensor([1, 2]),
    )
    noise, pos, anchors = replay_inputs(rec, MASK)
    assert noise.tolist() == [[14, MASK, MASK, MASK, 16, MASK, MASK, MASK]]
    assert pos.tolist() == [list(range(9)) + [4, 5, 6, 7, 6, 7, 8, 9]]
    assert anchors.tolist() == [[4, 6]]


def test_teacher_slot_k_predicts_position_anchor_plus_k(tiny_target, tiny_drafter):
    """On a greedy rollout an accepted draft at slot k is the teacher's argmax at its slot
    and equals input_ids[a_m + k]; an offset of one would break both."""
    layers = drafter_layer_ids(tiny_drafter)
    rec = make_record(tiny_target, layers, seed=11, block_size=4, greedy=True)
    plan = plan_slots(rec.accepted, rec.block_size)
    t = slot_teacher(rec, plan)
    logits = t["teacher_hidden"] @ tiny_target.lm_head.weight.t()
    checked = 0
    for i in range(plan.num_slots):
        m, k = int(plan.block[i]), int(plan.slot[i])
        if not plan.rejected[i]:
            pos = int(rec.anchors[m]) + k
            assert int(rec.drafts[m, k - 1]) == int(rec.input_ids[pos])
            assert int(logits[i].argmax()) == int(rec.input_ids[pos])
            checked += 1
    assert checked > 0


def test_recompute_from_target_matches_per_block_verify(tiny_target, tiny_drafter):
    layers = drafter_layer_ids(tiny_drafter)
    for form in ("full", "topk", "token"):
        rec = make_record(tiny_target, layers, seed=5, block_size=4, form=form, topk=8)
        again = recompute_from_target(tiny_target, rec, layers, form=form, topk=8)
        torch.testing.assert_close(again.features, rec.features, atol=1e-5, rtol=1e-5)
        if form == "full":
            torch.testing.assert_close(again.teacher_hidden, rec.teacher_hidden, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(again.teacher_draft_logprob, rec.teacher_draft_logprob, atol=1e-5, rtol=1e-5)
        if form == "topk":
            assert torch.equal(again.teacher_topk_ids, rec.teacher_topk_ids)
