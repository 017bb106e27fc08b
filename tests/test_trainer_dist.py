"""Gradient equality: 2 FSDP2 ranks (torchrun, gloo) vs 1 process on the same global batch, with and without accumulation."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("dist_trainer_worker.py")


def _run(args, tmp_path, timeout=240, **extra_env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra_env)
    # A new session, so that a hang is cleaned up with the workers torchrun started.
    p = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    assert p.returncode == 0, out[-4000:]


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    # global batch 4 in every configuration: 1 proc x 4 seqs; 1 proc x 1 seq x 4 accumulation;
    # 2 ranks x 2 seqs; 2 ranks x 1 seq x 2 accumulation. 5 records: step 2 holds one sequence.
    _run([sys.executable, str(WORKER), str(tmp_path), "4", "1", "1", "4"], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
          str(WORKER), str(tmp_path), "2", "1", "1", "2"], tmp_path)
    ref = load_file(str(tmp_path / "grads-1-4x1.safetensors"))
    assert any(k.startswith("step2.") for k in ref) and all(torch.isfinite(v).all() for v in ref.values())
    assert max(float(v.abs().max()) for v in ref.values()) > 1e-4
    for name in ("grads-1-1x4", "grads-2-2x1", "grads-2-1x2"):
        got = load_file(str(tmp_path / f"{name}.safetensors"))
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4, msg=f"{name}: {k}")


@pytest.mark.slow
def test_two_ranks_replaying_in_groups_equal_one_process(tmp_path):
    """training.max_blocks_per_forward=1: every block its own forward and backward; the ranks' records
    have different block counts, so the ranks pad to the same number of groups (a mismatch hangs FSDP2)."""
    _run([sys.executable, str(WORKER), str(tmp_path), "4", "1"], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
          str(WORKER), str(tmp_path), "2", "1", "1", "2"], tmp_path, MAX_BLOCKS="1")
    ref = load_file(str(tmp_path / "grads-1-4x1.safetensors"))
    for name in ("grads-2-2x1-g1", "grads-2-1x2-g1"):
        got = load_file(str(tmp_path / f"{name}.safetensors"))
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4, msg=f"{name}: {k}")
