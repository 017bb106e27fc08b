"""The ``specforge-opd`` command: one verb per job (DESIGN.md section 2).

Each verb's function here parses its flags and the config, runs the checks that
come before anything loads (``stages.preflight``), and calls the plain function
of the module that owns the job. It imports that module inside its body, so
``--help`` and ``specforge-opd config`` do not pay for importing torch. A verb's
function takes the remaining argv and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

from specforge_opd.config import ConfigError, ExperimentConfig, load_config
from specforge_opd.errors import USER_ERROR_EXIT, UserError, is_disk_full, one_line

#: verb -> "module:function" (function(argv: list[str]) -> int)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-assets": ("specforge_opd.cli:prepare_assets_cmd", "convert the embedded target and unpack offline prompt sets"),
    "config": ("specforge_opd.cli:config_cmd", "print the resolved experiment config"),
    "sft": ("specforge_opd.cli:sft_cmd", "the SFT stage on SpecForge (responses, features, train, export)"),
    "rollout": ("specforge_opd.cli:rollout_cmd", "one speculative rollout pass to shards"),
    "inspect": ("specforge_opd.cli:inspect_cmd", "validate and summarize a shard directory"),
    "distill": ("specforge_opd.cli:distill_cmd", "the OPD trainer over shards"),
    "opd": ("specforge_opd.cli:opd_cmd", "the whole iterated OPD stage"),
    "eval": ("specforge_opd.cli:eval_cmd", "accepted length (tau) and speedup per dataset"),
}


def experiment_parser(prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with the shared ``-c FILE``, overrides and ``--out`` shorthand.

    ``parse_experiment`` parses it with ``parse_intermixed_args``, so overrides may come
    after flags (``--dry-run a.b=1``).
    """
    p = argparse.ArgumentParser(prog=f"specforge-opd {prog}", description=description)
    p.add_argument("-c", "--config", help="experiment YAML (configs/<exp>/<stage>.yaml)")
    p.add_argument("--out", help="shorthand for output.dir; wins over YAML and overrides")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    return p


def parse_experiment(
    parser: argparse.ArgumentParser, argv: list[str], extra_flags: Optional[Callable] = None
) -> tuple[argparse.Namespace, ExperimentConfig]:
    """Parse argv with ``parser`` (overrides may follow flags) and load the config.

    Every verb comes through here, so this is where a process's torch threads are set
    (``target.apply_threads(target.threads)``).

    Raises:
        ConfigError: a bad file, key or value (``main`` prints it as one line, exit code 2).
    """
    args = parser.parse_intermixed_args(argv)
    flags = {"output.dir": args.out}
    if extra_flags is not None:
        flags.update(extra_flags(args))
    cfg = load_config(args.config, args.overrides, flags)  # ConfigError: one line from main
    from specforge_opd.models.target import apply_threads

    apply_threads(cfg.target.threads)
    return args, cfg


def config_cmd(argv: list[str]) -> int:
    from specforge_opd.config import dump_config

    _, cfg = parse_experiment(experiment_parser("config", "print the resolved config"), argv)
    print(dump_config(cfg), end="")
    return 0


def prepare_assets_cmd(argv: list[str]) -> int:
    """``specforge-opd prepare-assets [--cache DIR]``: prints what it did and how long it took."""
    from specforge_opd.data import prepare
    from specforge_opd.data.locations import CACHE_ENV, cache_dir

    p = argparse.ArgumentParser(prog="specforge-opd prepare-assets", description=prepare.prepare_assets.__doc__)
    p.add_argument("--cache", help=f"cache directory (default ${CACHE_ENV} or ~/.cache/specforge_opd)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rep = prepare.prepare_assets(args.cache)  # AssetError / PromptsError: reported by main
    print(f"target: {rep['target']} ({rep['seconds']['target']:.2f} s)")
    for name, n in rep["sources"].items():
        print(f"prompts {name}: {n} records ({rep['seconds'][name]:.2f} s)")
    print(f"total: {rep['seconds']['total']:.2f} s; cache {cache_dir(args.cache)}")
    return 0


def inspect_cmd(argv: list[str]) -> int:
    """``specforge-opd inspect DIR [--json]``: validate a shard directory and print its summary."""
    from specforge_opd.rollout import shards

    p = argparse.ArgumentParser(prog="specforge-opd inspect", description="validate and summarize a shard directory")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    s = shards.inspect_dir(args.dir)  # a ShardError is reported by main (one line, exit 2)
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True))
        return 0
    m = s["meta"]
    print(f"{s['dir']}: {s['shards']} shards (schema {s['schema_version']}), all checksums OK")
    print(f"  sequences {s['sequences']}  tokens {s['tokens']}  completion tokens {s['completion_tokens']}  blocks {s['blocks']}")
    print(f"  tau {s['tau']:.3f}  bytes {s['bytes']}  bytes/token {s['bytes_per_token']:.1f}")
    print(f"  block_size {m.get('block_size')}  layer ids {m.get('target_layer_ids')}  teacher {m.get('teacher')}  "
          f"anchors {m.get('anchors')}  T={m.get('temperature')}  drafter steps {s['drafter_steps']}")
    hist = s["accepted_histogram"]
    tot = sum(hist) or 1
    print("  accepted length (r+1): " + "  ".join(f"{i + 1}:{h} ({100 * h / tot:.0f}%)" for i, h in enumerate(hist) if h))
    if s["unlisted"]:
        print(f"  unlisted files (ignored: incomplete writes, or damaged shards a resume moved aside): {', '.join(s['unlisted'])}")
    return 0


