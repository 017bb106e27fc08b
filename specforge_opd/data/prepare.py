"""The job of ``specforge-opd prepare-assets`` (its flags are in ``cli``): the embedded target and the offline prompt sources, made ready in the cache.

It sits above both ``data.assets`` (the target) and ``data.prompts`` (the sources), so
neither of those has to import the other.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from specforge_opd.data import assets, prompts


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
