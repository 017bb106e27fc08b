"""``specforge-opd prepare-assets``: the embedded target and the offline prompt sources, made ready in the cache.

It sits above both ``data.assets`` (the target) and ``data.prompts`` (the sources), so
neither of those has to import the other.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Optional

from specforge_opd.data import assets, prompts
from specforge_opd.data.locations import CACHE_ENV, cache_dir


def prepare_assets(cache: Optional[str | os.PathLike] = None, *, progress: bool = True) -> dict:
    """Convert the embedded target and parse the offline prompt sources (``prompts.OFFLINE_SOURCES``) into the cache.

    Returns ``{"target": path, "sources": {name: count}, "seconds": {...}}``.
    Raises AssetError (missing package, checksum, failed checks).
    """
    report: dict = {"seconds": {}, "sources": {}}
    t0 = time.time()
    report["target"] = str(assets.ensure_target(cache, progress=progress))
    report["seconds"]["target"] = round(time.time() - t0, 2)
    for name in prompts.OFFLINE_SOURCES:
        t1 = time.time()
        recs = prompts.load_source(name, cache=cache)
        report["sources"][name] = len(recs)
        report["seconds"][name] = round(time.time() - t1, 2)
    report["seconds"]["total"] = round(time.time() - t0, 2)
    return report


def cli(argv: list[str]) -> int:
    """``specforge-opd prepare-assets [--cache DIR]``: prints what it did and how long it took."""
    p = argparse.ArgumentParser(prog="specforge-opd prepare-assets", description=prepare_assets.__doc__)
    p.add_argument("--cache", help=f"cache directory (default ${CACHE_ENV} or ~/.cache/specforge_opd)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rep = prepare_assets(args.cache)  # AssetError / PromptsError: reported by cli.main
    print(f"target: {rep['target']} ({rep['seconds']['target']:.2f} s)")
    for name, n in rep["sources"].items():
        print(f"prompts {name}: {n} records ({rep['seconds'][name]:.2f} s)")
    print(f"total: {rep['seconds']['total']:.2f} s; cache {cache_dir(args.cache)}")
    return 0
