"""The SFT train step's lm_head objective without recompute (``sft.lm_head_recompute=false``): the same loss and
drafter gradients as SpecForge's DFlash step on the same batch, and the SFT stage runs and resumes with it."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from specforge_opd.models.adapter import OnlineDFlashModel, StoredGradDFlashModel
from specforge_opd.models.dflash_objective import dflash_objective_terms

from conftest import TINY_MASK, make_tiny_drafter, make_tiny_target


def _batch(seq: int = 40, width: int = 64, seed: int = 0):
    """Two samples: a prompt then a response, and a two-turn one (the loss mask has a gap), different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (2, seq), generator=g)
    mask = torch.zeros(2, seq, dtype=torch.long)
    mask[0, 12:] = 1
    mask[1, 5:14] = 1
    mask[1, 20:33] = 1  # the last 7 tokens are padding-like: never supervised
    hidden = torch.randn(2, seq, width, generator=g)
    return ids, hidden, mask


def _models(num_anchors: int, chunk_blocks: int, gamma, layers: int = 2):
    target = make_tiny_target()
    target.requires_grad_(False)  # SpecForge's target embeddings and head are frozen
    drafter = make_tiny_drafter(target, layers=layers).train()
    kw = dict(target_lm_head=target.lm_head, target_embed_tokens=target.model.embed_tokens, mask_token_id=TINY_MASK,
              block_size=drafter.block_size, attention_backend="sdpa", num_anchors=num_anchors, loss_decay_gamma=gamma,
              objective_chunk_blocks=chunk_blocks)
    return OnlineDFlashModel(draft_model=drafter, **kw), StoredGradDFlashModel(draft_model=copy.deepcopy(drafter), **kw)


def _width(model) -> int:
    """Feature width: the target's hidden size x the drafter's target layers."""
    from specforge_opd.models.drafter import drafter_layer_ids

    return 64 * len(drafter_layer_ids(model.draft_model))


def _step(model, batch):
    ids, hidden, mask = batch
    torch.manual_seed(7)  # the same anchors in both models
    loss, acc, metrics = model(input_ids=ids, hidden_states=hidden, loss_mask=mask)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.draft_model.named_parameters() if p.requires_grad}
    return loss.detach(), acc, metrics, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("num_anchors,chunk_blocks,gamma,layers", [
    (16, 128, None, 2),   # SpecForge's default chunk: one chunk here
    (32, 3, 4.0, 1),      # more anchors than valid starts (dropped blocks), several chunks, the slot decay
    (8, 0, 4.0, 3),       # no chunking at all
])
def test_loss_and_gradients_equal_specforge_step_in_fp32(num_anchors, chunk_blocks, gamma, layers):
    specforge, stored = _models(num_anchors, chunk_blocks, gamma, layers)
    batch = _batch(width=_width(specforge))
    loss_a, acc_a, m_a, g_a = _step(specforge, batch)
    loss_b, acc_b, m_b, g_b = _step(stored, batch)
    assert abs(float(loss_b - loss_a)) <= 1e-5 * abs(float(loss_a))
    assert float(acc_b) == pytest.approx(float(acc_a))
    assert float(m_b["accuracy_denom"]) == float(m_a["accuracy_denom"])
    assert [float(t.detach()) for t in m_b["loss_terms"]] == pytest.approx([float(t.detach()) for t in m_a["loss_terms"]], rel=1e-5)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for k in g_a:
        assert g_a[k].abs().sum() > 0, k  # every trainable parameter gets a gradient: the comparison means something
        assert _rel(g_b[k], g_a[k]) <= 1e-5, (k, _rel(g_b[k], g_a[k]))


