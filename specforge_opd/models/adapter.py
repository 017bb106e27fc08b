"""The one module that imports SpecForge (DESIGN.md section 8).

SpecForge's API moves between releases; every other module imports these names
from here, so a SpecForge refactor touches this file only. Pinned: specforge 0.2.0.
"""

from __future__ import annotations

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
