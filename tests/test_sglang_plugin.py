"""The native plugin inside SGLang, on stand-ins for the objects SGLang 0.5.23 hands it.

What the hook reads is checked against the real wheel's source by
tests/test_sglang_contract.py; here it runs on duck-typed objects with the same
attributes: the worker (``DFlashWorkerV2``), the batch (``ScheduleBatch``), the
result (``GenerationBatchResult`` with its ``LogitsProcessorOutput``).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from specforge_opd.sglang import native
from specforge_opd.sglang.contract import NATIVE_STEP_FIELDS
from specforge_opd.sglang.launcher import NO_EARLY_FLUSH, ServerError, check_plugin_log, mode_env

BS = 4
V = 11


class _Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_extend(self):
        return self.kind == "extend"

    def is_idle(self):
        return self.kind == "idle"


def _worker(block):
    buf = torch.zeros(8, BS, dtype=torch.long)  # over-allocated, as _ensure_draft_block_buffers does
    buf[: block.shape[0]] = block
    return SimpleNamespace(block_size=BS, _draft_block_tokens_buf=buf,
                           model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=V)))


def _batch(seq_lens, kind="decode", stale_cpu=None, sampling_info=None, has_grammar=False):
    return SimpleNamespace(forward_mode=_Mode(kind), is_extend_in_batch=False, seq_lens=torch.tensor(seq_lens),
                           seq_lens_cpu=None if stale_cpu is None else torch.tensor(stale_cpu),
                           sampling_info=sampling_info, has_grammar=has_grammar)


def _original(accept_lens, logits, advance_seq_lens=True):
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if advance_seq_lens:
            # what the caller sees afterwards may already be the next committed length
            batch.seq_lens += torch.tensor(accept_lens)
        lo = SimpleNamespace(next_token_logits=logits, customized_info=None, hidden_states=None)
        return SimpleNamespace(logits_output=lo, accept_lens=torch.tensor(accept_lens, dtype=torch.int32))

    return forward_batch_generation


def test_hook_records_each_verify_step_from_the_worker_state():
    """Anchors come from the device seq_lens before the call (the CPU copy lags a step under overlap scheduling),
    the accepted count from SGLang's accept_lens (accepted + 1), the drafts from the block buffer's slots 1..bs-1,
    the teacher from the verify logits at temperature 1."""
    torch.manual_seed(0)
    block = torch.tensor([[5, 1, 2, 3], [7, 4, 4, 9]])
    logits = torch.randn(2 * BS, V)
    worker = _worker(block)
    batch = _batch([10, 20], stale_cpu=[7, 18])
    result = native._around_forward_batch_generation(_original([3, 1], logits), worker, batch)
    info = result.logits_output.customized_info
    assert sorted(info) == sorted(NATIVE_STEP_FIELDS)
    assert info["opd_anchor"] == [10, 20]
    assert info["opd_accepted"] == [2, 0]
    assert info["opd_draft"] == [[1, 2, 3], [4, 4, 9]]
    lp = torch.log_softmax(logits.view(2, BS, V)[:, :-1], -1)
    want = lp.gather(2, block[:, 1:, None])[:, :, 0]
    assert torch.allclose(torch.tensor(info["opd_draft_logprob"]), want, atol=1e-5)


def test_hook_passes_prefill_and_idle_batches_through_and_keeps_other_keys():
    block = torch.tensor([[5, 1, 2, 3]])
    for kind in ("extend", "idle"):
        r = native._around_forward_batch_generation(_original([1], torch.zeros(BS, V)), _worker(block), _batch([3], kind=kind))
        assert r.logits_output.customized_info is None
    mixed = _batch([3])
    mixed.is_extend_in_batch = True
    r = native._around_forward_batch_generation(_original([1], torch.zeros(BS, V)), _worker(block), mixed)
    assert r.logits_output.customized_info is None

    def with_other_key(self, batch, **kw):
        res = _original([2], torch.zeros(BS, V))(self, batch, **kw)
        res.logits_output.customized_info = {"other": ["x"]}
        return res

    r = native._around_forward_batch_generation(with_other_key, _worker(block), batch=_batch([3]))
    assert r.logits_output.customized_info["other"] == ["x"] and r.logits_output.customized_info["opd_accepted"] == [1]


def test_hook_reports_no_teacher_when_logits_are_missing_adjusted_or_sharded():
    block = torch.tensor([[5, 1, 2, 3]])
    # greedy TP batches without return_logprob: DFLASH may set the logits to None
    r = native._around_forward_batch_generation(_original([2], None), _worker(block), _batch([3]))
    assert r.logits_output.customized_info["opd_draft_logprob"] == [None]
    assert r.logits_output.customized_info["opd_accepted"] == [1]
    # logits edited in place by penalties / logit_bias / grammar of a batched request
    adjusted = [
        SimpleNamespace(logit_bias=torch.zeros(1, V)),
        SimpleNamespace(acc_linear_penalties=torch.zeros(1, V)),
        SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=True)),
        SimpleNamespace(has_custom_logit_processor=True),
    ]
    for si in adjusted:
        assert native.logits_adjusted(SimpleNamespace(sampling_info=si, has_grammar=False))
        r = native._around_forward_batch_generation(_original([2], torch.zeros(BS, V)), _worker(block), _batch([3], sampling_info=si))
        assert r.logits_output.customized_info["opd_draft_logprob"] == [None]
    assert native.logits_adjusted(SimpleNamespace(sampling_info=None, has_grammar=True))
    assert not native.logits_adjusted(SimpleNamespace(sampling_info=SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False)),
                                                      has_grammar=False))
    # a vocabulary shard (TP > 1, not gathered)
    r = native._around_forward_batch_generation(_original([2], torch.zeros(BS, V - 5)), _worker(block), _batch([3]))
    assert r.logits_output.customized_info["opd_draft_logprob"] == [None]


def test_hook_never_stops_the_server(caplog, monkeypatch):
    """A failure inside the hook leaves the step unrecorded and SGLang's result untouched, and is logged once per
    process with the line the client's error message points at."""
    import logging

    monkeypatch.setattr(native, "_hook_failed_once", False)
    bad = SimpleNamespace(block_size=BS, model_runner=None)  # no draft block buffer
    with caplog.at_level(logging.ERROR, logger=native.log.name):
        for _ in range(3):
            r = native._around_forward_batch_generation(_original([2], torch.zeros(BS, V)), bad, _batch([3]))
            assert r.logits_output.customized_info is None and r.accept_lens.tolist() == [2]
    failed = [rec for rec in caplog.records if "recording a DFLASH verify step failed" in rec.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None


def test_register_hooks_the_0_5_23_targets(monkeypatch):
    """register() hooks DFlashWorkerV2.forward_batch_generation (the only DFLASH verify path of 0.5.23) and
    SchedulerOutputStreamer.is_request_level_customized_info_key, both AROUND."""
    calls = []
    hr = types.ModuleType("sglang.srt.plugins.hook_registry")
    hr.HookType = SimpleNamespace(AROUND="around", BEFORE="before", AFTER="after", REPLACE="replace")
    hr.HookRegistry = SimpleNamespace(register=lambda target, fn, kind: calls.append((target, fn, kind)))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", hr)
    native.register()
    got = {t: (fn, k) for t, fn, k in calls}
    assert set(got) == set(native.HOOK_TARGETS.values())
    assert native.HOOK_TARGETS["verify_step"] == "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation"
    assert all(k == "around" for _, k in got.values())
    fn, _ = got[native.HOOK_TARGETS["request_level"]]
    assert all(fn(lambda self, key: False, None, k) for k in NATIVE_STEP_FIELDS)
    assert fn(lambda self, key: key == "theirs", None, "theirs") and not fn(lambda self, key: False, None, "theirs")


def test_launcher_sees_a_plugin_that_failed_to_hook(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("old run: Failed to apply hooks to sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.x\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("INFO Applied 1 hook(s) to ...\n")
    check_plugin_log(log, start)  # the failure belongs to an earlier launch
    with open(log, "a") as f:
        f.write("ERROR Failed to apply hooks to sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation\n")
    with pytest.raises(ServerError, match="native plugin is not active"):
        check_plugin_log(log, start)


def test_native_server_env_keeps_the_flush_out_of_reach(monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    assert mode_env("native") == {"SGLANG_FORCE_STREAM_INTERVAL": NO_EARLY_FLUSH}
    assert int(NO_EARLY_FLUSH) > 10**8 and mode_env("verify") == {}
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert mode_env("native")["SGLANG_PLUGINS"] == "someone_else,specforge_opd_native"


def test_the_plugin_imports_only_what_sglang_already_has():
    """SGLang loads the plugin in its own environment (transformers 5.19, torch 2.14 there): importing it must
    need nothing beyond torch, pydantic and yaml, so a --no-deps install of this package cannot break SGLang."""
    import subprocess

    code = ("import sys; import specforge_opd.sglang.native as n; n.register; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    for heavy in ("transformers", "specforge", "aiohttp", "safetensors"):
        assert heavy not in out, f"importing the plugin loads {heavy}"


def test_native_launch_refuses_an_sglang_python_without_the_plugin(tmp_path):
    """SGLang says nothing when no general plugin is installed: a native launch checks the entry point in
    sglang.python's environment first and names the install command."""
    from specforge_opd.config import SGLangConfig
    from specforge_opd.sglang.launcher import PLUGIN_GROUP, PLUGIN_NAME, SGLangServer

    def server(python):
        cfg = SGLangConfig(python=python, launch_module="json.tool")  # importable anywhere: check_python passes
        return SGLangServer(cfg, lambda port: [], log_path=tmp_path / "s.log", require_plugin=True)

    server(sys.executable).check_plugin_installed()  # this environment has it (setup.py's entry point)
    with pytest.raises(ServerError, match=r"no 'specforge_opd_native' entry point.*pip install --no-deps -e"):
        server(f"{sys.executable} -S").check_plugin_installed()  # no site-packages: no entry points
    with pytest.raises(ServerError, match="no 'specforge_opd_native' entry point"):
        server(f"{sys.executable} -S").start()
    assert not (tmp_path / "s.log").exists()  # refused before launching anything
    import pathlib

    setup_py = (pathlib.Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'"{PLUGIN_GROUP}": ["{PLUGIN_NAME} = specforge_opd.sglang.native:register"]' in setup_py


def test_native_launch_refuses_layer_ids_sglang_would_reorder():
    """Native SGLang reads the drafter's target_layer_ids and captures inside its layer loop (each layer once,
    ascending): a drafter with unsorted ids would silently get permuted features, one with repeats a shape error."""
    from specforge_opd.config import SGLangConfig
    from specforge_opd.sglang.launcher import server_args

    cfg = SGLangConfig()
    ok = server_args(cfg, model_path="/m", port=1, mode="native", draft_path="/d", block_size=4, target_layer_ids=[1, 9],
                     num_target_layers=12)
    assert ok[ok.index("--speculative-algorithm") + 1] == "DFLASH"
    for ids in ([9, 1], [1, 1]):
        with pytest.raises(ValueError, match=r"draft target_layer_ids \[.*ascending order"):
            server_args(cfg, model_path="/m", port=1, mode="native", draft_path="/d", block_size=4, target_layer_ids=ids)
    with pytest.raises(ValueError, match="last"):
        server_args(cfg, model_path="/m", port=1, mode="native", draft_path="/d", block_size=4, target_layer_ids=[1, 11],
                    num_target_layers=12)