def test_terms_skip_zero_weight_rows_and_match_plain_cross_entropy():
    """Against plain autograd cross-entropy over every position; zero-weight rows (never computed) add nothing."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 16, generator=g)
    h = torch.randn(2, 3, 4, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (2, 3, 4), generator=g)
    mask = (torch.rand(2, 3, 4, generator=g) > 0.4).float()
    lw = mask * torch.rand(2, 3, 4, generator=g)
    num, den, correct, acc_den = dflash_objective_terms(h, w, None, t, mask, lw, chunk_rows=5)
    num.backward(torch.tensor(0.5))
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ w.t()
    ref = (torch.nn.functional.cross_entropy(logits.reshape(-1, 50), t.reshape(-1), reduction="none") * lw.reshape(-1)).sum()
    (0.5 * ref).backward()
    torch.testing.assert_close(num, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    assert float(den) == pytest.approx(float(lw.sum())) and float(acc_den) == float(mask.sum())
    assert float(correct) == float(((logits.argmax(-1) == t) & (mask > 0.5)).sum())
    with torch.no_grad():  # evaluation: no gradient kept
        assert dflash_objective_terms(h, w, None, t, mask, lw, chunk_rows=0)[0].requires_grad is False


def test_bf16_step_close_to_specforge():
    specforge, stored = _models(16, 2, 4.0)
    specforge.to(torch.bfloat16)
    stored.to(torch.bfloat16)
    ids, hidden, mask = _batch(width=_width(specforge))
    loss_a = _step(specforge, (ids, hidden.bfloat16(), mask))[0]
    loss_b = _step(stored, (ids, hidden.bfloat16(), mask))[0]
    assert abs(float(loss_b - loss_a)) <= 2e-2 * abs(float(loss_a))


def test_refuses_what_it_does_not_implement():
    specforge, _ = _models(8, 2, None)
    with pytest.raises(ValueError, match="loss_type=dpace.*lm_head_recompute=true"):
        StoredGradDFlashModel(draft_model=specforge.draft_model, target_lm_head=specforge.lm_head,
                              target_embed_tokens=specforge.embed_tokens, mask_token_id=TINY_MASK, block_size=4,
                              attention_backend="sdpa", loss_type="dpace")
    with pytest.raises(ValueError, match="must be frozen"):
        dflash_objective_terms(torch.zeros(1, 1, 2, 4), torch.zeros(5, 4, requires_grad=True), None,
                               torch.zeros(1, 1, 2, dtype=torch.long), torch.ones(1, 1, 2), torch.ones(1, 1, 2), 0)


# --- the SFT stage with the option ---


def test_option_keys_the_train_step_only_when_on(tmp_path):
    from specforge_opd.stages import sft_train
    from sft_helpers import tiny_cfg

    default = sft_train.sft_training_inputs(tiny_cfg(tmp_path / "a"))
    assert "lm_head_recompute" not in default  # runs with SpecForge's objective keep their keys
    on = sft_train.sft_training_inputs(tiny_cfg(tmp_path / "a", **{"sft.lm_head_recompute": "false"}))
    assert on == dict(default, lm_head_recompute=False)


def _losses(out: str) -> dict[int, tuple[float, float]]:
    """SpecForge's logged (loss, grad_norm) per optimizer step."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in
            re.finditer(r"^step (\d+): \{.*'loss': ([-0-9.eE+]+), 'grad_norm': ([-0-9.eE+]+)", out, flags=re.M)}


def test_sft_stage_trains_and_resumes_with_the_option_as_with_specforge_objective(tmp_path, monkeypatch, capfd):
    """SpecForge's loop trains with the stored-gradient objective (its model line printed), a killed run resumes
    from SpecForge's checkpoint without training a step twice, and the logged losses and gradient norms equal those of SpecForge's
    own objective on the same data (fp32)."""
    from specforge_opd.stages import sft, sft_train
    from sft_helpers import crash_after, make_prompts, make_target_dir, tiny_cfg

    bundle = make_target_dir(tmp_path / "target")
    prompts = make_prompts(8)
    over = {"sft.save_interval": 2, "sft.verify_prompts": 0}
    sft.run_sft(tiny_cfg(tmp_path / "ref", **over), bundle=bundle, prompts=prompts, target_path=bundle.path)
    ref = capfd.readouterr().out
    assert "no recompute" not in ref

    cfg = tiny_cfg(tmp_path / "run", **over, **{"sft.lm_head_recompute": "false"})
    real_call = sft_train.subprocess.call
    # SpecForge runs 4 of its 8 steps (checkpoints at 2 and 4), then the process "dies"
    monkeypatch.setattr(sft_train.subprocess, "call", crash_after(real_call, 4, 8))
    with pytest.raises(sft.SFTError, match="status 137"):
        sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    first = capfd.readouterr().out
    assert "specforge_opd.models.specforge_train train" in first and "no recompute" in first
    monkeypatch.setattr(sft_train.subprocess, "call", real_call)
    sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    second = capfd.readouterr().out
    assert "resuming SpecForge from sft-step4" in second and "no recompute" in second
    assert sorted(_losses(second)) == [5, 6, 7, 8]  # no step trained twice
    ckpts = next((tmp_path / "run").glob("train-*")) / "checkpoints"
    assert sft_train.latest_checkpoint(ckpts).name == "sft-step8"
    ours, theirs = {**_losses(first), **_losses(second)}, _losses(ref)
    assert sorted(ours) == sorted(theirs) == list(range(1, 9))
    for step in theirs:  # loss and gradient norm of every step, Adam's updates in between
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), step