def _parse_drafters(values: list[str]) -> dict[str, Path]:
    """``--drafter DIR`` or ``NAME=DIR`` values -> {name: dir}; a bare DIR is named after its last part.

    Raises:
        ConfigError: one name given twice.
    """
    out: dict[str, Path] = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = Path(v).name or v, v
        if name in out:
            raise ConfigError(f"--drafter name `{name}` given twice; use NAME=DIR to tell them apart")
        out[name] = Path(path)
    return out


def eval_cmd(argv: list[str]) -> int:
    """``specforge-opd eval -c CFG --drafter DIR [--drafter NAME=DIR ...] [overrides] [--out DIR]``."""
    from specforge_opd.eval import evaluate as ev

    p = experiment_parser("eval", "accepted length (tau) and speedup per dataset; writes eval.json, eval.md, plots")
    p.add_argument("--drafter", action="append", default=[], help="drafter HF directory, or NAME=DIR; repeat to compare")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results in output.dir even when they are of other drafters")
    args, cfg = parse_experiment(p, argv)
    drafters = _parse_drafters(args.drafter)
    if not drafters and cfg.draft.path:
        drafters = {"draft": Path(cfg.draft.path)}
    out = Path(cfg.output.dir)
    if not args.overwrite:
        ev.check_results_free(out, drafters)
    ev.evaluate(cfg, drafters, out)  # a UserError is reported by main (one line, exit 2)
    print((out / "eval.md").read_text())
    print(f"wrote {out / 'eval.json'}")
    return 0


def _rank0() -> bool:
    """Whether this process is torchrun's rank 0 (or runs alone): the one that prints the verb's summary."""
    return int(os.environ.get("RANK", "0")) == 0


def distill_cmd(argv: list[str]) -> int:
    """``specforge-opd distill -c CFG --shards DIR [--shards DIR ...] --drafter DIR --out DIR``."""
    from specforge_opd.stages import preflight
    from specforge_opd.train import trainer

    p = experiment_parser("distill", "the OPD trainer over rollout shards (run under torchrun for FSDP2)")
    p.add_argument("--shards", action="append", required=True, help="shard directory (repeat for several)")
    p.add_argument("--drafter", help="initial drafter, an HF DFlash directory (default draft.path)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints under --out")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume although the config changed since the run started (recorded in run_fingerprint.json)")
    args, cfg = parse_experiment(p, argv)
    preflight.before_distill(cfg, args.shards, args.drafter, resume=not args.no_resume,
                             allow_config_change=args.allow_config_change)
    res = trainer.distill(cfg, args.shards, args.drafter, None, resume=not args.no_resume)
    if _rank0():
        if res.already_complete:
            print(f"already complete at step {res.step}/{res.total_steps}: nothing trained; export {res.export_dir}")
        else:
            print(f"trained {res.steps_run} steps ({res.step}/{res.total_steps}); export {res.export_dir}")
    return 0


