"""SFT stage: responses -> features -> SpecForge train -> export, with skip/resume and bad input."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from conftest import TINY_MASK
from sft_helpers import STOP, make_prompts, make_target_dir, tiny_cfg

from specforge_opd import sft


@pytest.fixture
def chat_render(monkeypatch):
    """Use engineer A's chat.render_prompt when it exists; else render with the tokenizer's template."""
    try:
        from specforge_opd.chat import render_prompt  # noqa: F401
    except ImportError:
        def render(tokenizer, record, cfg):
            msgs = record.messages or [{"role": "user", "content": record.prompt}]
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        monkeypatch.setattr(sft, "render_training_prompt", render)


def test_sft_end_to_end_tiny(tmp_path, chat_render, capfd):
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run")
    prompts = make_prompts(8)
    final = sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)

    # responses: one record per prompt, prompt ids = the rendered prompt
    r_dir = next((tmp_path / "run").glob("responses-*"))
    recs = sft.read_responses(r_dir)
    assert [r.id for r in recs] == [p.id for p in prompts]
    assert all(0 < len(r.response_ids) <= 8 for r in recs)

    # features: SpecForge offline layout, loss mask exactly on the response, layer k = hidden_states[k+1]
    f_dir = next((tmp_path / "run").glob("features-*"))
    files = sorted(f_dir.glob("rows_*/data_*.ckpt"))
    assert len(files) == 8
    s = torch.load(files[0], weights_only=True)
    r0 = recs[0]
    assert s["input_ids"].tolist() == r0.prompt_ids + r0.response_ids
    assert s["loss_mask"].tolist() == [0] * len(r0.prompt_ids) + [1] * len(r0.response_ids)
    layer_ids = json.loads((f_dir / "manifest.json").read_text())["target_layer_ids"]
    assert layer_ids == [2]  # build_target_layer_ids(4, 1) = [4 // 2]
    with torch.no_grad():
        hs = bundle.model(s["input_ids"][None], output_hidden_states=True).hidden_states
    assert s["hidden_states"].shape == (1, len(s["input_ids"]), 64)
    torch.testing.assert_close(s["hidden_states"], hs[3])

    # train: SpecForge ran every step (8 samples, batch 1, 1 epoch)
    t_marker = json.loads(next((tmp_path / "run").glob("train-*/DONE.json")).read_text())
    assert t_marker["stats"]["step"] == 8

    # export: SGLang layout, reloads, and the check ran
    c = json.loads((final / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and "auto_map" not in c
    assert c["block_size"] == 4 and c["tie_word_embeddings"] is False
    assert c["dflash_config"] == {"mask_token_id": TINY_MASK, "target_layer_ids": [2]}
    from specforge_opd.drafter import load_drafter, read_drafter_metadata

    d = load_drafter(final, target_config=bundle.model.config)
    ck = sft.load_specforge_checkpoint(t_marker["stats"]["checkpoint"], bundle.model.config)
    for k, v in ck.state_dict().items():
        torch.testing.assert_close(d.state_dict()[k], v)
    meta = read_drafter_metadata(final)
    assert meta["verify"]["prompts"] == 2 and meta["verify"]["tau"] >= 1.0

    # a rerun skips every step and leaves the export as it was
    before = (final / "model.safetensors").stat().st_mtime_ns
    capfd.readouterr()
    sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    report = json.loads((tmp_path / "run" / "sft_report.json").read_text())
    assert report["skipped"] == list(sft.STEPS)
    assert (final / "model.safetensors").stat().st_mtime_ns == before
