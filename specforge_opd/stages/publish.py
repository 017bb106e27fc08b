"""Publish an SFT export as a drafter shipped in the package, with its training record and the recorded check.

The record holds the recipe (config text), the commit, trained positions, FLOPs, the validation curve,
and a check (tau by exact offline replay on a few held-out prompts, beside prompt lookup's on the same
trajectories) that ``tests/test_published.py`` recomputes. The registry that resolves ``published:NAME``
is ``specforge_opd.models.published``.

    python -m specforge_opd.stages.publish publish --export runs/small/sft/final --config configs/small/sft.yaml --name NAME
    python -m specforge_opd.stages.publish list
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from specforge_opd.config import load_config
from specforge_opd.eval.evaluate import evaluate
from specforge_opd.eval.ngram import NGRAM_NAME
from specforge_opd.models import published
from specforge_opd.models.drafter import read_drafter_metadata
from specforge_opd.rollout.responses import read_responses
from specforge_opd.stages.sft_features import supervised_tokens
from specforge_opd.stepkeys import step_roots

#: The check recorded at publish time and recomputed by the test: prompts per eval set, new tokens.
CHECK_PROMPTS = 4
CHECK_MAX_NEW_TOKENS = 64


def source_commit() -> Optional[str]:
    """The git commit of this package's checkout (None outside a git checkout): records name the code behind them."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def check_config(overrides: Optional[list[str]] = None):
    """The config of the recorded check: the tiny eval sets, ``CHECK_PROMPTS`` prompts x ``CHECK_MAX_NEW_TOKENS``."""
    root = Path(__file__).resolve().parents[2]
    return load_config(root / "configs/tiny/eval.yaml", [f"eval.num_prompts={CHECK_PROMPTS}",
                                                         f"eval.max_new_tokens={CHECK_MAX_NEW_TOKENS}",
                                                         "eval.speedup=false", *(overrides or [])])


def run_check(drafter_dir: Path, out_dir: Path, overrides: Optional[list[str]] = None) -> dict:
    """tau per eval set of the drafter at ``drafter_dir`` and of prompt lookup, by exact offline replay.

    Returns ``{"drafter": {dataset: tau}, "ngram": {dataset: tau}, "num_prompts", "max_new_tokens"}``.
    """
    cfg = check_config(overrides)
    res = evaluate(cfg, {"published": Path(drafter_dir)}, out_dir)
    taus = {n: {ds: e["tau"] for ds, e in res["drafters"][n]["datasets"].items()} for n in ("published", NGRAM_NAME)}
    return {"drafter": taus["published"], "ngram": taus[NGRAM_NAME], "num_prompts": CHECK_PROMPTS,
            "max_new_tokens": CHECK_MAX_NEW_TOKENS, "datasets": list(taus["published"])}


def trained_positions(steps: int, supervised: list[int], num_anchors: int, block_size: int) -> int:
    """Drafter slots SpecForge trained in ``steps`` steps of batch 1 over samples with these supervised
    token counts: each step takes one sample and min(num_anchors, supervised - 1) anchors of
    ``block_size`` slots (whole epochs see every sample once; a partial one is counted at the mean)."""
    per = [min(num_anchors, max(0, n - 1)) * block_size for n in supervised]
    epochs, rest = divmod(steps, len(per))
    return epochs * sum(per) + round(rest * sum(per) / len(per))


def _store_bf16_if_exact(path: Path) -> bool:
    """Rewrite fp32 weights as bf16 when that loses nothing (a bf16-trained drafter): half the package size.

    Loading casts them back (``drafter.load_drafter`` builds the model in fp32), so the
    drafter's outputs are unchanged. Returns whether the file was rewritten.
    """
    w = load_file(str(path))
    if not all(v.dtype == torch.float32 and torch.equal(v, v.bfloat16().float()) for v in w.values()):
        return False
    save_file({k: v.bfloat16().contiguous() for k, v in w.items()}, str(path), metadata={"format": "pt"})
    return True


def responses_dirs(cfg) -> list[Path]:
    """The SFT run's responses steps (sorted), in its ``output.dir`` or else in ``sft.reuse_from``:
    a run that reused another's responses has none of its own."""
    roots = step_roots(cfg, Path(cfg.resolve_path(cfg.output.dir)))
    return next((found for root in roots if (found := sorted(root.glob("responses-*")))), [])


