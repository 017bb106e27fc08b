"""``python -m specforge_opd.models.specforge_train train -c run.yaml``: SpecForge's own CLI, with the SFT train
step's lm_head objective that is not recomputed in the backward (``sft.lm_head_recompute=false``;
``adapter.StoredGradDFlashModel``). Same arguments, run config, training loop and checkpoints as
``python -m specforge.cli``."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from specforge_opd.models.adapter import specforge_cli_main

    raise SystemExit(specforge_cli_main(sys.argv[1:], lm_head_recompute=False))
