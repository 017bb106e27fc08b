"""Target loading: embedded default, identity, stop ids, bad paths."""

from __future__ import annotations

import pytest
import torch

from specforge_opd.config import TargetConfig
from specforge_opd.models.target import TargetError, load_target, resolve_device, target_identity


def _save_tiny(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import make_tiny_target

    model = make_tiny_target()
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(95)}
    vocab["<|im_end|>"] = 95
    vocab["<unk>"] = 96
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w1", unk_token="<unk>")
    tok.save_pretrained(path)
    return model


def test_load_local_target(tmp_path):
    _save_tiny(tmp_path / "t")
    b = load_target(TargetConfig(path=str(tmp_path / "t"), device="cpu", stop_token_ids=[7]))
    assert not b.model.training and b.model.dtype == torch.float32 and b.model.device.type == "cpu"
    assert b.model.config._attn_implementation == "sdpa"
    assert b.stop_token_ids == [1, 7, 95]  # eos, extra, <|im_end|>
    assert b.identity == target_identity(tmp_path / "t") and len(b.identity) == 12
    assert not any(p.requires_grad for p in b.model.parameters())
    b16 = load_target(TargetConfig(path=str(tmp_path / "t"), device="cpu", dtype="bfloat16"))
    assert b16.model.dtype == torch.bfloat16


def test_identity_changes_with_config(tmp_path):
    _save_tiny(tmp_path / "t")
    before = target_identity(tmp_path / "t")
    cfg = tmp_path / "t" / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_hidden_layers": 4', '"num_hidden_layers": 3'))
    assert target_identity(tmp_path / "t") != before


def test_bad_paths(tmp_path):
    with pytest.raises(TargetError, match="target.path: .* does not exist"):
        load_target(TargetConfig(path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="no config.json"):
        load_target(TargetConfig(path=str(tmp_path / "empty")))
    _save_tiny(tmp_path / "t")
    with pytest.raises(TargetError, match=r"stop_token_ids \[500\]"):
        load_target(TargetConfig(path=str(tmp_path / "t"), device="cpu", stop_token_ids=[500]))


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.embedded
def test_embedded_default(embedded_target_dir):
    from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID

    b = load_target(TargetConfig(device="cpu"))
    assert b.path == embedded_target_dir
    assert b.stop_token_ids == [2]  # <|im_end|> is SmolLM2-Instruct's eos
    assert b.model.config.num_hidden_layers == 30 and b.model.config.vocab_size == 49152
    assert 0 <= EMBEDDED_MASK_TOKEN_ID < b.model.config.vocab_size


def test_hub_id_targets_load_through_a_snapshot_and_fail_offline_by_name(tmp_path, monkeypatch):
    """target.path: Qwen/Qwen3-8B is a hub id: fetched with huggingface_hub (cache first), not refused as a
    missing directory; offline and uncached it names target.path and the fix."""
    import huggingface_hub

    from specforge_opd.config import load_config
    from specforge_opd.models import target
    from specforge_opd.models.target import looks_like_hub_id, resolve_target_path

    snap = tmp_path / "snap"
    _save_tiny(snap)
    calls = []

    def fake_download(repo_id, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert looks_like_hub_id("Qwen/Qwen3-8B") and not looks_like_hub_id(str(tmp_path)) and not looks_like_hub_id("./a/b")
    b = load_target(TargetConfig(path="Qwen/Qwen3-8B", device="cpu"))
    assert b.path == snap and calls == [("Qwen/Qwen3-8B", True), ("Qwen/Qwen3-8B", False)]
    # SpecForge gets the snapshot directory, not the hub id
    assert target.target_dir(load_config(None, ["target.path=Qwen/Qwen3-8B"])) == str(snap)

    def offline(repo_id, allow_patterns=None, local_files_only=False):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(TargetError, match=r"target.path: hub id 'Qwen/Qwen3-8B' could not be fetched.*HF_TOKEN"):
        resolve_target_path("Qwen/Qwen3-8B")
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target_path(str(tmp_path / "nope" / "deeper"))
