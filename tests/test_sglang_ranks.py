"""Multi-GPU placement of the SGLang path: each torchrun rank on its own GPU, and so is the server it launches.

No GPU here: CUDA is stood in by recording what would be set (``torch.cuda.set_device``,
the launched server's environment).
"""

from __future__ import annotations

import pytest
import torch

from specforge_opd.config import load_config
from specforge_opd.sglang.launcher import rank_gpu_env


class _Sentinel(Exception):
    pass


def test_opd_pins_the_rank_gpu_before_loading_the_target(tmp_path, monkeypatch):
    """torch.cuda.set_device(LOCAL_RANK) comes before anything touches CUDA (the target load, NCCL's init and
    barrier), and the target is loaded on cuda:LOCAL_RANK, not on the bare "cuda" that means GPU 0."""
    from specforge_opd.stages import opd

    events = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", d)))

    def load_target(tcfg):
        events.append(("load_target", tcfg.device))
        raise _Sentinel

    monkeypatch.setattr("specforge_opd.models.target.load_target", load_target)
    cfg = load_config(None, [f"output.dir={tmp_path}"])
    with pytest.raises(_Sentinel):
        opd.run_opd(cfg)
    assert events == [("set_device", 1), ("load_target", "cuda:1")]
    # an explicit device is kept, but the rank's GPU is still the current one (NCCL's barrier runs on it)
    events.clear()
    assert opd.bind_rank_device(load_config(None, ["target.device=cpu"])).target.device == "cpu"
    assert opd.bind_rank_device(load_config(None, ["target.device=cuda:0"])).target.device == "cuda:0"
    assert events == [("set_device", 1), ("set_device", 1)]
    # a CPU machine, or no torchrun, leave everything alone
    monkeypatch.delenv("LOCAL_RANK")
    assert opd.bind_rank_device(cfg).target.device == cfg.target.device


def test_rank_gpu_env():
    assert rank_gpu_env({}) == {}
    assert rank_gpu_env({"LOCAL_RANK": "1"}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert rank_gpu_env({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4, 5"}) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ValueError, match="LOCAL_RANK=3.*2 devices"):
        rank_gpu_env({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5"})


def test_each_rank_launches_its_server_on_its_gpu(tmp_path, monkeypatch):
    from specforge_opd.sglang import rollout_backend

    seen = {}

    class FakeServer:
        def __init__(self, cfg, args_fn, *, log_path, env=None, require_plugin=False, startup_timeout_s=None):
            seen.update(env=env, require_plugin=require_plugin, args=args_fn(1234), startup_timeout_s=startup_timeout_s)
            self.url, self.version, self.pool_tokens = "http://127.0.0.1:1234", "0.5.23", 1000

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(rollout_backend, "SGLangServer", FakeServer)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,6,7")
    cfg = load_config(None, ["sglang.mem_fraction_static=0.6", "sglang.max_total_tokens=null"])
    with rollout_backend.endpoints_for(cfg, mode="native", model_path="/m", layer_ids=[1, 2], block_size=4, draft_path="/d",
                                       log_dir=tmp_path, num_target_layers=8) as ep:
        assert ep.pool_tokens == [1000]
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "6" and seen["require_plugin"]
    assert seen["env"]["SGLANG_FORCE_STREAM_INTERVAL"]
    a = seen["args"]
    assert a[a.index("--mem-fraction-static") + 1] == "0.6" and "--max-total-tokens" not in a
    assert seen["startup_timeout_s"] == 600.0  # no weights at /m: the floor (sglang.startup_timeout_s None scales it)


def test_target_off_gpu_is_a_no_op_on_a_cpu():
    from specforge_opd.sglang.rollout_backend import target_off_gpu

    m = torch.nn.Linear(2, 2)
    with target_off_gpu(m, keep=[m]):
        assert next(m.parameters()).device.type == "cpu"
