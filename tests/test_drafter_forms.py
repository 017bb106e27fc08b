"""Every verb that takes a drafter loads it through ``drafter.load_drafter`` and accepts the same forms:
an HF DFlash directory, ``published:NAME``, and a SpecForge checkpoint (step dir, state file, -latest link, run dir)."""

from __future__ import annotations

import types

import pytest
import torch

from specforge_opd.models import published
from specforge_opd.models.drafter import DrafterError, load_any_drafter, load_drafter, save_drafter

from conftest import TINY_MASK, make_tiny_drafter, make_tiny_target
from test_sft_reuse import _specforge_run


@pytest.fixture(scope="module")
def tiny():
    target = make_tiny_target()
    target.requires_grad_(False)
    target.lm_head.weight[TINY_MASK].zero_()  # the mask token is one the target never produces
    return target, make_tiny_drafter(target, block_size=4, layers=2)


@pytest.fixture
def forms(tmp_path, tiny, monkeypatch):
    """{form: path} of one drafter in every accepted form."""
    target, drafter = tiny
    step = _specforge_run(tmp_path / "run", drafter)
    save_drafter(drafter, tmp_path / "hf")
    monkeypatch.setattr(published, "PUBLISHED_DIR", tmp_path / "pub")
    save_drafter(drafter, tmp_path / "pub" / "tiny-b4")
    return {"hf_dir": tmp_path / "hf", "published": "published:tiny-b4", "specforge_step_dir": step,
            "specforge_state_file": step / "training_state.pt", "specforge_latest_link": tmp_path / "run" / "sft-latest",
            "specforge_run_dir": tmp_path / "run"}


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("form", ["hf_dir", "published", "specforge_step_dir", "specforge_state_file",
                                  "specforge_latest_link", "specforge_run_dir"])
def test_load_drafter_accepts_every_form(forms, tiny, form):
    target, drafter = tiny
    got = load_drafter(forms[form], target_config=target.config, target_dtype="float32", expected_mask_token_id=TINY_MASK)
    _same_weights(got, drafter)
    assert got.block_size == 4 and got.config.dflash_config["mask_token_id"] == TINY_MASK
    _same_weights(load_any_drafter(forms[form], target.config), drafter)


def test_a_specforge_checkpoint_needs_the_target_config(forms):
    with pytest.raises(DrafterError, match="SpecForge checkpoint.*target's config"):
        load_drafter(forms["specforge_step_dir"])
    with pytest.raises(DrafterError, match="mask_token_id 96 != configured draft.mask_token_id 5"):
        load_drafter(forms["specforge_step_dir"], target_config=make_tiny_target().config, expected_mask_token_id=5)


def test_eval_accepts_a_specforge_step_directory(tmp_path, forms, tiny):
    """``eval`` took HF directories only, while OPD accepted SpecForge step directories: the same drafter now
    gets the same tau in every form."""
    from specforge_opd.config import load_config
    from specforge_opd.eval.evaluate import evaluate
    from specforge_opd.eval.ngram import NGRAM_NAME

    target, _ = tiny
    cfg = load_config(None, ["eval.max_new_tokens=12", "eval.speedup=false", f"eval.cache_dir={tmp_path / 'cache'}"])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (6,), generator=g).tolist() for _ in range(3)]
    ns = types.SimpleNamespace(model=target, identity="tiny", stop_token_ids=[1], tokenizer=None, path="tiny")
    res = evaluate(cfg, {name: forms[name] for name in ("hf_dir", "published", "specforge_step_dir", "specforge_state_file")},
                   tmp_path / "out", target=ns, prompt_sets={"set": (prompts, ["a", "b", "c"])})
    taus = {name: d["datasets"]["set"]["tau"] for name, d in res["drafters"].items() if name != NGRAM_NAME}
    assert len(taus) == 4 and len(set(taus.values())) == 1, taus


