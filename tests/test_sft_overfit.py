"""Sanity before any long run: the real SFT path can fit a handful of real-target sequences.

SpecForge's own serving gate overfits a few samples before trusting a recipe. Here
the responses to four SmolLM2 prompts (one over the length limit is skipped) go through ``specforge-opd sft`` exactly as the main job runs
it (responses -> SpecForge offline features -> ``specforge train`` -> export), with
dense anchors (every block of every response trains every epoch), and the exported
drafter replays those same sequences by exact offline replay. A convention bug
(block layout offset, layer ids, teacher alignment, mask token) keeps tau near 1
however long it trains; a working pipeline memorizes them (measured: tau 5.0 at block
8 on the three sequences, 60 epochs, about 110 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specforge_opd.config import load_config
from specforge_opd.eval.evaluate import TrajectoryCache, offline_tau
from specforge_opd.models.drafter import load_drafter
from specforge_opd.models.target import load_target
from specforge_opd.rollout import responses
from specforge_opd.rollout.records import tau_of
from specforge_opd.stages import sft

BLOCK = 8


@pytest.mark.embedded
@pytest.mark.slow
def test_sft_overfits_four_real_sequences(tmp_path):
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/tiny/sft.yaml", [
        f"output.dir={tmp_path / 'sft'}", "data.num_prompts=4", "sft.max_new_tokens=40",
        "sft.verify_prompts=0", "sft.val_prompts=0", "sft.chunk_prompts=4", "training.num_anchors=40", "training.num_epochs=60",
        "training.learning_rate=3e-3", "training.lr_scheduler=constant", "training.warmup_ratio=0.0",
        "training.log_interval=1000", f"draft.block_size={BLOCK}",
    ])
    bundle = load_target(cfg.target)
    final = sft.run_sft(cfg, bundle=bundle)
    recs = responses.read_responses(next((tmp_path / "sft").glob("responses-*")))
    assert len(recs) >= 3  # a prompt over the length limit is skipped, as in the main job
    drafter = load_drafter(final, target_config=bundle.model.config).eval()
    # the training sequences themselves: at T=0 the responses are the target's greedy trajectories
    cache = TrajectoryCache(None, bundle.model, bundle.identity, max_new_tokens=cfg.sft.max_new_tokens,
                            stop_token_ids=bundle.stop_token_ids)
    trajs = cache.get([r.prompt_ids for r in recs], drafter.target_layer_ids)
    for r, tr in zip(recs, trajs):
        assert tr.input_ids.tolist()[: len(r.prompt_ids) + len(r.response_ids)] == r.prompt_ids + r.response_ids
    with torch.no_grad():
        tau = tau_of(offline_tau(drafter, bundle.model, trajs))
    # a unigram-level drafter sits near 1.06; memorized blocks accept most of their 7 drafted slots
    # (validation is off: the export is the last checkpoint, not the best on held-out prompts)
    print(f"training-set tau {tau:.3f}")
    assert tau >= 4.0, f"the SFT path did not fit 4 sequences: training-set tau {tau:.2f} at block {BLOCK}"
