"""specforge-opd: Draft-OPD (arXiv 2605.29343) on-policy distillation for DFlash drafters."""

__version__ = "0.1.0"
