"""The one rollout loop (``rollout.driver.drive``) over any ``RolloutBackend``, and the one place that picks the
backend from ``rollout.backend`` (``stages.rollout``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specforge_opd.config import load_config
from specforge_opd.models.drafter import save_drafter
from specforge_opd.models.target import TargetBundle
from specforge_opd.rollout.driver import EmbeddedBackend, drive
from specforge_opd.rollout.engine import SpeculativeEngine
from specforge_opd.rollout.shards import MANIFEST, ShardWriter, read_shards
from specforge_opd.sglang.rollout_backend import SGLangBackend
from specforge_opd.stages import opd
from specforge_opd.stages import rollout as rollout_stage

from conftest import make_tiny_drafter, make_tiny_target
from test_shards import META, make_record

PROMPTS = [(f"p{i}", [5 + i, 6, 7]) for i in range(5)]


class ListBackend:
    """A backend that is neither the engine nor SGLang (a new server would look like this): it writes one
    fixed record per prompt, ``per`` to a shard, and remembers what it was asked to roll out."""

    name = "list"
    skipped: tuple = ()

    def __init__(self, per: int = 2, fail_after: int | None = None):
        self.per, self.fail_after, self.asked = per, fail_after, []

    def roll_out(self, prompts, writer, *, drafter_step, on_write):
        self.asked.append([sid for sid, _ in prompts])
        for i in range(0, len(prompts), self.per):
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError("server died")
            recs = [make_record(sid, 3, [1, 0], seed=int(sid[1:])) for sid, _ in prompts[i:i + self.per]]
            writer.write(recs)
            on_write(recs)


def test_drive_counts_writes_and_calls_back_per_shard(tmp_path):
    seen = []
    run = drive(ListBackend(per=2), PROMPTS, ShardWriter(tmp_path, META), on_write=lambda recs: seen.append(len(recs)),
                quiet=True)
    assert seen == [2, 2, 1]
    assert (run.prompts, run.resumed, run.sequences, run.shards, run.skipped) == (5, 0, 5, 3, 0)
    # each record: 2 blocks, 1 + 0 accepted plus a bonus token each -> 3 completion tokens
    assert (run.verify_steps, run.completion_tokens) == (10, sum(r.completion_tokens for r in read_shards(tmp_path)))
    assert run.tau == pytest.approx(run.completion_tokens / 10)
    assert sorted(r.sample_id for r in read_shards(tmp_path)) == [s for s, _ in PROMPTS]


def test_drive_resumes_from_the_shards_written_before_a_failure(tmp_path, capsys):
    failing = ListBackend(per=2, fail_after=2)
    with pytest.raises(RuntimeError, match="server died"):
        drive(failing, PROMPTS, ShardWriter(tmp_path, META), quiet=True)
    again = ListBackend(per=2)
    run = drive(again, PROMPTS, ShardWriter(tmp_path, META))
    assert again.asked == [["p2", "p3", "p4"]]  # the first shard's two sequences are not rolled out again
    assert (run.resumed, run.sequences) == (2, 3)
    assert "2 of 5 sequences already written" in capsys.readouterr().err
    done = ListBackend()
    run = drive(done, PROMPTS, ShardWriter(tmp_path, META), quiet=True)
    assert done.asked == [] and (run.resumed, run.sequences, run.tau, run.tokens_per_s) == (5, 0, 0.0, None)


def test_make_backend_is_the_one_branch_on_rollout_backend(tmp_path):
    class Engine:
        drafter = object()
        skipped: list = []

    engine = Engine()
    emb = rollout_stage.make_backend(load_config(None, ["rollout.batch_size=3"]), None, engine, per=5, draft_path=None,
                                     log_dir=tmp_path)
    assert isinstance(emb, EmbeddedBackend) and (emb.per, emb.batch_size, emb.name) == (5, 3, "embedded")
    for name in ("sglang_verify", "sglang_native"):
        b = rollout_stage.make_backend(load_config(None, [f"rollout.backend={name}"]), None, engine, per=3,
                                       draft_path="d", log_dir=tmp_path)
        assert isinstance(b, SGLangBackend) and b.name == name and b.drafter is engine.drafter and b.draft_path == "d"
    cfg = load_config(None, [])
    object.__setattr__(cfg.rollout, "backend", "vllm")  # past the schema, as a new backend's first draft would be
    with pytest.raises(ValueError, match="rollout.backend='vllm'"):
        rollout_stage.make_backend(cfg, None, engine, per=3, draft_path=None, log_dir=tmp_path)


def test_response_generator_sends_sft_responses_to_sglang_only_when_configured(monkeypatch):
    assert rollout_stage.response_generator(load_config(None, [])) is None
    calls = []
    monkeypatch.setattr("specforge_opd.sglang.generate.sglang_generate", lambda urls, prompts, **kw: calls.append((urls, prompts, kw)) or [[1]])
    cfg = load_config(None, ["rollout.backend=sglang_verify", "sglang.urls=[http://127.0.0.1:9]", "sglang.request_timeout_s=7"])
    gen = rollout_stage.response_generator(cfg)
    assert gen([[3, 4]], sample_ids=["a"], max_new_tokens=2, stop_token_ids=[1], temperature=0.0, seed=5) == [[1]]
    assert calls == [(["http://127.0.0.1:9"], [[3, 4]], dict(timeout_s=7, sample_ids=["a"], max_new_tokens=2,
                                                                stop_token_ids=[1], temperature=0.0, seed=5))]


def _shard_sizes(d) -> list[int]:
    return [e["sequences"] for e in json.loads((d / MANIFEST).read_text())["shards"]]


def test_shard_sizes_of_the_verb_and_of_an_opd_iteration(tmp_path, monkeypatch):
    """The ``rollout`` verb writes ``rollout.sequences_per_shard`` sequences to a shard; an OPD iteration's
    embedded rollout writes ``rollout.batch_size`` (one shard per batch, which the spool budget counts)."""
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    ddir = save_drafter(drafter, tmp_path / "drafter")
    bundle = TargetBundle(model=target, tokenizer=None, path=tmp_path, identity="tiny", stop_token_ids=[1])
    monkeypatch.setattr("specforge_opd.models.target.load_target", lambda tcfg: bundle)
    cfg = load_config(None, [f"draft.path={ddir}", "rollout.max_new_tokens=6", "rollout.teacher=token", "target.max_context=64",
                             "rollout.batch_size=2", "rollout.sequences_per_shard=3"])
    rollout_stage.run_rollout(cfg, tmp_path / "verb", prompts=PROMPTS)
    assert _shard_sizes(tmp_path / "verb") == [3, 2]
    engine = SpeculativeEngine(target, drafter, cfg.rollout, stop_token_ids=[1], mask_token_id=96, max_context=64)
    seen = []

    class Hooks:
        def after_shard(self, n):
            seen.append(n)

    ro = opd.rollout_phase(cfg, engine, bundle, PROMPTS, tmp_path / "opd", opd._rollout_meta(cfg, bundle, drafter, ddir, 0, 0), 0,
                           hooks=Hooks())
    assert _shard_sizes(tmp_path / "opd") == [2, 2, 1] and seen == [1, 2, 3]
    assert (ro["sequences"], ro["healed"], ro["skipped_too_long"]) == (5, 0, 0)


def test_embedded_stages_import_without_the_sglang_extra():
    """``aiohttp`` comes with the optional ``sglang`` extra: the SFT, OPD, rollout and comparison stages import
    without it, and only choosing an SGLang backend needs it."""
    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "import specforge_opd.stages.sft, specforge_opd.stages.opd, specforge_opd.stages.rollout, specforge_opd.stages.compare\n"
            "assert 'specforge_opd.sglang.verify_client' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
