"""The SFT stage on several nodes: torchrun's rendezvous settings reach SpecForge's run config, and
the nodes after the first join node 0's SpecForge launches instead of redoing its steps."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from specforge_opd.config import load_config
from specforge_opd.stages import sft, sft_train
from specforge_opd.stages.sft import SFTError
from specforge_opd.stages.sft_train import LAUNCH_FILE, Nodes, follow_node0, nodes_from_env, specforge_run_config


def test_nodes_from_env():
    assert nodes_from_env({}) == Nodes()
    assert nodes_from_env({"NNODES": "1", "NODE_RANK": "0"}) == Nodes()
    assert nodes_from_env({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}) == Nodes(2, 1, "10.0.0.1", 29500)
    assert nodes_from_env({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}).master_port == 1234
    with pytest.raises(SFTError, match="needs MASTER_ADDR"):
        nodes_from_env({"NNODES": "2", "NODE_RANK": "0"})
    with pytest.raises(SFTError, match="needs NODE_RANK"):
        nodes_from_env({"NNODES": "2", "MASTER_ADDR": "h"})
    with pytest.raises(SFTError, match=r"NODE_RANK='2': must be an integer 0..1"):
        nodes_from_env({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"})
    with pytest.raises(SFTError, match="NNODES='x'"):
        nodes_from_env({"NNODES": "x"})


def _run(tmp_path, nodes, gpus=8):
    cfg = load_config(None, ["training.batch_size=1", "training.accumulation_steps=1", "training.num_epochs=1"])
    return specforge_run_config(cfg, target_path="t", draft_config_file=tmp_path / "d.json", features=tmp_path / "f",
                                out_dir=tmp_path / "c", num_samples=1600, mask_token_id=5, gpus=gpus, nodes=nodes)


def test_run_config_spans_the_nodes(tmp_path):
    one = _run(tmp_path, None)
    two = _run(tmp_path, Nodes(2, 1, "10.0.0.1", 29511))
    assert one["deployment"] == {"trainer": {"nproc_per_node": 8}}
    assert two["deployment"]["trainer"] == {"nproc_per_node": 8, "nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29511}
    assert "node_rank" not in two["deployment"]["trainer"]  # each node's SpecForge reads NODE_RANK: one run.yaml for all
    sft_train.validate_specforge_run(two)  # SpecForge's own schema accepts it
    # 1600 samples over 8 ranks -> 200 steps; over 16 ranks -> 100 (the save interval follows)
    assert one["training"]["save_interval"] == 200 // 5 and two["training"]["save_interval"] == 100 // 5
    with pytest.raises(SFTError, match="multi-node SFT needs GPUs"):
        _run(tmp_path, Nodes(2, 0, "h", 29500), gpus=0)


def _fake_specforge(monkeypatch, log: Path):
    """SpecForge's command replaced by one that appends the run.yaml it was given to ``log``."""
    def cmd(run_yaml):
        code = f"open({str(log)!r}, 'a').write({str(run_yaml)!r} + '\\n')"
        return [sys.executable, "-c", code], {}

    monkeypatch.setattr(sft_train, "_specforge_train_cmd", cmd)


def test_follower_joins_each_launch_until_node0_ends(tmp_path, monkeypatch):
    log = tmp_path / "joined.txt"
    _fake_specforge(monkeypatch, log)
    sft_train._publish_launch(tmp_path, end=True)  # an earlier run's end: not this run's
    time.sleep(0.01)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("final", follow_node0(tmp_path, poll_s=0.02, idle_timeout_s=30)))
    th.start()
    for seg in ("a", "b"):
        time.sleep(0.15)
        sft_train._publish_launch(tmp_path, tmp_path / f"train-x/run-{seg}.yaml")
        for _ in range(200):
            if log.is_file() and log.read_text().count("\n") == ("a", "b").index(seg) + 1:
                break
            time.sleep(0.02)
    sft_train._publish_launch(tmp_path, end=True)
    th.join(10)
    assert not th.is_alive()
    assert result["final"] == tmp_path / "final"
    assert log.read_text().split() == [str(tmp_path / "train-x/run-a.yaml"), str(tmp_path / "train-x/run-b.yaml")]


def test_follower_stops_on_node0_error_and_on_silence(tmp_path, monkeypatch):
    _fake_specforge(monkeypatch, tmp_path / "joined.txt")
    errors = []

    def follow():
        try:
            follow_node0(tmp_path, poll_s=0.02, idle_timeout_s=30)
        except SFTError as e:
            errors.append(str(e))

    th = threading.Thread(target=follow)
    th.start()
    time.sleep(0.1)
    sft_train._publish_launch(tmp_path, end=True, error="SFTError: features failed")
    th.join(10)
    assert errors and "node 0 stopped with an error (SFTError: features failed)" in errors[0]
    (tmp_path / LAUNCH_FILE).unlink()
    with pytest.raises(SFTError, match="published no SpecForge launch"):
        follow_node0(tmp_path, poll_s=0.01, idle_timeout_s=0.05)


def test_follower_fails_when_its_specforge_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(sft_train, "_specforge_train_cmd", lambda run_yaml: ([sys.executable, "-c", "raise SystemExit(3)"], {}))
    sft_train._publish_launch(tmp_path, tmp_path / "run.yaml")  # published before this node started: still joined
    with pytest.raises(SFTError, match="status 3 on this node"):
        follow_node0(tmp_path, poll_s=0.01, idle_timeout_s=5)


def test_run_sft_refuses_what_several_nodes_cannot_do(tmp_path, monkeypatch):
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    cfg = load_config(None, [f"output.dir={tmp_path}", "target.device=cpu"])
    with pytest.raises(SFTError, match="multi-node SFT needs GPUs"):
        sft.run_sft(cfg)
    monkeypatch.setattr(sft, "on_gpu", lambda cfg: True)
    with pytest.raises(SFTError, match="sft.plateau_patience=0"):
        sft.run_sft(load_config(None, [f"output.dir={tmp_path}", "sft.plateau_patience=2"]))


def test_node0_tells_the_others_when_it_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setattr(sft, "on_gpu", lambda cfg: True)

    def boom(cfg, **kw):
        raise SFTError("sft responses: the training prompt pool is empty")

    monkeypatch.setattr(sft, "_run_sft", boom)
    with pytest.raises(SFTError, match="pool is empty"):
        sft.run_sft(load_config(None, [f"output.dir={tmp_path}"]))
    rec = json.loads((tmp_path / LAUNCH_FILE).read_text())
    assert rec["end"] and "pool is empty" in rec["error"]
