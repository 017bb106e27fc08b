"""The OPD trainer on tiny random models: training, resume, export, feature source, non-finite guard."""

import json

import pytest
import torch

from specforge_opd.config import load_config
from specforge_opd.models.drafter import drafter_layer_ids, load_drafter
from specforge_opd.rollout.records import Teacher
from specforge_opd.train.replay import recompute_from_target
from specforge_opd.train.trainer import BatchOrder, NonFiniteError, distill

from conftest import make_tiny_drafter, make_tiny_target
from fault_hooks import FaultHooks, InjectedFault
from opd_helpers import make_records

MASK = 96


@pytest.fixture(scope="module")
def setup():
    target = make_tiny_target()
    drafter = make_tiny_drafter(target, block_size=4, layers=2)
    layers = drafter_layer_ids(drafter)
    records = make_records(target, layers, 6, block_size=4, response_len=12)
    return target, drafter, records


def _cfg(tmp_path, **training):
    ov = [f"training.{k}={v}" for k, v in training.items()]
    ov += ["output.tensorboard=false", f"output.dir={tmp_path}"]
    return load_config(None, ov)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_batch_order_covers_each_record_once_per_epoch():
    o = BatchOrder(num_records=7, batch_size=1, accumulation_steps=2, world_size=2, num_epochs=2, seed=3)
    assert o.steps_per_epoch == 2 and o.total_steps == 4
    for epoch in range(2):
        seen = [i for s in range(epoch * 2, epoch * 2 + 2) for i in o.step_indices(s)]
        assert sorted(seen) == list(range(7))
    # the short last batch is padded for rank 1 (None), never dropped
    slots = [o.local_slots(1, r) for r in range(2)]
    flat = [i for r in slots for mb in r for i in mb if i is not None]
    assert sorted(flat) == sorted(o.step_indices(1)) and len(flat) == 3


def test_training_lowers_the_loss_and_logs_metrics(tmp_path, setup):
    target, drafter, records = setup
    cfg = _cfg(tmp_path, learning_rate=3e-3, num_epochs=6, warmup_ratio=0.0, batch_size=2, chunk_slots=5)
    res = distill(cfg, drafter_init=drafter, out_dir=tmp_path, target=target, records=records, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, res.total_steps + 1))
    first_epoch = sum(r["loss"] for r in rows if r["epoch"] == 0)
    last_epoch = sum(r["loss"] for r in rows if r["epoch"] == 5)
    assert last_epoch < 0.8 * first_epoch
    for k in ("L_acc", "L_rej", "grad_norm", "lr", "tokens_per_s", "accepted_fraction", "policy_lag"):
        assert k in rows[0]
    assert rows[0]["policy_lag"] == 0 and rows[-1]["policy_lag"] == res.total_steps - 1
    # the caller's drafter is not trained in place
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, make_tiny_drafter(target, block_size=4, layers=2).state_dict()[k])


def test_export_reloads_and_reproduces_outputs(tmp_path, setup):
    """The HF export and the DCP training state hold the same trained drafter."""
    from specforge_opd.train.checkpoint import latest_checkpoint, load_checkpoint
    from specforge_opd.train.replay import replay_hidden

    target, drafter, records = setup
    cfg = _cfg(tmp_path, learning_rate=1e-3, num_epochs=1, batch_size=3)
    res = distill(cfg, drafter_init=drafter, out_dir=tmp_path, target=target, records=records, progress=False)
    back = load_drafter(res.export_dir, target_config=target.config).eval()
    assert json.loads((res.export_dir / "specforge_opd.json").read_text())["step"] == res.drafter_step == 2
    restored = make_tiny_drafter(target, seed=7, block_size=4, layers=2)
    load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), restored, torch.optim.AdamW(restored.parameters()))
    emb = target.model.embed_tokens
    with torch.no_grad():
        h_init = replay_hidden(drafter.eval(), emb, records[0], MASK)
        h_back = replay_hidden(back, emb, records[0], MASK)
        h_ckpt = replay_hidden(restored.eval(), emb, records[0], MASK)
    assert not torch.allclose(h_init, h_back, atol=1e-4)  # it trained
    torch.testing.assert_close(h_back, h_ckpt, atol=0, rtol=0)
    assert sorted(p.name for p in res.export_dir.iterdir()) == ["config.json", "model.safetensors", "specforge_opd.json"]


