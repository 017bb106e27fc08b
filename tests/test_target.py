"""Target loading: embedded default, identity, stop ids, bad paths."""

from __future__ import annotations

import pytest
import torch

from specforge_opd.config import TargetConfig
from specforge_opd.target import TargetError, load_target, resolve_device, target_identity


def _save_tiny(path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

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
    from specforge_opd.assets import EMBEDDED_MASK_TOKEN_ID

    b = load_target(TargetConfig(device="cpu"))
    assert b.path == embedded_target_dir
    assert b.stop_token_ids == [2]  # <|im_end|> is SmolLM2-Instruct's eos
    assert b.model.config.num_hidden_layers == 30 and b.model.config.vocab_size == 49152
    assert 0 <= EMBEDDED_MASK_TOKEN_ID < b.model.config.vocab_size