def rollout_cmd(argv: list[str]) -> int:
    """``specforge-opd rollout -c CFG [overrides] --out DIR``: one rollout pass over the prompt pool to shards."""
    from specforge_opd.stages import preflight, rollout

    parser = experiment_parser("rollout", "one speculative rollout pass to shards")
    parser.add_argument("--drafter-step", type=int, default=0, help="optimizer step of the drafter (stored in shards)")
    args, cfg = parse_experiment(parser, argv)
    preflight.check_before_target(cfg)  # output dir, drafter, prompt sources: before the target loads
    return rollout.run_rollout(cfg, out_dir=cfg.output.dir, drafter_step=args.drafter_step)


def sft_cmd(argv: list[str]) -> int:
    """``specforge-opd sft -c CFG [section.field=value ...] [--dry-run] [--out DIR]``."""
    from specforge_opd.stages import preflight, sft

    parser = experiment_parser("sft", "the SFT stage on SpecForge (responses, features, train, export)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, draft config and estimates; load nothing")
    args, cfg = parse_experiment(parser, argv)
    if args.dry_run:
        sft.dry_run(cfg)
        return 0
    preflight.check_writable(cfg.output.dir)  # before the target loads
    preflight.check_prompt_sources(cfg)
    if cfg.sft.init_drafter:
        preflight.check_drafter(cfg, cfg.sft.init_drafter, field="sft.init_drafter")
    sft.run_sft(cfg)  # a UserError (SFTError, DrafterError, ...) is reported by main
    return 0


def opd_cmd(argv: list[str]) -> int:
    """``specforge-opd opd -c CFG [overrides] [--dry-run] [--out DIR]``."""
    from specforge_opd.stages import opd, preflight

    p = experiment_parser("opd", "the iterated OPD stage: rollout -> shards -> distill -> export, repeated")
    p.add_argument("--dry-run", action="store_true", help="print the plan (schedule, spool, drafter) and exit")
    p.add_argument("--drafter", help="shorthand for draft.path (initial drafter)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume although the config changed since the run started (recorded in run_fingerprint.json)")
    args, cfg = parse_experiment(p, argv, lambda a: {"draft.path": a.drafter})
    if args.dry_run:
        opd.dry_run(cfg)
        return 0
    preflight.check_before_target(cfg)  # output dir, drafter, prompt sources: before the target loads
    final = opd.run_opd(cfg, allow_config_change=args.allow_config_change)
    if _rank0():
        print(f"OPD done: final drafter {final}; report {Path(cfg.output.dir) / 'report.md'}")
    return 0

#: Messages every run printed that say nothing about this run: SpecForge's import-time flash_attn
#: fallback (the drafter uses sdpa/flex here), DCP's single-process note, the LR scheduler's
#: note on ``get_lr`` inside ``step``.
_NOISE = (
    "flash_attn is not found",
    "torch.distributed is disabled, unavailable or uninitialized",
    "To get the last learning rate computed by the scheduler",
)


class _DropTokenLengthNote(logging.Filter):
    """transformers' "Token indices sequence length is longer than ..." note: prompts over the tokenizer's
    nominal length are measured against ``target.max_context`` and skipped or refused with their own message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token indices sequence length" not in record.getMessage()


def quiet_known_noise() -> None:
    """Silence the warnings that every run printed (``_NOISE``); any other warning still shows."""
    for text in _NOISE:
        warnings.filterwarnings("ignore", message=f".*{text}")
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_DropTokenLengthNote())


def main(argv: Optional[list[str]] = None) -> int:
    """Run one verb; returns its exit code.

    A ``UserError`` from any verb (``errors.UserError``: bad config, path, file, a full
    disk) ends in one line on stderr and exit code 2; so does any other write that failed
    for a full disk. Any other exception keeps its traceback. Ctrl-C exits with 130.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: specforge-opd VERB [-c CONFIG] [section.field=value ...]\n\nverbs:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:15s} {help_}")
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(verb, COMMANDS, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        print(f"error: unknown verb `{verb}`{hint}; known: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    quiet_known_noise()
    mod_name, fn_name = COMMANDS[verb][0].split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    try:
        return int(fn(rest) or 0)
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return USER_ERROR_EXIT
    except Exception as e:
        if not is_disk_full(e):
            raise
        # a writer this package does not wrap (a library's own file): still one line
        where = getattr(e, "filename", None) or "a file under output.dir"
        print(f"error: {where}: no space left on device ({one_line(str(e))[:200]}); free space "
              f"(or set output.dir on a larger disk) and rerun the same command", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("interrupted; finished work is kept and the same command resumes", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
