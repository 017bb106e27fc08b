"""What breaks or skews an SGLang run at the paper's scale, each refused or fixed by name (CPU only, milliseconds).

Feature JSON of verify prefills, flags that break the anchor recurrence or need
several GPUs, the stop set SGLang uses, seeds SGLang ignores, the KV pool and the
concurrency it allows, the start-up timeout, the memory fraction beside the
trainer, and the GPU check's comparison.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specforge_opd.config import SGLangConfig, load_config
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.sglang import launcher, rollout_backend, sizing
from specforge_opd.sglang.launcher import Endpoints, ServerError, server_args
from specforge_opd.sglang.native import native_rollout_async
from specforge_opd.sglang.verify_client import for_each_prompt, verify_rollout_async

REPO = Path(__file__).resolve().parents[1]
QWEN3_8B = SimpleNamespace(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)


# ---------------------------------------------------------------------------
# 1. verify-mode prefill features as JSON


def test_verify_prefill_too_large_for_json_is_refused_before_any_request():
    # Qwen3-8B, 5 captured layers, a 2048-token prompt: 42M floats; the URL is never contacted
    ep = Endpoints(["http://127.0.0.1:9"])
    cfg = SGLangConfig(max_retries=0, request_timeout_s=1.0)
    with pytest.raises(ValueError, match=r"s0: .*2048 x 20480 = 41\.9M feature floats.*sglang.verify_max_feature_floats=.*"
                                         r"rollout.backend sglang_native"):
        asyncio.run(verify_rollout_async(ep, None, [("s0", [1] * 2048)], sglang_cfg=cfg, max_new_tokens=8, stop_token_ids=[],
                                         teacher="token", teacher_topk=1, feature_dim=5 * 4096, layer_ids=[1, 9, 17, 25, 33]))


# ---------------------------------------------------------------------------
# 2 and 8. flags of sglang.extra_args that cannot work


@pytest.mark.parametrize("extra,mode", [
    (["--enable-mixed-chunk"], "native"),
    (["--enable-dp-attention"], "native"),
    (["--enable-dp-attention"], "verify"),
    (["--tp-size", "2"], "native"),
    (["--tp", "2"], "verify"),  # argparse takes the prefix
    (["--tensor-parallel-size=4"], "plain"),
    (["--dp-size", "2"], "native"),
    (["--attn-dp-size", "2"], "native"),
    (["--pp-size", "2"], "verify"),
    (["--host", "0.0.0.0"], "verify"),
    (["--port", "30000"], "native"),
])
def test_refused_extra_args_are_named(extra, mode):
    cfg = SGLangConfig(extra_args=extra)
    kw = dict(target_layer_ids=[0, 1]) if mode == "verify" else dict(draft_path="/d", block_size=4) if mode == "native" else {}
    with pytest.raises(ValueError, match=rf"sglang.extra_args: {extra[0].split('=')[0]}.* refused in {mode} mode: .*; "
                                         "remove it from sglang.extra_args") as e:
        server_args(cfg, model_path="/m", port=1, mode=mode, **kw)
    assert "\n" not in str(e.value)


def test_harmless_extra_args_pass():
    for extra, mode, kw in ((["--enable-mixed-chunk"], "verify", dict(target_layer_ids=[0, 1])),
                            (["--tp-size", "1", "--chunked-prefill-size", "8192"], "native", dict(draft_path="/d", block_size=4)),
                            (["--max-running-requests", "64"], "native", dict(draft_path="/d", block_size=4))):
        args = server_args(SGLangConfig(extra_args=extra), model_path="/m", port=1, mode=mode, **kw)
        assert args[-len(extra):] == extra


def test_a_running_native_server_with_mixed_chunks_is_refused():
    launcher.check_server_flags({"enable_mixed_chunk": False, "attn_dp_size": 1}, "native", "http://u")
    launcher.check_server_flags({"enable_mixed_chunk": True}, "verify", "http://u")
    with pytest.raises(ServerError, match=r"http://u runs with --enable-mixed-chunk.*anchor recurrence"):
        launcher.check_server_flags({"enable_mixed_chunk": True}, "native", "http://u")
    with pytest.raises(ServerError, match="DP attention"):
        launcher.check_server_flags({"attn_dp_size": 2, "enable_dp_attention": True}, "native", "http://u")


def test_connecting_to_a_mixed_chunk_server_for_native_rollouts_is_refused(monkeypatch):
    monkeypatch.setattr(launcher, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "server_info", lambda url: {"version": "0.5.23", "enable_mixed_chunk": True})
    assert Endpoints.connect(["http://u"], mode="verify").urls == ["http://u"]
    with pytest.raises(ServerError, match="--enable-mixed-chunk"):
        Endpoints.connect(["http://u"], mode="native")


# ---------------------------------------------------------------------------
# 3. the stop set


def test_stop_set_includes_the_generation_config_eos():
    from specforge_opd.models.target import stop_token_ids

    tok = SimpleNamespace(eos_token_id=151645, unk_token_id=None, convert_tokens_to_ids=lambda t: 151645)
    config = SimpleNamespace(eos_token_id=151645)
    gen = SimpleNamespace(eos_token_id=[151645, 151643])  # Qwen3's generation_config.json
    assert stop_token_ids(tok, config, [], gen) == [151643, 151645]
    assert stop_token_ids(tok, config, [7], SimpleNamespace(eos_token_id=5)) == [5, 7, 151645]


def test_load_target_reads_generation_config_json(tmp_path):
    from conftest import make_tiny_target
    from specforge_opd.config import TargetConfig
    from specforge_opd.models.target import load_target

    target = make_tiny_target()
    target.config.eos_token_id = 2
    target.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 9]}')
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(target.config.vocab_size)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t2", unk_token="t0")
    fast.save_pretrained(tmp_path)
    bundle = load_target(TargetConfig(path=str(tmp_path), device="cpu", dtype="float32"))
    assert 9 in bundle.stop_token_ids and 2 in bundle.stop_token_ids


# ---------------------------------------------------------------------------
# 4. seeds


def test_native_sampling_says_it_is_not_reproducible(caplog):
    ep = Endpoints(["http://127.0.0.1:9"])
    with caplog.at_level(logging.WARNING, logger="specforge_opd.sglang.native"):
        asyncio.run(native_rollout_async(ep, [], sglang_cfg=SGLangConfig(), block_size=4, max_new_tokens=8,
                                         stop_token_ids=[], teacher="token", temperature=0.7))
    assert "rollout.temperature=0.7 through SGLang native mode is not reproducible" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specforge_opd.sglang.native"):
        asyncio.run(native_rollout_async(ep, [], sglang_cfg=SGLangConfig(), block_size=4, max_new_tokens=8,
                                         stop_token_ids=[], teacher="token", temperature=0.0))
    assert "not reproducible" not in caplog.text


# ---------------------------------------------------------------------------
# 5. the KV pool and the concurrency it allows


def test_pool_is_sized_by_sglang_by_default_and_the_concurrency_is_said():
    from specforge_opd.sglang.sizing import estimate_pool_tokens, kv_bytes_per_token, plan_line, request_concurrency

    assert SGLangConfig().max_total_tokens is None
    assert "--max-total-tokens" not in server_args(SGLangConfig(), model_path="/m", port=1, mode="native", draft_path="/d", block_size=16)
    # the laptop pool at the paper's size: 10 requests of 2048 + 4096 tokens, of DFLASH's 48 slots
    assert request_concurrency(65536, 2048 + 4096 + 32, 48, 64) == 10
    assert kv_bytes_per_token(QWEN3_8B) == 2 * 36 * 8 * 128 * 2
    pool = estimate_pool_tokens(free_gib=120.0, weights_gib=16.4, reserve_gib=12.0, tconf=QWEN3_8B)
    assert request_concurrency(pool, 6176, 48, 64) == 48
    cfg = load_config(None, ["sglang.max_total_tokens=65536", "rollout.max_new_tokens=4096", "draft.block_size=16"])
    line = plan_line(cfg, QWEN3_8B, 2048, free_gib=120.0, weights_gib=16.4)
    assert "KV pool 65536 tokens (sglang.max_total_tokens)" in line and ": 10 rollouts at once per server" in line


def test_for_each_prompt_logs_the_concurrency(caplog):
    ep = Endpoints(["http://127.0.0.1:9"], pool_tokens=[65536], running_slots=[48])

    async def fn(client, i, sid, ids):
        return sid

    with caplog.at_level(logging.INFO, logger="specforge_opd.sglang.verify_client"):
        out = asyncio.run(for_each_prompt(ep, SGLangConfig(), [("a", [1] * 2048)], fn, token_cost=lambda ids: len(ids) + 4128))
    assert out == ["a"] and "KV pool 65536 tokens, running slots 48, longest request 6176 tokens: 10 requests at once" in caplog.text


# ---------------------------------------------------------------------------
# 6. start-up timeout


def test_startup_timeout_scales_with_the_weights_and_names_the_setting(tmp_path):
    big = tmp_path / "target"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:  # sparse: 57 GiB of "weights" on no disk
        f.truncate(57 * 2**30)
    assert sizing.startup_timeout_for(SGLangConfig(), str(big)) == pytest.approx(600 + 20 * 57)
    assert sizing.startup_timeout_for(SGLangConfig(startup_timeout_s=99.0), str(big)) == 99.0
    assert sizing.startup_timeout_for(SGLangConfig()) == 600.0
    with pytest.raises(ServerError, match=r"not healthy after 0 s: .*raise sglang.startup_timeout_s"):
        launcher.wait_healthy("http://127.0.0.1:9", 0.2)


# ---------------------------------------------------------------------------
# 7. memory beside the trainer


def test_mem_fraction_is_set_from_what_the_trainer_leaves(monkeypatch):
    assert sizing.mem_fraction_for(40 * 2**30, 12.0) == pytest.approx(0.7)
    assert sizing.mem_fraction_for(140 * 2**30, 1.0) == 0.95
    with pytest.raises(ValueError, match=r"sglang.gpu_reserve_gb=12.0: only 14.0 GiB of the GPU are free"):
        sizing.mem_fraction_for(14 * 2**30, 12.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * 2**30, 141 * 2**30))
    scfg = rollout_backend.launch_config(SGLangConfig(), "native")
    args = server_args(scfg, model_path="/m", port=1, mode="native", draft_path="/d", block_size=16)
    assert args[args.index("--mem-fraction-static") + 1] == "0.8"
    # a fraction set by hand wins
    assert rollout_backend.launch_config(SGLangConfig(mem_fraction_static=0.5), "native").mem_fraction_static == 0.5


# ---------------------------------------------------------------------------
# 9. the GPU check compares with the same stop set, and whole records


def _rec(n_out: int, finished: bool, anchors: list[int], accepted: list[int]) -> RolloutRecord:
    P = 4
    M = len(anchors)
    return RolloutRecord(sample_id="s", input_ids=torch.arange(P + n_out), prompt_len=P,
                         anchors=torch.tensor(anchors), drafts=torch.zeros(M, 3, dtype=torch.long),
                         accepted=torch.tensor(accepted), finished=finished)


def test_parity_sees_a_shorter_sglang_output():
    from specforge_opd.sglang.parity import record_parity

    ref = _rec(9, False, [4, 7, 10], [2, 2, 2])
    assert record_parity(ref, ref) == []
    served = _rec(6, True, [4, 7], [2, 2])  # stopped at an eos the reference did not stop at: common blocks equal
    diffs = record_parity(served, ref)
    assert any("completion tokens 6 != reference 9" in d for d in diffs) and any("finished True" in d for d in diffs)
    script = (REPO / "scripts" / "gpu_check_sglang_native.sh").read_text()
    assert "stop_token_ids=[]" not in script and "record_parity(rec, ref)" in script and "stop_token_ids=stops" in script
