"""``specforge-opd rollout`` with ``rollout.backend: sglang_verify|sglang_native`` against the stand-in
server gives the same shards' anchors, drafts, accepted counts and tokens as the embedded backend."""

import pytest
import torch

from specforge_opd.config import load_config
from specforge_opd.models.drafter import drafter_layer_ids, save_drafter
from specforge_opd.models.target import TargetBundle
from specforge_opd.rollout.shards import read_shards
from specforge_opd.sglang.contract import server_layer_ids
from specforge_opd.sglang.speculate import Drafter
from specforge_opd.stages.rollout import run_rollout
from specforge_opd.testing.standin import StandinBackend, ThreadedStandin, make_app

from conftest import make_tiny_drafter, make_tiny_target

PROMPTS = [("p0", [5, 17, 33, 8]), ("p1", [40, 41, 42]), ("p2", [7, 9, 11, 13, 15, 3])]


@pytest.mark.parametrize("backend", ["sglang_verify", "sglang_native"])
def test_rollout_cli_over_standin_equals_embedded(tmp_path, monkeypatch, backend):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    ddir = save_drafter(drafter, tmp_path / "drafter")
    bundle = TargetBundle(model=target, tokenizer=None, path=tmp_path, identity="tiny", stop_token_ids=[1])
    monkeypatch.setattr("specforge_opd.models.target.load_target", lambda tcfg: bundle)
    common = [f"draft.path={ddir}", "rollout.max_new_tokens=10", "rollout.teacher=token", "rollout.sequences_per_shard=2",
              "target.max_context=64", "training.feature_source=target"]
    run_rollout(load_config(None, common + ["rollout.backend=embedded"]), tmp_path / "embedded", prompts=PROMPTS)
    layers = drafter_layer_ids(drafter)
    native = backend == "sglang_native"
    wrapped = Drafter(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    sb = StandinBackend(target, aux_layer_ids=server_layer_ids(layers), drafter=wrapped if native else None,
                        block_size=drafter.block_size if native else None)
    with ThreadedStandin(make_app(sb, native=native)) as server:
        cfg = load_config(None, common + [f"rollout.backend={backend}", f"sglang.urls=[{server.url}]"])
        run_rollout(cfg, tmp_path / "http", prompts=PROMPTS)
        # a rerun resumes: every prompt is already in a complete shard, nothing is rolled out again
        run_rollout(cfg, tmp_path / "http", prompts=PROMPTS)
    # and a rerun after everything is written needs no server: the one it names is gone
    run_rollout(cfg, tmp_path / "http", prompts=PROMPTS)
    ref = {r.sample_id: r for r in read_shards(tmp_path / "embedded")}
    got = {r.sample_id: r for r in read_shards(tmp_path / "http")}
    assert sorted(got) == sorted(ref) == ["p0", "p1", "p2"]
    for sid, r in ref.items():
        g = got[sid]
        assert torch.equal(g.input_ids, r.input_ids), sid
        assert torch.equal(g.anchors, r.anchors) and torch.equal(g.accepted, r.accepted), sid
        assert torch.equal(g.drafts, r.drafts), sid
        assert torch.allclose(g.teacher_draft_logprob, r.teacher_draft_logprob, atol=1e-4), sid


def test_native_shards_train_with_recomputed_features(tmp_path, monkeypatch):
    """The native-mode loop: SGLang-style rollout (no features, token teacher) -> shards -> the trainer
    recomputes features and the full teacher with its frozen target, and gives the same loss as training
    on embedded shards that carry them."""
    from specforge_opd.train.trainer import distill

    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    ddir = save_drafter(drafter, tmp_path / "drafter")
    bundle = TargetBundle(model=target, tokenizer=None, path=tmp_path, identity="tiny", stop_token_ids=[1])
    monkeypatch.setattr("specforge_opd.models.target.load_target", lambda tcfg: bundle)
    common = [f"draft.path={ddir}", "rollout.max_new_tokens=10", "rollout.sequences_per_shard=3", "target.max_context=64",
              "training.num_epochs=1", "training.batch_size=3", "training.shuffle=false", "output.tensorboard=false"]
    run_rollout(load_config(None, common + ["rollout.backend=embedded", "rollout.teacher=full"]), tmp_path / "embedded", prompts=PROMPTS)
    wrapped = Drafter(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    sb = StandinBackend(target, aux_layer_ids=server_layer_ids(drafter_layer_ids(drafter)), drafter=wrapped, block_size=drafter.block_size)
    with ThreadedStandin(make_app(sb, native=True)) as server:
        ncfg = load_config(None, common + ["rollout.backend=sglang_native", "rollout.teacher=token", "rollout.store_features=false",
                                           "training.feature_source=target", f"sglang.urls=[{server.url}]"])
        run_rollout(ncfg, tmp_path / "native", prompts=PROMPTS)
    assert all(r.features is None for r in read_shards(tmp_path / "native"))
    ref = distill(load_config(None, common + ["rollout.teacher=full"]), [tmp_path / "embedded"], ddir, tmp_path / "t_ref",
                  target=target, progress=False)
    got = distill(load_config(None, common + ["rollout.teacher=full", "training.feature_source=target"]), [tmp_path / "native"],
                  ddir, tmp_path / "t_native", target=target, progress=False)
    assert got.last_metrics["loss"] == pytest.approx(ref.last_metrics["loss"], rel=1e-4, abs=1e-6)
    assert got.last_metrics["L_rej"] == pytest.approx(ref.last_metrics["L_rej"], rel=1e-4, abs=1e-6)
