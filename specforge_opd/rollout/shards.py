"""The rollout shard format: versioned, checksummed, written atomically (DESIGN.md section 2).

A shard directory holds::

    manifest.json                 written last; lists only complete shards
    shard-00000.safetensors       one file per ``ShardWriter.write`` call
    ...

``manifest.json``::

    {"schema_version": 1,
     "meta": {...},                       # the first writer's meta (see below)
     "shards": [{"file", "sha256", "bytes", "sequences", "tokens",
                 "completion_tokens", "blocks", "meta"}, ...]}

``meta`` (per shard, and the directory's in the manifest): ``rollout.shard_meta.ShardMeta``'s
dict (``target_identity``, ``drafter_identity``, ``drafter_step``, ``block_size``, ``target_layer_ids``,
``mask_token_id``, ``target_dtype``, the sampler, ``seed``, ``teacher`` (full/topk/token),
``anchors`` (real/random), ...). Shards in one
directory must agree on ``COMPAT_KEYS``.

Each shard is one safetensors file whose tensors are the records' tensors
concatenated (``seq_offsets[i]..seq_offsets[i+1]`` index sequence i's tokens,
``block_offsets`` its blocks, ``feat_offsets`` its feature rows = T_i - 1):

    input_ids int64 [sum T]          prompt_len int64 [N]     finished uint8 [N]
    drafter_step int64 [N]           anchors int64 [sum M]    accepted int64 [sum M]
    drafts int64 [sum M, bs-1]       features [sum (T-1), n*H]          (optional)
    teacher_hidden [sum M, bs-1, H]  teacher_topk_ids int64 / teacher_topk_logprobs
    float32 [sum M, bs-1, k]         teacher_draft_logprob float32 [sum M, bs-1]

and whose safetensors metadata carries ``schema_version``, ``meta`` (JSON) and
``sample_ids`` (JSON list). A shard's sha256 in the manifest covers the whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from specforge_opd.atomic import atomic_write_bytes
from specforge_opd.errors import DiskFullError, UserError, is_disk_full
from specforge_opd.rollout.records import RolloutRecord, accepted_histogram, tau_of
from specforge_opd.rollout.shard_meta import COMPAT_KEYS, ShardMeta, compat_problems  # noqa: F401  (shards.COMPAT_KEYS)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
# COMPAT_KEYS (rollout.shard_meta): the meta fields every shard of a directory (and a reader's ``expect``) must
# agree on; ``target_dtype`` too, since features and teacher signal of a bf16 target are not an fp32 one's.
_TEACHER = ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logprobs", "teacher_draft_logprob")


class ShardError(UserError, ValueError):
    """A shard or shard directory is corrupt, of another schema, or incompatible; the message names the file."""


def _write_bytes(f, data: bytes) -> None:
    """Write all of ``data`` to the open file ``f`` (one place, so tests can simulate a full disk)."""
    f.write(data)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; on any error ``path`` is untouched (``atomic.atomic_write``)."""
    atomic_write_bytes(path, data, write=lambda f, d: _write_bytes(f, d))


def _read_manifest(d: Path) -> Optional[dict]:
    p = d / MANIFEST
    if not p.is_file():
        return None
    try:
        man = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ShardError(f"{p}: unreadable manifest ({e}); the directory is not a valid shard spool") from e
    ver = man.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise ShardError(
            f"{p}: shard schema version {ver}, this build reads version {SCHEMA_VERSION}; "
            f"re-run the rollout into a fresh directory (or use the matching specforge-opd version)"
        )
    return man


# ---------------------------------------------------------------------------
# writing


def records_to_tensors(records: list[RolloutRecord]) -> dict[str, torch.Tensor]:
    """Concatenate records into the shard's flat tensors (see the module docstring).

    Raises:
        ShardError: records disagree on block size, teacher form or feature presence.
    """
    if not records:
        raise ShardError("no records to write")
    for r in records:
        r.validate()
    bs = {r.block_size for r in records}
    forms = {r.teacher_form() for r in records}
    has_feat = {r.features is not None for r in records}
    if len(bs) > 1 or len(forms) > 1 or len(has_feat) > 1:
        raise ShardError(f"records of one shard must share block size {bs}, teacher form {forms} and feature presence {has_feat}")
    T = [int(r.input_ids.numel()) for r in records]
    M = [r.num_blocks for r in records]
    cum = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0).tolist()), dtype=torch.long)  # noqa: E731
    out = {
        "input_ids": torch.cat([r.input_ids.long() for r in records]),
        "seq_offsets": cum(T),
        "block_offsets": cum(M),
        "prompt_len": torch.tensor([r.prompt_len for r in records], dtype=torch.long),
        "finished": torch.tensor([int(r.finished) for r in records], dtype=torch.uint8),
        "drafter_step": torch.tensor([r.drafter_step for r in records], dtype=torch.long),
        "anchors": torch.cat([r.anchors.long() for r in records]),
        "accepted": torch.cat([r.accepted.long() for r in records]),
        "drafts": torch.cat([r.drafts.long() for r in records]),
    }
    if records[0].features is not None:
        out["features"] = torch.cat([r.features for r in records])
        out["feat_offsets"] = cum([t - 1 for t in T])
    for name in _TEACHER:
        if getattr(records[0], name) is not None:
            out[name] = torch.cat([getattr(r, name) for r in records])
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


