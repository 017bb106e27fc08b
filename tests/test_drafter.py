"""Drafter export dtype and the published DFlash config layouts (``specforge_opd.models.drafter``)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_opd.models.drafter import DrafterError, load_draft_config, load_drafter, save_drafter

FIXTURES = Path(__file__).parent / "fixtures" / "dflash_configs"


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _rewrite_config(d: Path, **changes) -> None:
    cfg = _config(d)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


# -- export dtype --------------------------------------------------------------------------


def test_export_in_target_dtype_bf16(tmp_path, tiny_target, tiny_drafter):
    """A bf16 target's drafter is written in bf16 and says so: SGLang's --dtype auto reads config.json's
    dtype, and a missing or float32 one is served in float16 next to the bf16 target."""
    out = save_drafter(tiny_drafter, tmp_path / "d", dtype="bfloat16")
    cfg = _config(out)
    assert cfg["dtype"] == "bfloat16" and cfg["torch_dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    back = load_drafter(out, target_config=tiny_target.config, target_dtype="bfloat16")
    for k, v in tiny_drafter.state_dict().items():
        assert back.state_dict()[k].dtype == torch.float32  # training keeps fp32 master weights
        assert torch.equal(back.state_dict()[k], v.bfloat16().float()), k


def test_export_fp32_default_records_dtype(tmp_path, tiny_target, tiny_drafter):
    """The embedded CPU target is float32: its exports stay exact fp32, now with the dtype written down."""
    out = save_drafter(tiny_drafter, tmp_path / "d")
    assert _config(out)["dtype"] == "float32"
    back = load_drafter(out, target_config=tiny_target.config, target_dtype="float32")
    for k, v in tiny_drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert _config(save_drafter(tiny_drafter, tmp_path / "e", dtype=torch.float32))["dtype"] == "float32"


def test_export_refuses_a_non_float_dtype(tmp_path, tiny_drafter):
    with pytest.raises(DrafterError, match="int8"):
        save_drafter(tiny_drafter, tmp_path / "d", dtype="int8")
    assert not (tmp_path / "d").exists()


def test_load_refuses_the_other_half_precision(tmp_path, tiny_target, tiny_drafter):
    out = save_drafter(tiny_drafter, tmp_path / "d", dtype="bfloat16")
    with pytest.raises(DrafterError, match=r"dtype=bfloat16, but target.dtype=float16; set target.dtype=bfloat16"):
        load_drafter(out, target_config=tiny_target.config, target_dtype="float16")
    load_drafter(out, target_config=tiny_target.config)  # no target dtype given: not checked
    # float32 on either side loads (SpecForge's exports always declare bfloat16)
    load_drafter(out, target_config=tiny_target.config, target_dtype="float32")
    fp32 = save_drafter(tiny_drafter, tmp_path / "e")
    load_drafter(fp32, target_config=tiny_target.config, target_dtype="bfloat16")


def test_load_bf16_weights_under_a_float32_config(tmp_path, tiny_target, tiny_drafter):
    """A published drafter keeps bf16 weights when that is exact, under a config that says float32."""
    out = save_drafter(tiny_drafter, tmp_path / "d")
    w = load_file(str(out / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    back = load_drafter(out, target_config=tiny_target.config, target_dtype="float32")
    assert all(v.dtype == torch.float32 for v in back.state_dict().values())


def test_load_refuses_a_bad_config_dtype(tmp_path, tiny_drafter):
    out = save_drafter(tiny_drafter, tmp_path / "d")
    _rewrite_config(out, dtype="int8", torch_dtype=None)
    with pytest.raises(DrafterError, match=r"config.json dtype='int8'"):
        load_draft_config(out)
    _rewrite_config(out, dtype="bfloat16", torch_dtype="float16")
    with pytest.raises(DrafterError, match="disagree"):
        load_draft_config(out)


def test_export_without_dtype_field_still_loads(tmp_path, tiny_target, tiny_drafter):
    """Exports written before the dtype field (and SpecForge's) carry none: accepted for any target dtype."""
    out = save_drafter(tiny_drafter, tmp_path / "d")
    _rewrite_config(out, dtype=None, torch_dtype=None)
    load_drafter(out, target_config=tiny_target.config, target_dtype="bfloat16")


def test_trainer_export_writes_the_given_dtype(tmp_path, tiny_drafter):
    from specforge_opd.train.checkpoint import export_drafter

    out = export_drafter(tiny_drafter, tmp_path / "final", metadata={"step": 1}, dtype="bfloat16")
    assert _config(out)["dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}


# -- published layouts ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["toplevel_block_size", "nested_block_size"])
def test_published_layouts_load(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(FIXTURES / f"{name}.json", d / "config.json")
    cfg = load_draft_config(d)
    assert cfg.block_size == 16  # where SpecForge's DFlashDraftModel reads it
    assert cfg.dflash_config["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert cfg.dflash_config["mask_token_id"] == 151669
    assert cfg.num_target_layers == 36 and cfg.hidden_size == 4096
    assert cfg.layer_types == ["full_attention"] * 5
    assert str(cfg.dtype) == "torch.bfloat16"


def test_sliding_window_layout_refused_by_name(tmp_path):
    d = tmp_path / "swa"
    d.mkdir()
    shutil.copy(FIXTURES / "sliding_window.json", d / "config.json")
    with pytest.raises(DrafterError, match=r"layer_types has \['sliding_attention'\] at layers \[0, 1, 2, 3\].*sliding_window=2048"):
        load_draft_config(d)


def test_dflash2_layout_refused(tmp_path):
    d = tmp_path / "dflash2"
    d.mkdir()
    shutil.copy(FIXTURES / "dflash2.json", d / "config.json")
    with pytest.raises(DrafterError, match="DFlash2DraftModel"):
        load_draft_config(d)


def test_nested_block_size_drafter_loads_with_weights(tmp_path, tiny_target):
    """A drafter whose block_size sits in dflash_config loads, builds the right block and keeps its weights."""
    from conftest import make_tiny_drafter

    drafter = make_tiny_drafter(tiny_target, block_size=6)
    out = save_drafter(drafter, tmp_path / "d")
    cfg = _config(out)
    _rewrite_config(out, block_size=None, dflash_config=dict(cfg["dflash_config"], block_size=6))
    back = load_drafter(out, target_config=tiny_target.config)
    assert back.block_size == 6
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # a re-export keeps both places consistent
    assert _config(save_drafter(back, tmp_path / "e"))["block_size"] == 6


def test_block_size_in_both_places_must_agree(tmp_path, tiny_drafter):
    out = save_drafter(tiny_drafter, tmp_path / "d")
    cfg = _config(out)
    _rewrite_config(out, dflash_config=dict(cfg["dflash_config"], block_size=cfg["block_size"] + 1))
    with pytest.raises(DrafterError, match="dflash_config.block_size=5 disagree"):
        load_draft_config(out)
    _rewrite_config(out, block_size=None, dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != "block_size"})
    with pytest.raises(DrafterError, match="lacks block_size"):
        load_draft_config(out)


def test_sliding_layers_derived_from_use_sliding_window_are_refused(tmp_path, tiny_drafter):
    """Without layer_types, transformers (and so SGLang) derives sliding layers from use_sliding_window and
    max_window_layers; such a drafter must not load as an all-full-attention one."""
    out = save_drafter(tiny_drafter, tmp_path / "d")
    _rewrite_config(out, layer_types=None, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(DrafterError, match=r"sliding_attention'\] at layers \[1\]"):
        load_draft_config(out)


@pytest.mark.parametrize("key,value", [("output_multiplier", 0.2), ("final_logit_softcapping", 20.0),
                                       ("conv_kernel_size", 2), ("projector_type", "domino")])
def test_dflash_config_extensions_refused(tmp_path, tiny_drafter, key, value):
    out = save_drafter(tiny_drafter, tmp_path / "d")
    cfg = _config(out)
    _rewrite_config(out, dflash_config=dict(cfg["dflash_config"], **{key: value}))
    with pytest.raises(DrafterError, match=f"dflash_config uses {key}="):
        load_draft_config(out)


def test_causal_drafter_refused(tmp_path, tiny_drafter):
    out = save_drafter(tiny_drafter, tmp_path / "d")
    _rewrite_config(out, is_causal=True)
    with pytest.raises(DrafterError, match="is_causal=true"):
        load_draft_config(out)


def test_dflash_fields_at_either_level(tmp_path, tiny_target, tiny_drafter):
    """SGLang reads mask_token_id, target_layer_ids and num_target_layers from dflash_config, then from the
    top level; a config with num_target_layers only inside dflash_config must not be taken for a drafter of
    max(layer id) + 1 target layers."""
    out = save_drafter(tiny_drafter, tmp_path / "d")
    cfg = _config(out)
    ids, n = cfg["dflash_config"]["target_layer_ids"], cfg["num_target_layers"]
    assert n > max(ids) + 1  # the tiny target has a layer after the last captured one
    _rewrite_config(out, num_target_layers=None, dflash_config=dict(cfg["dflash_config"], num_target_layers=n))
    assert load_draft_config(out).num_target_layers == n
    load_drafter(out, target_config=tiny_target.config)
    _rewrite_config(out, dflash_config={"num_target_layers": n}, mask_token_id=cfg["dflash_config"]["mask_token_id"],
                    target_layer_ids=ids)
    back = load_draft_config(out)
    assert back.dflash_config["target_layer_ids"] == ids and back.dflash_config["mask_token_id"] == 96
    _rewrite_config(out, dflash_config={"num_target_layers": n, "mask_token_id": 95})
    with pytest.raises(DrafterError, match="mask_token_id=96 and dflash_config.mask_token_id=95 disagree"):
        load_draft_config(out)
