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
