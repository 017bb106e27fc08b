"""Bad input and faults end in one line that names the field or file and a fix, exit code 2, and lose nothing.

Every case runs through ``cli.main`` where a verb is involved (one line on stderr, exit
code 2) and checks that what was on disk before is still there. Tiny models built here;
no case loads the embedded target (``load_target`` is made to fail where a check must
come before it).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_opd.cli import main
from specforge_opd.config import ConfigError, load_config
from specforge_opd.errors import DiskFullError, UserError
from specforge_opd.models.drafter import save_drafter
from specforge_opd.rollout.shards import ShardWriter, read_shards, written_sample_ids

from conftest import make_tiny_drafter, make_tiny_target
from test_shards import META, make_record


def _run(capsys, argv: list[str]) -> int:
    capsys.readouterr()  # drop what the fixtures printed (progress bars)
    return main(argv)


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def no_target_load(monkeypatch):
    """Loading the target fails the test: the checks must come first."""
    import specforge_opd.models.target as target

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the input was checked")

    monkeypatch.setattr(target, "load_target", refuse)


@pytest.fixture
def tiny_dirs(tmp_path):
    """A tiny target saved as an HF directory and a drafter exported for it."""
    target = make_tiny_target()
    tdir = tmp_path / "target"
    target.save_pretrained(tdir)
    ddir = save_drafter(make_tiny_drafter(target), tmp_path / "drafter")
    return target, tdir, ddir


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------
# one base class, caught once


@pytest.mark.parametrize("override,field", [("data.num_prompts=-1", "data.num_prompts"), ("data.num_prompts=0", "data.num_prompts"),
                                            ("eval.num_prompts=0", "eval.num_prompts"), ("rollout.batch_size=0", "rollout.batch_size")])
@pytest.mark.parametrize("verb", ["opd", "distill", "rollout", "eval", "sft", "config"])
def test_bad_count_is_one_line_exit_2_for_every_verb(verb, override, field, capsys, no_target_load, tmp_path):
    extra = ["--shards", str(tmp_path)] if verb == "distill" else []
    assert _run(capsys, [verb, override, "--out", str(tmp_path / "o")] + extra) == 2
    _one_line_error(capsys, f"`{field}`", "greater than")
    assert not (tmp_path / "o").exists()


def test_every_count_field_has_bounds():
    """Every int field of the schema (seeds and ids aside) has a lower bound in the schema itself."""
    import typing

    from annotated_types import Ge, Gt

    from specforge_opd.config import ExperimentConfig, Section

    missing = []
    for sec_name, sec_field in ExperimentConfig.model_fields.items():
        sec = sec_field.annotation
        if not (isinstance(sec, type) and issubclass(sec, Section)):
            continue
        for name, f in sec.model_fields.items():
            ann = f.annotation
            ints = ann is int or (typing.get_origin(ann) is typing.Union and int in typing.get_args(ann))
            if not ints or "seed" in name:
                continue
            if not any(isinstance(m, (Ge, Gt)) for m in f.metadata):
                missing.append(f"{sec_name}.{name}")
    assert not missing, missing


def test_unexpected_exception_keeps_its_traceback(monkeypatch):
    import specforge_opd.cli as cli

    def boom(argv):
        raise RuntimeError("a bug, not bad input")

    monkeypatch.setitem(cli.COMMANDS, "config", ("test_bad_input:_boom", ""))
    monkeypatch.setattr(__import__("test_bad_input"), "_boom", boom, raising=False)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["config"])


def test_disk_full_from_anywhere_is_one_line(monkeypatch, capsys):
    import specforge_opd.cli as cli

    def full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/x/y.bin")

    monkeypatch.setitem(cli.COMMANDS, "config", ("test_bad_input:_full", ""))
    monkeypatch.setattr(__import__("test_bad_input"), "_full", full, raising=False)
    assert _run(capsys, ["config"]) == 2
    _one_line_error(capsys, "/x/y.bin", "no space left on device")


def test_overrides_after_a_flag(tmp_path):
    from specforge_opd.cli import experiment_parser, parse_experiment

    p = experiment_parser("opd")
    p.add_argument("--dry-run", action="store_true")
    args, cfg = parse_experiment(p, ["--dry-run", "data.num_prompts=5", "--out", str(tmp_path), "rollout.batch_size=3"])
    assert args.dry_run and cfg.data.num_prompts == 5 and cfg.rollout.batch_size == 3 and cfg.output.dir == str(tmp_path)


# ---------------------------------------------------------------------------
# checks before the target loads


def test_opd_without_drafter_fails_before_the_target(capsys, no_target_load, tmp_path):
    assert _run(capsys, ["opd", "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "draft.path is not set", "--drafter")


def test_missing_drafter_path(capsys, no_target_load, tmp_path):
    assert _run(capsys, ["opd", f"draft.path={tmp_path / 'nope'}", "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "draft.path", str(tmp_path / "nope"), "does not exist")


def test_drafter_of_another_hidden_size_names_its_path(capsys, no_target_load, tmp_path, tiny_dirs):
    _, tdir, _ = tiny_dirs
    other = save_drafter(make_tiny_drafter(make_tiny_target(hidden=32)), tmp_path / "other_drafter")
    before = _snapshot(other)
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={other}", "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, str(other), "hidden size 32 != target 64", "draft.path")
    assert _snapshot(other) == before


def test_drafter_missing_a_tensor(capsys, no_target_load, tmp_path, tiny_dirs):
    _, tdir, ddir = tiny_dirs
    w = load_file(str(ddir / "model.safetensors"))
    dropped = sorted(w)[0]
    del w[dropped]
    save_file(w, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={ddir}", "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, str(ddir), dropped)


def test_unwritable_output_dir(capsys, no_target_load, tmp_path, tiny_dirs):
    _, tdir, ddir = tiny_dirs
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={ddir}", "--out", str(blocker / "o")]) == 2
    _one_line_error(capsys, "output.dir", "not writable")
    assert blocker.read_text() == "keep me"


def test_unknown_prompt_source_before_the_target(capsys, no_target_load, tmp_path, tiny_dirs):
    _, tdir, ddir = tiny_dirs
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={ddir}", *TINY_SHAPE, "data.train_sources=[nope]",
                         "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "data.train_sources", "nope", "known:")


def test_source_limit_for_a_source_not_trained_on_before_the_target(capsys, no_target_load, tmp_path, tiny_dirs):
    _, tdir, ddir = tiny_dirs
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={ddir}", "data.source_limits={mbpp: 5}",
                         "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "data.source_limits", "mbpp", "not in data.train_sources")


#: the draft section that describes make_tiny_drafter's export
TINY_SHAPE = ["draft.num_hidden_layers=2", "draft.block_size=4"]


@pytest.mark.parametrize("override,named", [("draft.num_hidden_layers=1", "draft.num_hidden_layers is 1 but the drafter"),
                                            ("draft.block_size=8", "draft.block_size is 8 but the drafter"),
                                            ("draft.target_layer_ids=[0,3]", "draft.target_layer_ids is [0, 3] but the drafter")])
def test_config_that_misdescribes_the_start_drafter(override, named, capsys, no_target_load, tmp_path, tiny_dirs):
    """A 2-layer drafter under a config that says otherwise would size the memory plan and the FLOPs
    ledger wrongly with no error: it is refused before the target loads, naming the override that fixes it."""
    _, tdir, ddir = tiny_dirs
    shape = [o for o in TINY_SHAPE if o.split("=")[0] != override.split("=")[0]]
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={ddir}", *shape, override, "--out", str(tmp_path / "o")]) == 2
    line = _one_line_error(capsys, named, str(ddir))
    from specforge_opd.models.drafter import drafter_layer_ids, load_draft_config

    ids = ",".join(str(i) for i in drafter_layer_ids(load_draft_config(ddir)))
    fix = {"draft.num_hidden_layers": "draft.num_hidden_layers=2", "draft.block_size": "draft.block_size=4",
           "draft.target_layer_ids": f"draft.target_layer_ids=[{ids}]"}
    assert f"set {fix[override.split('=')[0]]} " in line


def test_hub_id_target_offline(capsys, monkeypatch, tmp_path, tiny_dirs):
    _, _, ddir = tiny_dirs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _run(capsys, ["rollout", "target.path=nobody-here/no-such-model", f"draft.path={ddir}", "data.train_sources=[mtbench]",
                 "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "target.path", "nobody-here/no-such-model")


# ---------------------------------------------------------------------------
# damaged shards: inspect and distill name the file; a resume heals


def _three_shards(d: Path) -> list[Path]:
    w = ShardWriter(d, META)
    return [w.write([make_record(f"s{i}a", 5, [0, 2]), make_record(f"s{i}b", 5, [1, 1])]) for i in range(3)]


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[-5] ^= 0xFF
    p.write_bytes(bytes(b))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:100])


@pytest.mark.parametrize("damage", [_flip, _truncate])
def test_inspect_and_distill_name_the_damaged_shard(damage, capsys, no_target_load, tmp_path, tiny_dirs):
    _, tdir, ddir = tiny_dirs
    paths = _three_shards(tmp_path / "spool")
    damage(paths[1])
    before = _snapshot(tmp_path / "spool")
    assert _run(capsys, ["inspect", str(tmp_path / "spool")]) == 2
    _one_line_error(capsys, str(paths[1]), "rerun the command that wrote it")
    assert _run(capsys, ["distill", "--shards", str(tmp_path / "spool"), "--drafter", str(ddir), f"target.path={tdir}",
                 "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, str(paths[1]), "rerun the command that wrote it")
    assert _snapshot(tmp_path / "spool") == before  # readers change nothing


def test_resume_moves_damaged_shards_aside_and_rolls_their_prompts_again(tmp_path, capsys):
    d = tmp_path / "spool"
    paths = _three_shards(d)
    _flip(paths[0])
    _truncate(paths[1])
    good = paths[2].read_bytes()
    w = ShardWriter(d, META)  # what a resumed rollout does first
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "shard-00000.safetensors: checksum mismatch" in err[0] and "bad-checksum" in err[0] and "rolled out again" in err[0]
    assert "shard-00001.safetensors: truncated" in err[1] and "bad-truncated" in err[1]
    assert (d / "shard-00000.safetensors.bad-checksum").is_file() and (d / "shard-00001.safetensors.bad-truncated").is_file()
    assert written_sample_ids(d) == {"s2a", "s2b"}  # the damaged shards' prompts are rolled out again
    assert paths[2].read_bytes() == good
    w.write([make_record("s0a", 5, [0, 2])])
    assert [r.sample_id for r in read_shards(d)] == ["s2a", "s2b", "s0a"]
    # a shard deleted by hand is unlisted, not a FileNotFoundError
    paths[2].unlink()
    ShardWriter(d, META)
    assert "listed in the manifest but missing" in capsys.readouterr().err
    assert written_sample_ids(d) == {"s0a"}


# ---------------------------------------------------------------------------
# a resume that refuses a changed config


def test_changed_config_is_refused_naming_fields_and_values(tmp_path):
    from specforge_opd.run_fingerprint import FILE, check_config_unchanged

    cfg = load_config(None, [f"output.dir={tmp_path}"])
    check_config_unchanged(cfg, tmp_path, "opd")
    recorded = (tmp_path / FILE).read_text()
    changed = load_config(None, [f"output.dir={tmp_path}", "training.learning_rate=1e-2", "rollout.temperature=0.7",
                                 "rollout.max_new_tokens=64", "target.threads=1", "opd.keep_shards=true"])
    with pytest.raises(ConfigError) as ei:
        check_config_unchanged(changed, tmp_path, "opd")
    msg = str(ei.value)
    assert "\n" not in msg and "--allow-config-change" in msg
    for part in ("training.learning_rate 0.0003 -> 0.01", "rollout.temperature 0.0 -> 0.7", "rollout.max_new_tokens 256 -> 64"):
        assert part in msg, msg
    assert "threads" not in msg and "keep_shards" not in msg  # these do not change the result
    assert (tmp_path / FILE).read_text() == recorded
    # on purpose: continues, records the change, and the new values become the reference
    diff = check_config_unchanged(changed, tmp_path, "opd", allow_change=True, log=lambda t: None)
    assert set(diff) == {"training.learning_rate", "rollout.temperature", "rollout.max_new_tokens"}
    rec = json.loads((tmp_path / FILE).read_text())
    assert rec["fields"]["training.learning_rate"] == 1e-2 and len(rec["changes"]) == 1
    assert check_config_unchanged(changed, tmp_path, "opd") is None


def test_auto_fields_are_compared_as_resolved(tmp_path, monkeypatch):
    """A resume on a machine that resolves ``auto`` differently (a GPU now) is refused, naming the field."""
    import specforge_opd.models.target as target
    from specforge_opd.run_fingerprint import check_config_unchanged

    cfg = load_config(None, [f"output.dir={tmp_path}"])
    check_config_unchanged(cfg, tmp_path, "distill")
    monkeypatch.setattr(target, "resolve_device", lambda d: "cuda:0" if d == "auto" else d)
    with pytest.raises(ConfigError, match=r"target.device cpu -> cuda.*training.mixed_precision fp32 -> bf16"):
        check_config_unchanged(cfg, tmp_path, "distill")


def test_opd_resume_with_changed_config_is_refused_and_keeps_the_run(tmp_path, capsys):
    from fault_hooks import FaultHooks, InjectedFault
    from test_opd import _setup

    from specforge_opd.stages.opd import run_opd

    cfg, bundle, prompts = _setup(tmp_path, "run")
    with pytest.raises(InjectedFault):
        run_opd(cfg, target=bundle, prompts=prompts, hooks=FaultHooks(after_shards=1))
    out = tmp_path / "run"
    before = _snapshot(out)
    changed = load_config(None, [f"{k}={v}" for k, v in [("output.dir", out), ("draft.path", cfg.draft.path)]] + [
        "draft.block_size=4", "draft.num_hidden_layers=2", "rollout.batch_size=2", "rollout.max_new_tokens=10",
        "opd.prompts_per_step=2", "opd.prompts_per_iteration=4", "training.checkpoint_interval=1", "output.tensorboard=false",
        "target.max_context=64", "training.learning_rate=1e-2"])
    with pytest.raises(ConfigError, match=r"training.learning_rate 0.0003 -> 0.01"):
        run_opd(changed, target=bundle, prompts=prompts)
    assert _snapshot(out) == before
    # a damaged shard of the interrupted rollout is healed by the resume
    shard = out / "spool" / "iter_000" / "shard-00000.safetensors"
    _flip(shard)
    with pytest.raises(InjectedFault):
        run_opd(cfg, target=bundle, prompts=prompts, hooks=FaultHooks(after_steps=1))
    assert "shard-00000.safetensors: checksum mismatch" in capsys.readouterr().err
    assert (shard.parent / "shard-00000.safetensors.bad-checksum").is_file()
    assert len(list(read_shards(shard.parent))) == 4
    # damaged after training began: healed, and the iteration's training starts over on the healed spool
    assert (out / "iter_000" / "train" / "checkpoints" / "latest").is_file()
    _flip(shard)  # its prompts come back last: the records' order changes
    final = run_opd(cfg, target=bundle, prompts=prompts)
    err = capsys.readouterr().err
    assert "shard-00000.safetensors: checksum mismatch" in err and "training restarts" in err
    rows = [json.loads(l) for l in (out / "opd_metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and all(r["train_steps"] == 2 for r in rows)
    assert (final / "model.safetensors").is_file()


# ---------------------------------------------------------------------------
# disk full: every writer names the path and leaves nothing partial


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_atomic_writer_disk_full(tmp_path):
    from specforge_opd.atomic import atomic_write, atomic_write_text

    p = tmp_path / "a.json"
    atomic_write_text(p, "old")
    with pytest.raises(DiskFullError) as ei:
        atomic_write(p, lambda f: (f.write(b"partial"), _enospc()))
    assert str(p) in str(ei.value) and "no space left on device" in str(ei.value)
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, UserError)
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                             "message: \"No space left on device\" })")])
def test_drafter_export_disk_full(tmp_path, monkeypatch, error):
    import specforge_opd.models.drafter as drafter_mod

    target = make_tiny_target()
    out = save_drafter(make_tiny_drafter(target), tmp_path / "final")
    before = _snapshot(out)

    def full(state, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise error

    monkeypatch.setattr(drafter_mod, "save_file", full)
    with pytest.raises(DiskFullError) as ei:
        save_drafter(make_tiny_drafter(target, seed=3), out)
    assert str(out) in str(ei.value) and "no space left on device" in str(ei.value)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")])
def test_checkpoint_disk_full(tmp_path, monkeypatch, error):
    from specforge_opd.train import checkpoint as ck

    model = make_tiny_drafter(make_tiny_target())
    opt = torch.optim.AdamW(model.parameters())
    first = ck.save_checkpoint(tmp_path, 1, model, opt, {"fingerprint": "f"})
    before = _snapshot(tmp_path)
    real = ck.dcp.save

    def full(state, checkpoint_id):
        real(state, checkpoint_id=checkpoint_id)  # writes its files, then the disk "fills"
        raise error

    monkeypatch.setattr(ck.dcp, "save", full)
    with pytest.raises(DiskFullError) as ei:
        ck.save_checkpoint(tmp_path, 2, model, opt, {"fingerprint": "f"})
    assert "step-000002" in str(ei.value) and "no space left on device" in str(ei.value)
    assert _snapshot(tmp_path) == before  # no .tmp left, the previous checkpoint intact
    assert ck.latest_checkpoint(tmp_path) == first


# ---------------------------------------------------------------------------
# checkpoint metadata is never unpickled freely


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_checkpoint_metadata_is_refused_without_running_it(tmp_path):
    from specforge_opd.train import checkpoint as ck
    from specforge_opd.train.safe_dcp import UnsafeCheckpointError

    model = make_tiny_drafter(make_tiny_target())
    opt = torch.optim.AdamW(model.parameters())
    step_dir = ck.save_checkpoint(tmp_path, 1, model, opt, {"fingerprint": "f"})
    ck.load_checkpoint(step_dir, model, opt)  # a real checkpoint loads through the allowlist
    marker = tmp_path / "pwned"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: names io\.open.*refused without running it"):
        ck.load_checkpoint(step_dir, model, opt)
    assert not marker.exists()


# ---------------------------------------------------------------------------
# exports readable by other users; quiet runs


def test_exports_follow_the_umask(tmp_path):
    from specforge_opd.atomic import atomic_write_text

    old = os.umask(0o022)
    try:
        out = save_drafter(make_tiny_drafter(make_tiny_target()), tmp_path / "final")
        atomic_write_text(tmp_path / "x.json", "{}")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    for f in list(out.iterdir()) + [tmp_path / "x.json"]:
        assert f.stat().st_mode & 0o777 == 0o644, f


def test_known_noise_is_silenced_and_other_warnings_are_not():
    import logging

    from specforge_opd.cli import quiet_known_noise

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        quiet_known_noise()
        warnings.warn("flash_attn is not found, falling back to flex_attention.", UserWarning)
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming ...", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in got] == ["something else"]
    rec = logging.LogRecord("transformers.tokenization_utils_base", logging.WARNING, "", 0,
                            "Token indices sequence length is longer than the specified maximum", None, None)
    assert not logging.getLogger("transformers.tokenization_utils_base").filter(rec)


@pytest.mark.parametrize("error", ["launcher.ServerError", "contract.ContractError", "wheel.WheelError"])
def test_sglang_faults_are_one_line(monkeypatch, capsys, error):
    """A server that does not start, a reply that breaks the contract, a wheel that cannot be fetched: one line
    naming the fix and exit 2, like every user-facing error."""
    import importlib

    import specforge_opd.cli as cli

    mod, name = error.split(".")
    cls = getattr(importlib.import_module(f"specforge_opd.sglang.{mod}"), name)

    def fail(argv):
        raise cls("field", "the problem") if name == "ContractError" else cls("SGLang server died; see its log")

    monkeypatch.setitem(cli.COMMANDS, "config", ("test_bad_input:_sglang_fail", ""))
    monkeypatch.setattr(__import__("test_bad_input"), "_sglang_fail", fail, raising=False)
    assert main(["config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_atomic_link_links_or_copies_and_never_leaves_a_partial_file(tmp_path, monkeypatch):
    from specforge_opd import atomic

    src = tmp_path / "a.bin"
    src.write_bytes(b"features")
    atomic.atomic_link(src, tmp_path / "sub" / "b.bin")
    assert (tmp_path / "sub" / "b.bin").stat().st_ino == src.stat().st_ino
    # linking again onto the same file (rename between two links of one file does nothing) leaves no temp file
    atomic.atomic_link(src, tmp_path / "sub" / "b.bin")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["b.bin"]
    # where the filesystem links nothing, an atomic copy with the same bytes
    def no_link(*a, **k):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    atomic.atomic_link(src, tmp_path / "c.bin")
    assert (tmp_path / "c.bin").read_bytes() == b"features" and (tmp_path / "c.bin").stat().st_ino != src.stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "c.bin", "sub"]


def test_draft_fields_left_at_their_defaults_take_the_drafter_as_it_is(capsys, no_target_load, tmp_path, tiny_dirs):
    """A bare draft.path (no draft.* set; the schema's defaults say 1 layer, block 16) is not compared."""
    _, tdir, ddir = tiny_dirs
    assert _run(capsys, ["opd", f"target.path={tdir}", f"draft.path={ddir}", "data.train_sources=[nope]",
                         "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "data.train_sources", "nope")  # past the drafter check, at the next one
