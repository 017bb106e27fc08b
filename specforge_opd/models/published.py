"""Drafters shipped in the package: the embedded target's published DFlash drafter.

A user starts OPD from a published DFlash checkpoint. The embedded target's best is
``published:smollm2-135m-instruct-dflash-b8-mixv2-l3-long``, trained in three stages on about
4.7K chat, later-turn, code and math prompts with 256-token responses (3 layers):
``configs/small/sft_mix_v2_l3.yaml`` (warm-started from ``...-dflash-b8-mixmath-l3`` at a
constant LR), ``configs/small/sft_mix_v2_l3_anneal.yaml`` (the LR annealed to 0; that stage's
export ships as ``...-dflash-b8-mixv2-l3``) and ``configs/small/sft_mix_v2_l3_long.yaml`` (a
second, longer cosine from it). The main job and the OPD study's config start from it
(``EMBEDDED_DRAFTER``, equal to ``BEST_DRAFTER``). The
predecessors ``...-dflash-b8-mixv2-l3``, ``...-dflash-b8-mixmath-l3`` (3 layers,
``configs/small/sft_mix_math_l3.yaml``; stage 1 starts from it) and ``...-dflash-b8`` (1 layer,
``configs/small/sft.yaml``) ship and resolve; ``...-dflash-b8-turns256-l3`` no longer ships
(``RETIRED``: resolving it names its successor and the recipe that retrains it). Any config path
field that names a drafter accepts ``published:NAME`` (``config.ExperimentConfig.resolve_path``).

Each published drafter is an HF DFlash directory (``config.json``,
``model.safetensors``, ``specforge_opd.json``) plus ``training_record.json``: the
recipe (config text), the commit, trained positions, FLOPs, the validation curve,
and a check (tau by exact offline replay on a few held-out prompts, beside prompt
lookup's on the same trajectories) that ``tests/test_published.py`` recomputes.

This module is the registry alone (stdlib only: ``config`` imports it to resolve
``published:NAME``); publishing and the check are ``specforge_opd.stages.publish``.

    python -m specforge_opd.models.published list
    python -m specforge_opd.stages.publish publish --export runs/small/sft/final --config configs/small/sft.yaml --name NAME
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

#: Where published drafters live (package data).
PUBLISHED_DIR = Path(__file__).resolve().parent / "published"
#: Prefix of a config path that names a published drafter.
SCHEME = "published:"
#: The embedded target's best published drafter (highest mean held-out tau, ``benchmarks/results/drafter_scaling.json``).
BEST_DRAFTER = "smollm2-135m-instruct-dflash-b8-mixv2-l3-long"
#: The published drafter the main job and the OPD study's config start from: the best one.
EMBEDDED_DRAFTER = BEST_DRAFTER
#: Drafters that no longer ship (the package carries the newest few): name -> (successor, recipe).
RETIRED = {"smollm2-135m-instruct-dflash-b8-turns256-l3": ("smollm2-135m-instruct-dflash-b8-mixv2-l3-long",
                                                           "configs/small/sft_turns256_l3.yaml")}
RECORD_FILE = "training_record.json"


def available() -> list[str]:
    """Names of the published drafters in this install."""
    if not PUBLISHED_DIR.is_dir():
        return []
    return sorted(p.name for p in PUBLISHED_DIR.iterdir() if (p / "config.json").is_file())


def published_drafter(name: str) -> Path:
    """The directory of published drafter ``name``.

    Raises:
        ValueError: no such drafter (the message lists the available ones), or a retired one
            (the message names its successor and the recipe that retrains it).
    """
    d = PUBLISHED_DIR / name
    if not (d / "config.json").is_file():
        if name in RETIRED:
            successor, recipe = RETIRED[name]
            raise ValueError(f"{SCHEME}{name} no longer ships: use {SCHEME}{successor}, or retrain it with "
                             f"scripts/train_sft.sh {recipe}")
        raise ValueError(f"{SCHEME}{name}: no such published drafter; available: "
                         + (", ".join(f"{SCHEME}{n}" for n in available()) or "none"))
    return d


def resolve(p: str) -> Optional[Path]:
    """``published:NAME`` -> its directory; any other string -> None."""
    return published_drafter(p[len(SCHEME):]) if p.startswith(SCHEME) else None


def read_record(name: str) -> dict:
    """The ``training_record.json`` of published drafter ``name``."""
    return json.loads((published_drafter(name) / RECORD_FILE).read_text())


def print_list() -> None:
    """One line per published drafter: its name, selected step and validation tau (from its training record)."""
    for n in available():
        r = read_record(n)
        print(f"{SCHEME}{n}: step {r['selected_step']}, validation tau {r['validation']['selected_tau']:.3f}")


#: Where publishing lives now: it runs the check (the eval stage), which the registry must not import.
PUBLISH_COMMAND = "python -m specforge_opd.stages.publish publish"


def cli(argv: Optional[list[str]] = None) -> int:
    """``list``: the published drafters. ``publish`` answers with the command that publishes now (exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["publish"]:
        print(f"publish moved: run {shlex.join([*PUBLISH_COMMAND.split(), *argv[1:]])}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="python -m specforge_opd.models.published", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the published drafters")
    p.parse_args(argv)
    print_list()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