def earlier_stages(cfg, earlier_configs: Sequence[Path] = ()) -> list[dict]:
    """The stages before this SFT run, for a training record: each earlier config's text, and the run's
    warm start (``sft.init_drafter``) with its step and validation curve when it is a local SFT export
    (a published start has a training record of its own, which the name points to).

    Returns ``[{"config_file", "config"}..., {"init_drafter", "step", "selected_tau", "curve", "init_drafter_of_it"}]``
    (the last entry only with a local SFT start).
    """
    stages = [{"config_file": str(c), "config": Path(c).read_text()} for c in earlier_configs]
    init = cfg.sft.init_drafter
    if init and not init.startswith(published.SCHEME):
        meta = read_drafter_metadata(cfg.resolve_path(init))
        val = meta.get("validation") or {}
        stages.append({"init_drafter": init, "step": meta.get("step"), "selected_tau": val.get("selected_tau"),
                       "curve": [{"step": p["step"], "tau": p["tau"]} for p in val.get("curve", [])],
                       "init_drafter_of_it": meta.get("init_drafter")})
    return stages


def publish(export: Path, config_file: Path, name: str, check_overrides: Optional[list[str]] = None,
            earlier_configs: Sequence[Path] = ()) -> Path:
    """Copy the SFT export ``export`` (trained with ``config_file``) into the package as ``name``,
    with its training record and the recorded check; returns the published directory.

    ``earlier_configs``: the configs of the stages before this one (a warm start from a local
    export), recorded with their text (``earlier_stages``).

    Raises:
        ValueError: ``export`` has no SFT metadata with a validation curve.
    """
    export = Path(export)
    meta = read_drafter_metadata(export)
    if meta.get("stage") != "sft" or not meta.get("validation"):
        raise ValueError(f"{export}: not an SFT export with a validation curve (train with sft.val_prompts > 0)")
    cfg = load_config(config_file)
    out_dir = Path(cfg.resolve_path(cfg.output.dir))
    rdirs = responses_dirs(cfg)
    sup = [n for r in read_responses(rdirs[-1]) if (n := supervised_tokens(r, cfg.target.max_context)) >= 2] if rdirs else []
    # looked up at call time, so a repointed registry directory (tests repoint it) is honoured
    dest = published.PUBLISHED_DIR / name
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(export, tmp, ignore=shutil.ignore_patterns(published.RECORD_FILE))
    _store_bf16_if_exact(tmp / "model.safetensors")
    curve = [{k: p[k] for k in ("step", "tau", "drafter_flops")} for p in meta["validation"]["curve"]]
    record = {
        "name": name,
        "config_file": str(config_file),
        "config": Path(config_file).read_text(),
        "commit": source_commit(),
        "target_identity": meta.get("target_identity"),
        "target_dtype": meta.get("target_dtype"),
        # the precision the export was trained in (its own record), else the config's
        "training_dtype": (meta.get("precision") or {}).get("value", cfg.training.mixed_precision),
        "machine": meta.get("machine"),
        "samples": meta.get("samples"),
        "selected_step": meta["validation"]["selected_step"],
        "last_step": max(p["step"] for p in curve),
        "trained_positions": (trained_positions(meta["step"], sup, cfg.training.num_anchors, cfg.draft.block_size)
                              if sup else None),
        "flops": meta.get("flops"),
        "validation": {"prompts": meta["validation"]["val_prompts"], "select": meta["validation"]["select"],
                       "selected_tau": meta["validation"]["selected_tau"], "curve": curve,
                       # where the plateau rule stopped the run (None: stopped by a pause or the step cap)
                       "plateau_step": meta["validation"].get("plateau_step"),
                       "paused_at": meta["validation"].get("paused_at")},
    }
    record["earlier_stages"] = earlier_stages(cfg, earlier_configs)
    record["check"] = run_check(tmp, out_dir / "publish_check", check_overrides)
    (tmp / published.RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def cli(argv: Optional[list[str]] = None) -> int:
    """``publish``: publish an SFT export (prints the published directory); ``list``: the published drafters."""
    p = argparse.ArgumentParser(prog="python -m specforge_opd.stages.publish", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pub = sub.add_parser("publish", help="copy an SFT export into the package with its training record")
    pub.add_argument("--export", required=True)
    pub.add_argument("--config", required=True)
    # no default: a name is what users' configs resolve, and publishing over a shipped one replaces it
    pub.add_argument("--name", required=True, help="the drafter's name; say what changed (e.g. ...-b8-mixmath-l3)")
    pub.add_argument("--earlier-config", action="append", default=[], metavar="CONFIG",
                     help="the config of a stage before this one (repeat, in order): recorded with its text")
    sub.add_parser("list", help="list the published drafters")
    args = p.parse_args(argv)
    if args.cmd == "list":
        published.print_list()
        return 0
    print(publish(Path(args.export), Path(args.config), args.name,
                  earlier_configs=[Path(c) for c in args.earlier_config]))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