def test_distill_and_compare_accept_a_specforge_step_directory(tmp_path, forms, tiny):
    """The OPD trainer's initial drafter and the matched-FLOPs baseline's cost model read the same forms."""
    from specforge_opd.config import load_config
    from specforge_opd.rollout.responses import ResponseRecord
    from specforge_opd.stages.compare import matched_steps
    from specforge_opd.train.trainer import _initial_drafter

    from sft_helpers import make_target_dir

    target, drafter = tiny
    cfg = load_config(None, [f"draft.mask_token_id={TINY_MASK}", "target.dtype=float32"])
    got, step0 = _initial_drafter(forms["specforge_step_dir"], cfg, target)
    _same_weights(got, drafter)
    assert step0 == 0

    bundle = make_target_dir(tmp_path / "target")  # a target on disk: the cost model reads its config.json
    start = _specforge_run(tmp_path / "run2", make_tiny_drafter(bundle.model, block_size=4, layers=2))
    save_drafter(make_tiny_drafter(bundle.model, block_size=4, layers=2), tmp_path / "hf2")
    sft_cfg = load_config(None, [f"target.path={bundle.path}", "training.num_anchors=4"])
    recs = [ResponseRecord(id=f"r{i}", prompt_ids=list(range(3, 13)), response_ids=list(range(20, 40)), finished=True)
            for i in range(3)]
    assert matched_steps(sft_cfg, start, recs, 1e9) == matched_steps(sft_cfg, tmp_path / "hf2", recs, 1e9)


@pytest.mark.parametrize("form", ["hf_dir", "published", "specforge_step_dir", "specforge_state_file",
                                  "specforge_latest_link", "specforge_run_dir"])
def test_sft_init_drafter_accepts_every_form(tmp_path, forms, tiny, form):
    """``sft.init_drafter`` (what the matched-FLOPs baseline sets to OPD's ``draft.path``) reached SpecForge as it
    was, and SpecForge starts from HF directories only; every form now gives SpecForge an HF directory of the
    same weights."""
    from specforge_opd.config import load_config
    from specforge_opd.stages.sft_train import init_drafter_dir, specforge_run_config

    target, drafter = tiny
    cfg = load_config(None, [f"sft.init_drafter={forms[form]}", f"draft.mask_token_id={TINY_MASK}"])
    d = init_drafter_dir(cfg, tmp_path / "train", target.config)
    run = specforge_run_config(cfg, target_path="t", draft_config_file=tmp_path / "c.json", features=tmp_path,
                               out_dir=tmp_path / "o", num_samples=8, mask_token_id=TINY_MASK, gpus=0, init_dir=d)
    start = run["model"]["draft_checkpoint_path"]
    assert (tmp_path / start / "config.json").is_file(), start
    _same_weights(load_drafter(start), drafter)
    assert init_drafter_dir(cfg, tmp_path / "train", target.config) == d  # exported once, then reused


def test_sft_without_init_drafter_starts_fresh(tmp_path, tiny):
    from specforge_opd.config import load_config
    from specforge_opd.stages.sft_train import init_drafter_dir

    assert init_drafter_dir(load_config(None), tmp_path, tiny[0].config) is None


def test_sft_init_drafter_of_another_shape_is_refused(tmp_path, tiny):
    """SpecForge's warm start checks only for missing keys: a 2-layer start under a 1-layer draft section trained a
    1-layer drafter with no error (the fair baselines did, from the 3-layer published drafter). Every shape field
    is compared, defaults included, and the error names the overrides that fix it."""
    from specforge_opd.config import ConfigError, load_config
    from specforge_opd.models.draft_config import make_draft_config
    from specforge_opd.models.drafter import drafter_shape, shape_overrides
    from specforge_opd.stages.sft_train import check_init_shape

    target, drafter = tiny
    start = save_drafter(drafter, tmp_path / "start")
    base = [f"sft.init_drafter={start}", f"draft.mask_token_id={TINY_MASK}"]
    cfg = load_config(None, base)  # the schema's defaults: 1 layer, block 16
    with pytest.raises(ConfigError) as e:
        check_init_shape(cfg, make_draft_config(cfg, target.config, TINY_MASK), target.config)
    msg = str(e.value)
    assert msg.startswith(f"sft.init_drafter={start}: draft.num_hidden_layers is 1 but the drafter has 2; ")
    assert "draft.block_size is 16 but the drafter has 4" in msg
    assert "set draft.num_hidden_layers=2 draft.block_size=4 draft.target_layer_ids=[1,1]" in msg
    fixed = load_config(None, base + shape_overrides(drafter_shape(drafter)))
    check_init_shape(fixed, make_draft_config(fixed, target.config, TINY_MASK), target.config)