class ShardWriter:
    """Append shards to ``out_dir``; each ``write`` is atomic and the manifest is rewritten last.

    Args:
        out_dir: created if missing. An existing directory is appended to when its
            manifest has this schema version and the same ``COMPAT_KEYS`` values; its
            shards are verified in full first (``heal_shards``: a damaged one is moved
            aside and unlisted, so a resume rolls its prompts out again).
        meta: the run's ``ShardMeta`` (or its dict; module docstring); stored per shard.

    Raises:
        ShardError: the directory holds shards of another schema version, or of an
            incompatible run (block size, layer ids, target, mask token), or
            safetensors files that no manifest lists and that this schema cannot read.
    """

    def __init__(self, out_dir, meta: "ShardMeta | dict"):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = json.loads(json.dumps(meta.to_dict() if isinstance(meta, ShardMeta) else meta))
        #: Damaged shards this writer moved aside on opening the directory (``heal_shards``).
        self.healed: list[dict] = []
        man = _read_manifest(self.dir)
        if man is None:
            for f in sorted(self.dir.glob("*.safetensors")):
                ver = _file_schema(f)
                if ver != str(SCHEMA_VERSION):
                    raise ShardError(
                        f"{self.dir}: holds {f.name} of shard schema {ver!r} (this build writes {SCHEMA_VERSION}) "
                        f"and no manifest; choose an empty output directory"
                    )
            man = {"schema_version": SCHEMA_VERSION, "meta": self.meta, "shards": []}
        else:
            bad = compat_problems(man.get("meta", {}), self.meta)
            if bad:
                raise ShardError(f"{self.dir}: existing shards differ from this run in {', '.join(bad)}; use a fresh --out directory")
            self.healed = heal_shards(self.dir)
            if self.healed:
                man = _read_manifest(self.dir)
        self.manifest = man

    def write(self, records: list[RolloutRecord]) -> Path:
        """Write ``records`` as the next shard and list it in the manifest; returns its path.

        Raises:
            ShardError: inconsistent records.
            DiskFullError: the disk is full (an ``OSError``, errno ENOSPC); OSError: not
                writable. Either way the partial shard is removed and the manifest (and every
                earlier shard) is unchanged; the message says so.
        """
        tensors = records_to_tensors(records)
        idx = len(self.manifest["shards"])
        name = f"shard-{idx:05d}.safetensors"
        while (self.dir / name).exists():  # a complete-but-unlisted file from a crash: never overwrite
            idx += 1
            name = f"shard-{idx:05d}.safetensors"
        meta = dict(self.meta)
        meta["drafter_step"] = int(records[0].drafter_step)
        data = st_save(
            tensors,
            metadata={
                "schema_version": str(SCHEMA_VERSION),
                "meta": json.dumps(meta, sort_keys=True),
                "sample_ids": json.dumps([r.sample_id for r in records]),
            },
        )
        path = self.dir / name
        entry = {
            "file": name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "sequences": len(records),
            "tokens": int(tensors["input_ids"].numel()),
            "completion_tokens": sum(r.completion_tokens for r in records),
            "blocks": int(tensors["anchors"].numel()),
            "meta": meta,
        }
        new_manifest = dict(self.manifest, shards=self.manifest["shards"] + [entry])
        try:
            _atomic_write(path, data)
            _atomic_write(self.dir / MANIFEST, json.dumps(new_manifest, indent=1, sort_keys=True).encode())
        except OSError as e:
            if path.exists() and not any(s["file"] == name for s in self.manifest["shards"]):
                path.unlink()
            if is_disk_full(e):
                raise DiskFullError(path, f"the partial shard was removed, earlier shards in {self.dir} are intact") from e
            raise OSError(e.errno, f"writing shard {path} failed: {e.strerror or e}; the partial shard was removed, "
                                   f"earlier shards in {self.dir} are intact") from e
        self.manifest = new_manifest
        return path


