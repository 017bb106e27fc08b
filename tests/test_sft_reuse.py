"""Reuse instead of SFT: SpecForge checkpoints (read weights-only), HF exports, compatibility checks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from specforge_opd.models.drafter import DrafterError, load_any_drafter, load_specforge_checkpoint, save_drafter

from conftest import TINY_MASK, make_tiny_drafter, make_tiny_target


def _specforge_run(root: Path, drafter, step: int = 8) -> Path:
    """A SpecForge-shaped run dir: <run>-step<N>/training_state.pt + <run>-latest link."""
    d = root / f"sft-step{step}"
    d.mkdir(parents=True)
    cfg_file = root / "draft" / "config.json"
    cfg_file.parent.mkdir()
    cfg_file.write_text(drafter.config.to_json_string())
    data = cfg_file.read_bytes()
    provenance = (("draft_config", ("file-stat-v2", str(cfg_file), ("sha256", "", len(data), hashlib.sha256(data).hexdigest()))),)
    state = {
        "specforge_model_provenance": provenance,
        "draft_state_dict": {k: v.clone() for k, v in drafter.state_dict().items()},
        "global_step": step, "strategy": "dflash", "run_id": "sft",
        "dflash_draft_num_hidden_layers": drafter.config.num_hidden_layers,
        "dflash_target_layer_ids": tuple(drafter.config.dflash_config["target_layer_ids"]),
        "dflash_block_size": drafter.block_size, "dflash_mask_token_id": TINY_MASK,
    }
    torch.save(state, d / "training_state.pt")
    os.symlink(d.name, root / "sft-latest")
    return d


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k])


def test_load_specforge_checkpoint_every_path_form(tmp_path):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target, block_size=4, layers=2)
    step = _specforge_run(tmp_path, drafter)
    for p in (step, step / "training_state.pt", tmp_path / "sft-latest", tmp_path):
        got = load_any_drafter(p, target.config)
        _same(got, drafter)
        assert got.block_size == 4 and got.config.dflash_config["target_layer_ids"] == [1, 1]
        assert got.config.dflash_config["mask_token_id"] == TINY_MASK


def test_load_any_drafter_hf_export(tmp_path):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    save_drafter(drafter, tmp_path / "final")
    _same(load_any_drafter(tmp_path / "final", target.config, expected_mask_token_id=TINY_MASK), drafter)


@pytest.mark.parametrize(
    "other, expect",
    [
        (dict(hidden=32), "hidden size 64 != target 32"),
        (dict(vocab=101), "vocab_size 97 != target 101"),
        (dict(layers=2), "num_target_layers 4 != target's 2 layers"),
    ],
)
def test_incompatible_target_says_what_does_not_fit(tmp_path, other, expect):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    save_drafter(drafter, tmp_path / "final")
    _specforge_run(tmp_path / "run", drafter)
    other_target = make_tiny_target(**other)
    with pytest.raises(DrafterError, match=expect.replace("'", ".")):
        load_any_drafter(tmp_path / "final", other_target.config)
    with pytest.raises(DrafterError, match="does not fit the target"):
        load_any_drafter(tmp_path / "run", other_target.config)


def test_mask_token_mismatch(tmp_path):
    target = make_tiny_target()
    save_drafter(make_tiny_drafter(target), tmp_path / "final")
    with pytest.raises(DrafterError, match="mask_token_id 96 != configured draft.mask_token_id 5"):
        load_any_drafter(tmp_path / "final", target.config, expected_mask_token_id=5)


class _Payload:
    """Unpickling this would create a file: the loader must refuse it without running it."""

    marker = None

    def __reduce__(self):
        return (Path.touch, (Path(_Payload.marker),))


def test_unsafe_checkpoint_is_refused_not_unpickled(tmp_path):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    step = _specforge_run(tmp_path, drafter)
    state = torch.load(step / "training_state.pt", weights_only=True)
    _Payload.marker = str(tmp_path / "pwned")
    state["extra"] = _Payload()
    torch.save(state, step / "training_state.pt")
    with pytest.raises(DrafterError, match="cannot be read safely"):
        load_specforge_checkpoint(step, target.config)
    assert not (tmp_path / "pwned").exists()


def test_not_a_drafter(tmp_path):
    target = make_tiny_target()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterError, match="no SpecForge checkpoint"):
        load_any_drafter(tmp_path / "empty", target.config)
    with pytest.raises(DrafterError, match="does not exist"):
        load_any_drafter(tmp_path / "missing", target.config)


def test_checkpoint_without_its_draft_config_warns_that_vocab_is_unchecked(tmp_path):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    _specforge_run(tmp_path, drafter)
    (tmp_path / "draft" / "config.json").write_text("{}")  # changed since training: not trusted
    with pytest.warns(UserWarning, match="cannot be checked"):
        _same(load_any_drafter(tmp_path, target.config), drafter)
