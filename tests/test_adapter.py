"""SpecForge adapter smoke test: a DFlashDraftModel built from a config runs a forward on a tiny target."""

import torch

from specforge_opd.models.adapter import DFlashDraftModel, extract_context_feature
from specforge_opd.models.drafter import drafter_layer_ids, load_drafter, save_drafter


def test_dflash_forward_on_tiny_target(tiny_target, tiny_drafter):
    assert isinstance(tiny_drafter, DFlashDraftModel)
    ids = torch.randint(0, 90, (1, 10))
    with torch.no_grad():
        out = tiny_target(ids, output_hidden_states=True)
        ctx = extract_context_feature(out.hidden_states, drafter_layer_ids(tiny_drafter))
        assert ctx.shape == (1, 10, 64 * len(drafter_layer_ids(tiny_drafter)))
        bs = tiny_drafter.block_size
        block = torch.full((1, bs), 96)
        block[0, 0] = ids[0, -1]
        noise = tiny_target.model.embed_tokens(block)
        pos = torch.arange(10 + bs).unsqueeze(0)
        h = tiny_drafter(position_ids=pos, noise_embedding=noise, target_hidden=ctx[:, :10], attention_mask=None, is_causal=False)
    assert h.shape == (1, bs, 64)
    assert torch.isfinite(h).all()


def test_export_roundtrip(tmp_path, tiny_target, tiny_drafter):
    out = save_drafter(tiny_drafter, tmp_path / "d", metadata={"step": 3})
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert "auto_map" not in cfg and cfg["tie_word_embeddings"] is False
    assert cfg["dflash_config"]["mask_token_id"] == 96
    back = load_drafter(out, target_config=tiny_target.config)
    for (k, a), (k2, b) in zip(tiny_drafter.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
