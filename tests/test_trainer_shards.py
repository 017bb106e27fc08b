"""The trainer on real rollouts: SpeculativeEngine -> ShardWriter -> read_shards -> replay -> distill."""

import pytest
import torch

from specforge_opd.config import RolloutConfig, load_config
from specforge_opd.models.drafter import drafter_layer_ids
from specforge_opd.train.replay import recompute_from_target, replay_logits
from specforge_opd.train.trainer import distill, load_records

MASK = 96


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from specforge_opd.rollout.engine import SpeculativeEngine
    from specforge_opd.rollout.shards import ShardWriter

    from conftest import make_tiny_drafter, make_tiny_target

    target = make_tiny_target()
    drafter = make_tiny_drafter(target, block_size=4, layers=2)
    rcfg = RolloutConfig(max_new_tokens=12, teacher="full", store_features=True)
    eng = SpeculativeEngine(target, drafter, rcfg, stop_token_ids=[1], mask_token_id=MASK, record_draft_logits=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (6,), generator=g).tolist() for _ in range(4)]
    recs = eng.generate(prompts, drafter_step=0)
    d = tmp_path_factory.mktemp("shards")
    meta = {"block_size": 4, "target_layer_ids": drafter_layer_ids(drafter), "mask_token_id": MASK, "target_identity": "tiny", "teacher": "full"}
    w = ShardWriter(d, meta)
    w.write(recs[:2])
    w.write(recs[2:])
    return target, drafter, recs, d


def test_replay_reproduces_the_rollout_drafter_logits(rollouts):
    """The engine's own drafter logits at slot k of block m equal the replay's: same context cut,
    same positions, same slot offset."""
    target, drafter, recs, _ = rollouts
    with torch.no_grad():
        for r in recs:
            got = replay_logits(drafter, target.model.embed_tokens, target.lm_head.weight, r, MASK)
            torch.testing.assert_close(got, r.extra["draft_logits"].float(), atol=1e-4, rtol=1e-4)
            # accepted drafts were the rollout's argmax, so they are the replay's argmax too
            for m, a in enumerate(r.accepted.tolist()):
                assert torch.equal(got[m, :a].argmax(-1), r.drafts[m, :a])


def test_engine_teacher_equals_target_recompute(rollouts):
    target, drafter, recs, _ = rollouts
    r = recs[0]
    again = recompute_from_target(target, r, drafter_layer_ids(drafter), form="full")
    torch.testing.assert_close(again.features, r.features.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again.teacher_hidden, r.teacher_hidden.float(), atol=1e-4, rtol=1e-4)


def test_distill_from_shard_directory(tmp_path, rollouts):
    target, drafter, recs, d = rollouts
    loaded = load_records([d])
    assert [r.sample_id for r in loaded] == [r.sample_id for r in recs]
    cfg = load_config(None, ["training.batch_size=2", "output.tensorboard=false", "training.num_epochs=1"])
    res = distill(cfg, [d], drafter, tmp_path, target=target, progress=False)
    assert res.step == 2 and (res.export_dir / "model.safetensors").is_file()
    assert res.last_metrics["loss"] > 0
