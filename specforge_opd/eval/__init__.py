"""Evaluation: exact offline replay tau, the prompt-lookup baseline, FLOPs, statistics, plots, SFT validation."""