def test_kill_and_resume_equals_uninterrupted(tmp_path, setup):
    target, drafter, records = setup
    kw = dict(learning_rate=1e-3, num_epochs=2, batch_size=1, accumulation_steps=2, checkpoint_interval=2, warmup_ratio=0.2)
    full = distill(_cfg(tmp_path / "a", **kw), drafter_init=drafter, out_dir=tmp_path / "a", target=target, records=records, progress=False)
    assert full.total_steps == 6
    # training.keep_checkpoints (default 2): older step directories are pruned
    assert sorted(d.name for d in (tmp_path / "a" / "checkpoints").glob("step-*")) == ["step-000004", "step-000006"]
    with pytest.raises(InjectedFault):
        distill(_cfg(tmp_path / "b", **kw), drafter_init=drafter, out_dir=tmp_path / "b", target=target, records=records, progress=False, hooks=FaultHooks(after_steps=3))
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step-000002"
    res = distill(_cfg(tmp_path / "b", **kw), drafter_init=drafter, out_dir=tmp_path / "b", target=target, records=records, progress=False)
    assert res.steps_run == 4  # steps 3..6: the next batch after the checkpoint, none skipped
    a = load_drafter(full.export_dir).state_dict()
    b = load_drafter(res.export_dir).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    rows = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5, 6]
    assert sorted(d.name for d in (tmp_path / "b" / "checkpoints").glob("step-*")) == ["step-000004", "step-000006"]


def test_resume_at_epoch_boundary_trains_the_next_epoch(tmp_path, setup):
    target, drafter, records = setup
    kw = dict(learning_rate=1e-3, num_epochs=2, batch_size=2, checkpoint_interval=3)
    full = distill(_cfg(tmp_path / "a", **kw), drafter_init=drafter, out_dir=tmp_path / "a", target=target, records=records, progress=False)
    with pytest.raises(InjectedFault):
        distill(_cfg(tmp_path / "b", **kw), drafter_init=drafter, out_dir=tmp_path / "b", target=target, records=records, progress=False, hooks=FaultHooks(after_steps=3))
    res = distill(_cfg(tmp_path / "b", **kw), drafter_init=drafter, out_dir=tmp_path / "b", target=target, records=records, progress=False)
    assert res.steps_run == 3 and not res.already_complete
    a, b = load_drafter(full.export_dir).state_dict(), load_drafter(res.export_dir).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    # a finished run says so instead of silently reporting a fresh success
    again = distill(_cfg(tmp_path / "b", **kw), drafter_init=drafter, out_dir=tmp_path / "b", target=target, records=records, progress=False)
    assert again.already_complete and again.steps_run == 0


def test_resume_onto_other_data_is_refused(tmp_path, setup):
    from specforge_opd.train.checkpoint import CheckpointError

    target, drafter, records = setup
    kw = dict(num_epochs=1, batch_size=3, checkpoint_interval=1)
    with pytest.raises(InjectedFault):
        distill(_cfg(tmp_path, **kw), drafter_init=drafter, out_dir=tmp_path, target=target, records=records, progress=False, hooks=FaultHooks(after_steps=1))
    with pytest.raises(CheckpointError, match="other data"):
        distill(_cfg(tmp_path, **kw), drafter_init=drafter, out_dir=tmp_path, target=target, records=records[:5], progress=False)


@pytest.mark.parametrize("form", ["full", "topk", "token"])
def test_feature_source_target_gives_the_same_loss(tmp_path, setup, form):
    target, drafter, _ = setup
    layers = drafter_layer_ids(drafter)
    recs = make_records(target, layers, 2, block_size=4, response_len=10, form=form, topk=8, seed0=300)
    bare = [recompute_from_target(target, r, layers, form=form) for r in recs]
    for b in bare:
        b.features, b.teacher = None, None
    losses = {}
    for src, data in (("shard", recs), ("target", bare)):
        cfg = _cfg(tmp_path / src, num_epochs=1, batch_size=2, feature_source=src)
        cfg.rollout.teacher, cfg.rollout.teacher_topk = form, 8
        res = distill(cfg, drafter_init=drafter, out_dir=tmp_path / src, target=target, records=data, progress=False)
        losses[src] = res.last_metrics["loss"]
    assert losses["shard"] == pytest.approx(losses["target"], rel=1e-5)
    assert losses["shard"] > 0