def _file_schema(f: Path) -> Optional[str]:
    try:
        with safe_open(str(f), framework="pt") as h:
            return (h.metadata() or {}).get("schema_version")
    except Exception:
        return None


# ---------------------------------------------------------------------------
# reading


class InOrderShards:
    """Writes records that arrive in any order as shards of ``per`` sequences, in the order of ``order``.

    A continuous batch ends rows out of prompt order; a record waits here until every
    sequence before it in ``order`` has arrived (or was skipped), so the shards list
    sequences in prompt order and a killed run resumes at a prompt boundary. One long row
    can hold back everything that ends behind it, so at most ``max_waiting`` records wait:
    past that, the waiting ones are written at once (still sorted among themselves), which
    bounds the memory (each record holds its features and teacher) at the cost of order.
    Sample ids that repeat are each written once, in arrival order among themselves.

    Args:
        writer: the ``ShardWriter``.
        order: sample ids in prompt order.
        per: sequences per shard (the last may hold fewer).
        skipped: returns ids that will never arrive (prompts the engine skipped).
        on_write: called with each written shard's records.
        max_waiting: records held back at most (default: 4 shards' worth, at least 64).
    """

    def __init__(self, writer: "ShardWriter", order: list, per: int, skipped=lambda: (), on_write=None,
                 max_waiting: Optional[int] = None):
        self.writer, self.order, self.per = writer, [str(s) for s in order], max(1, int(per))
        self.skipped, self.on_write = skipped, on_write
        self.max_waiting = int(max_waiting) if max_waiting is not None else max(64, 4 * self.per)
        self.rank = {}
        for i, s in enumerate(self.order):
            self.rank.setdefault(s, i)
        self.waiting: dict[str, list] = {}
        self.n_waiting = 0
        self.ahead: dict[str, int] = {}  # records written before their turn, per id
        self.ready: list[RolloutRecord] = []
        self.pos = 0
        #: Times the waiting records were written ahead of order (``max_waiting`` reached).
        self.overflows = 0

    def add(self, rec: RolloutRecord) -> None:
        """Take one finished record; write every full shard that is now in order."""
        self.waiting.setdefault(str(rec.sample_id), []).append(rec)
        self.n_waiting += 1
        gone = None
        while self.pos < len(self.order):
            sid = self.order[self.pos]
            if self.waiting.get(sid):
                self.ready.append(self.waiting[sid].pop(0))
                self.n_waiting -= 1
            elif self.ahead.get(sid):
                self.ahead[sid] -= 1
            else:
                gone = set(self.skipped()) if gone is None else gone
                if sid not in gone:
                    break
            self.pos += 1
        if self.n_waiting > self.max_waiting:
            self.overflows += 1
            drained = self._drain_waiting()
            for r in drained:
                self.ahead[str(r.sample_id)] = self.ahead.get(str(r.sample_id), 0) + 1
            self.ready += drained
        while len(self.ready) >= self.per:
            self._write(self.ready[: self.per])
            self.ready = self.ready[self.per:]

    def close(self) -> None:
        """Write what is left (records still waiting come after the ready ones, in order)."""
        rest = self.ready + self._drain_waiting()
        self.ready = []
        for i in range(0, len(rest), self.per):
            self._write(rest[i:i + self.per])

    def _drain_waiting(self) -> list:
        out = sorted((r for rs in self.waiting.values() for r in rs), key=lambda r: self.rank.get(str(r.sample_id), 0))
        self.waiting, self.n_waiting = {}, 0
        return out

    def _write(self, recs: list) -> None:
        if recs:
            self.writer.write(recs)
            if self.on_write is not None:
                self.on_write(recs)


#: What to do about a damaged shard: the advice every reader's message ends with.
REPAIR_ADVICE = ("rerun the command that wrote it with the same output directory: the resume moves a damaged "
                 "shard aside and rolls its prompts out again")


def _damage(d: Path, entry: dict) -> Optional[str]:
    """Why the listed shard ``entry`` of ``d`` cannot be read (``missing``, ``truncated``, ``checksum``), or None."""
    path = d / entry["file"]
    if not path.is_file():
        return "missing"
    data = path.read_bytes()
    if "bytes" in entry and len(data) < int(entry["bytes"]):
        return "truncated"
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        return "checksum"
    try:
        json.loads((st_load_metadata(data) or {}).get("sample_ids", "[]"))
    except Exception:
        return "unreadable"
    return None


