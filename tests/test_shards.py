"""Shard format: round trip, checksums, compatibility, atomicity under a full disk (issue 3)."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from specforge_opd.rollout import shards
from specforge_opd.rollout.records import TEACHER_TENSORS, RolloutRecord, Teacher
from specforge_opd.rollout.shards import ShardError, ShardWriter, inspect_dir, read_shards, shard_meta
from specforge_opd.teacher_form import TEACHER_FORMS

BS = 4
META = {"block_size": BS, "target_layer_ids": [1, 2], "target_identity": "abc123", "mask_token_id": 96, "teacher": "topk",
        "target_dtype": "float32"}


def make_record(sid: str, prompt_len: int, accepted: list[int], form: str = "topk", features: bool = True, seed: int = 0) -> RolloutRecord:
    """A record obeying the anchor recurrence, ending with the last block's bonus token."""
    g = torch.Generator().manual_seed(seed)
    M = len(accepted)
    anchors = [prompt_len]
    for r in accepted[:-1]:
        anchors.append(anchors[-1] + r + 1)
    T = anchors[-1] + accepted[-1] + 2
    ids = torch.randint(0, 90, (T,), generator=g)
    drafts = torch.randint(0, 90, (M, BS - 1), generator=g)
    feats = torch.randn(T - 1, 8, generator=g) if features else None
    teacher = {}
    if form == "full":
        teacher["teacher_hidden"] = torch.randn(M, BS - 1, 4, generator=g)
    if form == "topk":
        teacher["teacher_topk_ids"] = torch.randint(0, 90, (M, BS - 1, 3), generator=g)
        teacher["teacher_topk_logprobs"] = -torch.rand(M, BS - 1, 3, generator=g)
    if form in ("topk", "token"):
        teacher["teacher_draft_logprob"] = -torch.rand(M, BS - 1, generator=g)
    rec = RolloutRecord(
        sample_id=sid,
        input_ids=ids,
        prompt_len=prompt_len,
        anchors=torch.tensor(anchors),
        drafts=drafts,
        accepted=torch.tensor(accepted),
        features=feats,
        finished=bool(seed % 2),
        drafter_step=7,
        **teacher,
    )
    rec.validate()
    return rec