def test_nonfinite_steps_are_skipped_then_stop_with_the_shard_named(tmp_path, setup):
    target, drafter, records = setup
    bad = [r for r in records]
    poisoned = []
    for r in bad:
        import dataclasses

        q = dataclasses.replace(r, features=r.features.clone())
        q.features[0, 0] = float("nan")
        q.extra = {"shard_dir": "/spool/iter3"}
        poisoned.append(q)
    # one non-finite step in a row is tolerated with max_nonfinite_steps=2: skipped, counted, parameters untouched
    data = [poisoned[0]] + records[1:]
    cfg = _cfg(tmp_path / "a", num_epochs=1, batch_size=1, shuffle=False, max_nonfinite_steps=2)
    res = distill(cfg, drafter_init=drafter, out_dir=tmp_path / "a", target=target, records=data, progress=False)
    assert res.nonfinite_skipped == 1
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["skipped"] and not rows[1]["skipped"]
    for v in load_drafter(res.export_dir).state_dict().values():
        assert torch.isfinite(v).all()
    cfg = _cfg(tmp_path / "b", num_epochs=1, batch_size=1, shuffle=False, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteError, match=r"step 2: .*shard /spool/iter3"):
        distill(cfg, drafter_init=drafter, out_dir=tmp_path / "b", target=target, records=poisoned, progress=False)
    assert (tmp_path / "b" / "checkpoints" / "step-000002").is_dir()


def test_verified_accepted_stream_trains_the_bonus_slot_too(tmp_path, setup):
    """accepted_stream=verified: the step's loss is the plan's sum, with the bonus slot's forward term added."""
    target, drafter, records = setup
    base = distill(_cfg(tmp_path / "eq1", num_epochs=1, learning_rate=1e-9), drafter_init=drafter, out_dir=tmp_path / "eq1",
                   target=target, records=records, progress=False)
    ver = distill(_cfg(tmp_path / "ver", num_epochs=1, learning_rate=1e-9, accepted_stream="verified"), drafter_init=drafter,
                  out_dir=tmp_path / "ver", target=target, records=records, progress=False)
    a = [json.loads(x) for x in (tmp_path / "eq1" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "ver" / "metrics.jsonl").read_text().splitlines()]
    assert base.total_steps == ver.total_steps and len(a) == len(b)
    # the rejected term is the same slots either way; the accepted term now holds the bonus slots as well
    assert any(x["L_acc"] != y["L_acc"] for x, y in zip(a, b))
    for x, y in zip(a, b):
        assert y["L_rej"] == pytest.approx(x["L_rej"], rel=1e-5)
    import copy

    token = copy.deepcopy(records)  # the module's records stay as they are
    for r in token:
        r.teacher = Teacher("token", draft_logprob=torch.zeros(r.drafts.shape))
    with pytest.raises(ValueError, match="accepted_stream=verified"):
        distill(_cfg(tmp_path / "tok", accepted_stream="verified"), drafter_init=drafter, out_dir=tmp_path / "tok",
                target=target, records=token, progress=False)


def test_distill_shows_its_progress_in_a_log(tmp_path, setup, monkeypatch):
    """With its progress bar on and stderr a log file (not a terminal), distill runs and the log gets
    whole progress lines (the bar once failed: its module name was shadowed by distill's own flag)."""
    import io
    import sys

    from specforge_opd import progress

    target, drafter, records = setup
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    cfg = _cfg(tmp_path, learning_rate=1e-3, num_epochs=1, batch_size=3)
    res = distill(cfg, drafter_init=drafter, out_dir=tmp_path, target=target, records=records, progress=True)
    lines = [x for x in err.getvalue().splitlines() if x.startswith("distill:")]
    assert lines and f"{res.total_steps}/{res.total_steps}" in lines[-1] and "\r" not in err.getvalue()
