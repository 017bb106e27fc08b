"""The one module that imports SpecForge (DESIGN.md section 8).

SpecForge's API moves between releases; every other module imports these names
from here, so a SpecForge refactor touches this file only. Pinned: specforge 0.2.0.
"""

from __future__ import annotations

import torch
from specforge.algorithms.common.dflash_family_model import (  # noqa: F401
    OnlineDFlashModel,
    create_dflash_block_mask,
    create_dflash_sdpa_mask,
)
from specforge.modeling.draft.dflash import (  # noqa: F401
    DFlashDraftModel,
    build_target_layer_ids,
    extract_context_feature,
)
from transformers import Qwen3Config  # noqa: F401  (DFlashDraftModel.config_class)

from specforge_opd.models.dflash_objective import dflash_objective_terms

SPECFORGE_VERSION = "0.2.0"


def specforge_cli_module() -> str:
    """The module path that runs SpecForge's CLI (``python -m <this> train -c run.yaml``)."""
    return "specforge.cli"


def optimizer_and_scheduler():
    """SpecForge's optimizer and LR-scheduler modules (imported lazily: they pull in more)."""
    import specforge.lr_scheduler as lr_scheduler
    import specforge.optimizer as optimizer

    return optimizer, lr_scheduler


# --- SFT stage and SpecForge checkpoints (sft_train, draft_config, drafter) ---


def specforge_run_config_class():
    """SpecForge's run-config schema (``specforge.config.Config``): validates the run YAML we write."""
    from specforge.config import Config

    return Config


def specforge_resolve_mask_token_id(*, explicit, tokenizer, embedding_vocab_size: int, draft_model=None) -> int:
    """SpecForge's mask-token resolution (explicit, draft config, tokenizer mask, first unused slot, ...)."""
    from specforge.training.model_utils import resolve_mask_token_id

    return resolve_mask_token_id(
        explicit=explicit, tokenizer=tokenizer, embedding_vocab_size=embedding_vocab_size, draft_model=draft_model
    )


def specforge_checkpoint_layout():
    """SpecForge's checkpoint layout: (state file name, ``resolve_resume_dir(path) -> step dir``)."""
    from specforge.training.checkpoint import STATE_FILE, CheckpointManager

    return STATE_FILE, CheckpointManager.resolve_resume_dir


# --- the SFT train step's lm_head objective without recompute (models/dflash_objective.py) ---


class StoredGradDFlashModel(OnlineDFlashModel):
    """SpecForge's ``OnlineDFlashModel`` whose DFlash objective computes the lm_head once per position.

    Only ``_dflash_objective_chunk_terms`` differs: ``models.dflash_objective`` computes each
    chunk's logits, loss and d(loss)/d(hidden) in the forward and keeps that gradient, instead
    of SpecForge's checkpointed chunks that recompute the logits in the backward. The
    configured ``objective_chunk_blocks`` becomes this objective's chunk (``block_size`` rows
    per block); SpecForge's own chunk loop is set to one pass (0) so nothing is checkpointed.
    Same constructor as ``OnlineDFlashModel``.

    Raises:
        ValueError: ``loss_type`` other than ``dflash`` (the D-PACE weights are not implemented here).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.loss_type != "dflash":
            raise ValueError(f"training.loss_type={self.loss_type}: sft.lm_head_recompute=false supports the "
                             "dflash loss only; set sft.lm_head_recompute=true")
        self.stored_grad_chunk_blocks = self.objective_chunk_blocks
        self.objective_chunk_blocks = 0  # SpecForge's reduce calls the objective once, unchecked
        print("[sft train] lm_head objective: gradients stored in the forward, no recompute "
              "(sft.lm_head_recompute=false)", flush=True)

    def _dflash_objective_chunk_terms(self, hidden, target_ids, weight_mask):
        loss_weights = weight_mask
        if self.loss_decay_gamma is not None and self.loss_decay_gamma > 0:
            # SpecForge's slot decay exp(-(k-1)/gamma), k the slot in the block (k=0, the anchor, has weight 0)
            positions = torch.arange(self.block_size, device=hidden.device).view(1, 1, -1)
            loss_weights = weight_mask * torch.exp(-(positions - 1).clamp(min=0).float() / self.loss_decay_gamma)
        return dflash_objective_terms(hidden, self.lm_head.weight, self.lm_head.bias, target_ids, weight_mask,
                                      loss_weights, self.stored_grad_chunk_blocks * self.block_size)


def specforge_cli_main(argv: list[str], *, lm_head_recompute: bool = True) -> int:
    """Run SpecForge's CLI (``specforge.cli.main``) in this process; with ``lm_head_recompute`` False its
    DFlash training model is ``StoredGradDFlashModel``.

    SpecForge builds the DFlash model through ``dflash_family_model.OnlineDFlashModel`` at call
    time, so the class is swapped there for this process only. A single-process (CPU) run trains
    in this process; SpecForge's multi-rank launcher starts its own module, which would not see
    the swap, so the SFT stage uses this on a CPU only.
    """
    if not lm_head_recompute:
        import specforge.algorithms.common.dflash_family_model as family

        family.OnlineDFlashModel = StoredGradDFlashModel
    from specforge.cli import main

    return main(argv)