def _same(a: RolloutRecord, b: RolloutRecord):
    assert a.sample_id == b.sample_id and a.prompt_len == b.prompt_len and a.finished == b.finished
    assert a.drafter_step == b.drafter_step and a.teacher_form() == b.teacher_form()
    for name in ("input_ids", "anchors", "drafts", "accepted", "features", "teacher_hidden", "teacher_topk_ids",
                 "teacher_topk_logprobs", "teacher_draft_logprob"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("form,features", [("full", True), ("topk", True), ("token", False)])
def test_round_trip(tmp_path, form, features):
    w = ShardWriter(tmp_path, dict(META, teacher=form))
    batch1 = [make_record("a", 5, [0, 2, 3], form, features, 1), make_record("b", 3, [1], form, features, 2)]
    batch2 = [make_record("c", 9, [3, 3, 0, 1], form, features, 3)]
    p1, p2 = w.write(batch1), w.write(batch2)
    assert p1.name == "shard-00000.safetensors" and p2.name == "shard-00001.safetensors"
    back = list(read_shards(tmp_path, expect=META))
    assert len(back) == 3
    for a, b in zip(batch1 + batch2, back):
        _same(a, b)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["schema_version"] == shards.SCHEMA_VERSION
    assert [s["file"] for s in man["shards"]] == [p1.name, p2.name]
    assert man["shards"][0]["sequences"] == 2 and man["shards"][0]["blocks"] == 4
    assert shard_meta(tmp_path)["target_identity"] == "abc123"


def test_teacher_is_one_tagged_value():
    """A record holds one ``Teacher`` of one form; the four ``teacher_*`` keywords build it and read it back."""
    assert set(TEACHER_TENSORS) == set(TEACHER_FORMS) and shards._TEACHER == TEACHER_TENSORS["full"] + TEACHER_TENSORS["topk"]
    for form in TEACHER_FORMS:
        rec = make_record("a", 5, [0, 2], form)
        assert rec.teacher.form == rec.teacher_form() == form
        assert tuple(rec.teacher.tensors()) == TEACHER_TENSORS[form]
        assert all((getattr(rec, n) is not None) == (n in TEACHER_TENSORS[form]) for n in shards._TEACHER)
        again = RolloutRecord(rec.sample_id, rec.input_ids, rec.prompt_len, rec.anchors, rec.drafts, rec.accepted, teacher=rec.teacher)
        assert again.teacher is rec.teacher
    with pytest.raises(AttributeError):
        rec.teacher_draft_logprob = None  # read-only: replace the teacher as a whole
    with pytest.raises(ValueError, match="no teacher form's set"):
        Teacher.of(teacher_topk_ids=torch.zeros(2, BS - 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="the topk teacher holds"):
        Teacher("topk", draft_logprob=torch.zeros(2, BS - 1))
    with pytest.raises(ValueError, match="not both"):
        RolloutRecord("a", rec.input_ids, 5, rec.anchors, rec.drafts, rec.accepted, teacher_hidden=torch.zeros(2, BS - 1, 4),
                      teacher=rec.teacher)
    assert Teacher.of() is None and make_record("a", 5, [0, 2], "none").teacher is None


def test_inspect_summary_numbers(tmp_path, capsys):
    from specforge_opd.cli import main

    recs = [make_record("a", 5, [0, 2, 3]), make_record("b", 3, [1])]
    ShardWriter(tmp_path, META).write(recs)
    s = inspect_dir(tmp_path)
    # a: T = 5 + (0+1) + (2+1) + (3+2) = 14, completion 9 over 3 blocks; b: T = 3 + 1 + 2 = 6, completion 3 over 1
    assert s["sequences"] == 2 and s["tokens"] == 20 and s["blocks"] == 4
    assert s["completion_tokens"] == 12
    assert s["tau"] == pytest.approx(12 / 4)
    assert s["accepted_histogram"] == [1, 1, 1, 1]  # r+1 = 1, 3, 4 (a) and 2 (b)
    assert s["bytes_per_token"] == pytest.approx(s["bytes"] / 20)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks"] == 4
    assert main(["inspect", str(tmp_path)]) == 0
    assert "tau 3.000" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_shard_is_refused(tmp_path, damage):
    w = ShardWriter(tmp_path, META)
    w.write([make_record("a", 5, [0, 2])])
    p = w.write([make_record("b", 5, [1, 1])])
    data = bytearray(p.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    p.write_bytes(bytes(data))
    it = read_shards(tmp_path)
    assert next(it).sample_id == "a"
    with pytest.raises(ShardError, match=r"shard-00001\.safetensors: checksum mismatch"):
        next(it)
    with pytest.raises(ShardError, match="shard-00001"):
        inspect_dir(tmp_path)


@pytest.mark.parametrize("key,value", [("block_size", 16), ("target_layer_ids", [2, 1]), ("target_identity", "zzz"), ("mask_token_id", 5),
                                       ("target_dtype", "bfloat16")])
def test_incompatible_expect_names_shard_and_field(tmp_path, key, value):
    ShardWriter(tmp_path, META).write([make_record("a", 5, [0, 2])])
    with pytest.raises(ShardError, match=rf"shard-00000\.safetensors: incompatible.*{key}"):
        list(read_shards(tmp_path, expect={key: value}))
    with pytest.raises(ShardError, match=key):
        ShardWriter(tmp_path, dict(META, **{key: value}))


def test_full_disk_removes_partial_shard_and_keeps_earlier(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, META)
    w.write([make_record("a", 5, [0, 2])])
    before = sorted(p.name for p in tmp_path.iterdir())

    def full_disk(f, data):
        f.write(data[: len(data) // 3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "_write_bytes", full_disk)
    with pytest.raises(OSError, match="no space left on device.*partial shard was removed") as ei:
        w.write([make_record("b", 5, [1, 1])])
    assert ei.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    monkeypatch.undo()
    assert [r.sample_id for r in read_shards(tmp_path)] == ["a"]
    # the writer recovers once there is space again
    w.write([make_record("c", 5, [1, 1])])
    assert [r.sample_id for r in read_shards(tmp_path)] == ["a", "c"]


def test_full_disk_while_writing_manifest(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, META)
    w.write([make_record("a", 5, [0, 2])])
    real = shards._write_bytes
    calls = {"n": 0}

    def fail_second(f, data):
        calls["n"] += 1
        if calls["n"] == 2:  # the shard lands, the manifest does not
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)

    monkeypatch.setattr(shards, "_write_bytes", fail_second)
    with pytest.raises(OSError):
        w.write([make_record("b", 5, [1, 1])])
    assert not (tmp_path / "shard-00001.safetensors").exists()
    assert [r.sample_id for r in read_shards(tmp_path)] == ["a"]


def test_other_schema_version_is_refused(tmp_path):
    ShardWriter(tmp_path, META).write([make_record("a", 5, [0, 2])])
    man = json.loads((tmp_path / "manifest.json").read_text())
    man["schema_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ShardError, match="schema version 99"):
        ShardWriter(tmp_path, META)
    with pytest.raises(ShardError, match="schema version 99"):
        list(read_shards(tmp_path))
    # stray shards of another schema and no manifest
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(other / "shard-00000.safetensors"), metadata={"schema_version": "0"})
    with pytest.raises(ShardError, match="schema '0'"):
        ShardWriter(other, META)


def test_missing_manifest(tmp_path):
    with pytest.raises(ShardError, match="no manifest.json"):
        list(read_shards(tmp_path))


def test_inconsistent_records_in_one_shard(tmp_path):
    w = ShardWriter(tmp_path, META)
    with pytest.raises(ShardError, match="teacher form"):
        w.write([make_record("a", 5, [0], "topk"), make_record("b", 5, [0], "full")])


def test_shard_meta_is_built_in_one_place_with_the_historical_keys(tmp_path):
    """The standalone rollout and an OPD iteration build their meta with ``ShardMeta.of_rollout``: the keys
    (and their order) the shard files have always stored, the OPD iteration's seed offset, and a writer that
    takes the typed meta stores the same dict."""
    from specforge_opd.config import load_config
    from specforge_opd.rollout.shard_meta import ShardMeta

    cfg = load_config(None, ["rollout.seed=5", "rollout.teacher=topk"])
    common = dict(target_identity="t", drafter_identity="d", drafter_step=3, block_size=4,
                  target_layer_ids=[1, 2], mask_token_id=9)
    standalone = ShardMeta.of_rollout(cfg, **common).to_dict()
    assert list(standalone) == ["target_identity", "drafter_identity", "drafter_step", "block_size", "target_layer_ids",
                                "mask_token_id", "temperature", "top_p", "top_k", "seed", "teacher", "anchors",
                                "features", "thinking", "target_dtype"]
    assert standalone["seed"] == 5 and standalone["teacher"] == "topk"
    it2 = ShardMeta.of_rollout(cfg, **common, iteration=2).to_dict()
    assert list(it2)[-2:] == ["iteration", "target_dtype"] and it2["seed"] == 7 and it2["iteration"] == 2
    w = ShardWriter(tmp_path / "s", ShardMeta.of_rollout(cfg, **common, iteration=2))
    assert w.meta == it2