def st_load_metadata(data: bytes) -> dict:
    """The string metadata of a safetensors file held in ``data`` (its JSON header's ``__metadata__``)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


def verify_shards(shard_dir) -> list[dict]:
    """Check every listed shard of ``shard_dir`` in full (size, sha256, header); changes nothing.

    Returns:
        One dict per damaged shard: ``file``, ``why`` (missing/truncated/checksum/unreadable), ``what`` (in words).
    Raises:
        ShardError: unreadable manifest or another schema version.
    """
    d = Path(shard_dir)
    man = _read_manifest(d) if d.is_dir() else None
    out = []
    for entry in (man or {}).get("shards", []):
        why = _damage(d, entry)
        if why is not None:
            out.append({"file": entry["file"], "why": why, "what": _WHY[why]})
    return out


def heal_shards(shard_dir, log=None) -> list[dict]:
    """Verify every listed shard of ``shard_dir`` in full; move damaged ones aside and unlist them.

    A shard that is missing, truncated, fails its sha256 or has an unreadable header is
    renamed ``<file>.bad-<why>`` (kept for a post-mortem, never read again) and dropped
    from the manifest (rewritten atomically), so ``written_sample_ids`` no longer holds
    its sequences and a resumed rollout rolls them out again. One line per shard goes to
    ``log`` (default: stderr).

    Returns:
        One dict per moved shard: ``file``, ``why``, ``sequences``, ``moved_to`` (None when missing).
    Raises:
        ShardError: unreadable manifest or another schema version.
    """
    d = Path(shard_dir)
    man = _read_manifest(d) if d.is_dir() else None
    if not man:
        return []
    keep, moved = [], []
    for entry in man["shards"]:
        why = _damage(d, entry)
        if why is None:
            keep.append(entry)
            continue
        src, dst = d / entry["file"], None
        if src.exists():
            dst = d / f"{entry['file']}.bad-{why}"
            n = 1
            while dst.exists():
                dst, n = d / f"{entry['file']}.bad-{why}.{n}", n + 1
            os.replace(src, dst)
        moved.append({"file": entry["file"], "why": why, "sequences": int(entry.get("sequences", 0)),
                      "moved_to": dst.name if dst else None})
    if moved:
        _atomic_write(d / MANIFEST, json.dumps(dict(man, shards=keep), indent=1, sort_keys=True).encode())
        for m in moved:
            where = f"moved aside to {m['moved_to']}" if m["moved_to"] else "unlisted"
            line = (f"{d / m['file']}: {_WHY[m['why']]}; {where}, its {m['sequences']} sequences are rolled out again")
            (log or (lambda t: print(t, file=sys.stderr)))(line)
    return moved


_WHY = {"missing": "listed in the manifest but missing", "truncated": "truncated (shorter than the manifest's size)",
        "checksum": "checksum mismatch (corrupted)", "unreadable": "unreadable safetensors header"}


def written_sample_ids(shard_dir) -> set[str]:
    """Sample ids of the complete shards in ``shard_dir`` (the manifest lists only complete ones).

    A resumed rollout skips these prompts. Reads safetensors headers only: a writer
    (``ShardWriter``) verifies the shards in full before a resume calls this.

    Raises:
        ShardError: a listed shard is missing or its header unreadable (names the file).
    """
    d = Path(shard_dir)
    man = _read_manifest(d) if d.is_dir() else None
    done: set[str] = set()
    for entry in (man or {}).get("shards", []):
        try:
            with safe_open(str(d / entry["file"]), framework="pt") as h:
                done.update(json.loads(h.metadata()["sample_ids"]))
        except Exception as e:
            raise ShardError(f"{d / entry['file']}: unreadable shard ({type(e).__name__}); {REPAIR_ADVICE}") from e
    return done


def shard_meta(shard_dir) -> dict:
    """The directory's run metadata from its manifest.

    Raises:
        ShardError: no manifest, or another schema version.
    """
    d = Path(shard_dir)
    man = _read_manifest(d)
    if man is None:
        raise ShardError(f"{d}: no {MANIFEST}; not a shard directory (or no shard was completed)")
    return dict(man.get("meta", {}))


def _load_shard(d: Path, entry: dict, expect: Optional[dict]) -> tuple[dict, dict, list[str]]:
    path = d / entry["file"]
    if not path.is_file():
        raise ShardError(f"{path}: listed in the manifest but missing; {REPAIR_ADVICE}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        what = "truncated" if len(data) < int(entry.get("bytes", 0)) else "corrupted"
        raise ShardError(f"{path}: checksum mismatch, the shard is {what} (sha256 {digest[:12]}.. != manifest "
                         f"{str(entry.get('sha256'))[:12]}..); {REPAIR_ADVICE}")
    try:
        tensors = st_load(data)
        md = st_load_metadata(data)
    except Exception as e:
        raise ShardError(f"{path}: not a readable safetensors shard ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                         f"{REPAIR_ADVICE}") from e
    if md.get("schema_version") != str(SCHEMA_VERSION):
        raise ShardError(f"{path}: shard schema {md.get('schema_version')!r}, this build reads {SCHEMA_VERSION}")
    meta = json.loads(md.get("meta", "{}"))
    if expect:
        bad = compat_problems(meta, expect)
        if bad:
            raise ShardError(f"{path}: incompatible with this run: {', '.join(bad)}")
    return tensors, meta, json.loads(md.get("sample_ids", "[]"))


def _records_of(tensors: dict, meta: dict, sample_ids: list[str]) -> Iterator[RolloutRecord]:
    so, bo = tensors["seq_offsets"].tolist(), tensors["block_offsets"].tolist()
    fo = tensors["feat_offsets"].tolist() if "feat_offsets" in tensors else None
    for i, sid in enumerate(sample_ids):
        b0, b1 = bo[i], bo[i + 1]
        rec = RolloutRecord(
            sample_id=sid,
            input_ids=tensors["input_ids"][so[i]: so[i + 1]],
            prompt_len=int(tensors["prompt_len"][i]),
            anchors=tensors["anchors"][b0:b1],
            drafts=tensors["drafts"][b0:b1],
            accepted=tensors["accepted"][b0:b1],
            features=tensors["features"][fo[i]: fo[i + 1]] if fo is not None else None,
            finished=bool(tensors["finished"][i]),
            drafter_step=int(tensors["drafter_step"][i]),
            **{name: tensors[name][b0:b1] for name in _TEACHER if name in tensors},
        )
        if meta.get("anchors") == "random":
            rec.extra["anchors"] = "random"
        yield rec


def read_shards(shard_dir, expect: Optional[dict] = None) -> Iterator[RolloutRecord]:
    """Yield every record of every complete shard, in manifest order, after validating it.

    Args:
        expect: values of ``COMPAT_KEYS`` this reader needs (missing keys are not checked).
    Raises:
        ShardError: missing manifest, other schema version, a listed shard missing,
            checksum mismatch (truncated/corrupted), or a shard incompatible with ``expect``;
            the message names the shard file.
    """
    d = Path(shard_dir)
    man = _read_manifest(d)
    if man is None:
        raise ShardError(f"{d}: no {MANIFEST}; not a shard directory (or no shard was completed)")
    for entry in man["shards"]:
        tensors, meta, sids = _load_shard(d, entry, expect)
        for rec in _records_of(tensors, meta, sids):
            try:
                rec.validate()
            except ValueError as e:
                raise ShardError(f"{d / entry['file']}: {e}") from e
            yield rec


def inspect_dir(shard_dir) -> dict:
    """Validate every shard of a directory and summarize it.

    Returns a dict: shards, sequences, tokens, completion_tokens, blocks, tau (pooled,
    DESIGN.md), accepted_histogram (index = accepted length r+1, 1..bs), bytes,
    bytes_per_token (shard bytes / all tokens), unlisted (files no manifest lists), meta.

    Raises:
        ShardError: as ``read_shards``.
    """
    d = Path(shard_dir)
    meta = shard_meta(d)
    man = _read_manifest(d)
    recs = list(read_shards(d))
    bs = int(meta.get("block_size") or (recs[0].block_size if recs else 2))
    nbytes = sum(int(s["bytes"]) for s in man["shards"])
    tokens = sum(int(r.input_ids.numel()) for r in recs)
    listed = {s["file"] for s in man["shards"]}
    return {
        "dir": str(d),
        "schema_version": SCHEMA_VERSION,
        "shards": len(man["shards"]),
        "sequences": len(recs),
        "tokens": tokens,
        "completion_tokens": sum(r.completion_tokens for r in recs),
        "blocks": sum(r.num_blocks for r in recs),
        "tau": tau_of(recs),
        "accepted_histogram": accepted_histogram(recs, bs)[1:],
        "bytes": nbytes,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "drafter_steps": sorted({r.drafter_step for r in recs}),
        "unlisted": sorted(p.name for p in d.iterdir() if p.name != MANIFEST and p.name not in listed),
        "meta": meta,
    }
