"""The target's responses to the SFT training prompts: generation by the embedded target or a remote one (SGLang).

Step 1 of the SFT stage. Prompts come in as token ids (``prompts.tokenize_prompts``);
each response is the target's continuation, greedy or sampled (``sft.temperature``),
cut after the first stop token and at ``sft.max_new_tokens``. ``run_responses`` writes
them as JSONL chunks of ``ResponseRecord``, a chunk at a time, so a killed run keeps its
finished chunks and, sampling being seeded per prompt id, resumes with what the
uninterrupted run would have written. ``pack_responses`` gzips a finished step's chunks
so that a repository can carry it; ``sft.reuse_from`` reuses a packed step like any other.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from specforge_opd.atomic import atomic_write_bytes
from specforge_opd.config import ExperimentConfig
from specforge_opd.models.target import cut_at_stop
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.engine import autoregressive_generate
from specforge_opd.stepkeys import MARKER, SFTError

#: A remote target's generation: (prompts, *, sample_ids, max_new_tokens, stop_token_ids, temperature, seed)
#: -> new tokens per prompt, in prompt order
RemoteGenerate = Callable[..., list[list[int]]]


@dataclass
class ResponseRecord:
    """One generated training sample: token ids of the rendered prompt and of the target's response.

    ``response_ids`` ends with the stop token when the target stopped (kept:
    the drafter learns to propose it) and is cut at ``sft.max_new_tokens``.
    """

    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    finished: bool


def generate_responses(bundle, prompts: list[list[int]], cfg: ExperimentConfig, seed: int,
                       sample_ids: Optional[list[str]] = None, batch_size: Optional[int] = None,
                       remote: Optional[RemoteGenerate] = None) -> list[list[int]]:
    """New tokens for each prompt (prompt excluded): from ``remote`` when given, else the embedded target.

    The embedded target decodes with ``engine.autoregressive_generate`` (KV cache, a continuous
    batch of ``batch_size`` rows, None: all at once; per-sample generators seeded by
    ``seed`` and the sample id, so a resumed run samples what the uninterrupted one would).
    ``remote`` (``stages.rollout.response_generator``: SGLang's ``/generate``) batches on its own side
    and gets the prompts, ``sample_ids`` and the sampling keywords (``max_new_tokens``,
    ``stop_token_ids``, ``temperature``, ``seed``).
    """
    kw = dict(max_new_tokens=cfg.sft.max_new_tokens, stop_token_ids=list(bundle.stop_token_ids),
              temperature=cfg.sft.temperature, seed=seed)
    if remote is not None:
        return remote(prompts, sample_ids=sample_ids, **kw)
    return [list(r) for r in autoregressive_generate(bundle.model, prompts, sample_ids=sample_ids,
                                                     prefill_chunk=cfg.target.prefill_chunk, batch_size=batch_size, **kw)]


def _chunk_index(f: Path) -> int:
    return int(f.name.split(".")[0].split("_")[1])


def _chunk_files(d: Path) -> list[Path]:
    """``d``'s response chunks in chunk order: ``chunk_<c>.jsonl``, or ``chunk_<c>.jsonl.gz`` in a packed step."""
    return sorted([*d.glob("chunk_*.jsonl"), *d.glob("chunk_*.jsonl.gz")], key=_chunk_index)


def _chunk_text(f: Path) -> str:
    data = f.read_bytes()
    return (gzip.decompress(data) if f.name.endswith(".gz") else data).decode()


def read_responses(d: Path) -> list[ResponseRecord]:
    """All response records of a responses directory, chunk by chunk, in order (plain or packed chunks)."""
    out = []
    for f in _chunk_files(d):
        for line in _chunk_text(f).splitlines():
            if line.strip():
                out.append(ResponseRecord(**json.loads(line)))
    return out


def pack_responses(src: Path, dst: Path) -> int:
    """Copy the finished responses step ``src`` to ``dst`` with gzip-compressed chunks (about 5x smaller).

    A packed step is what a repository can carry: ``sft.reuse_from`` pointing at its parent
    directory reuses it as it reuses any finished step (``stepkeys.reusable_step``), and it serves
    as a donor to a grown pool. Returns the number of chunks written.

    Raises:
        SFTError: ``src`` is not a finished responses step (no marker).
    """
    src, dst = Path(src), Path(dst)
    if not (src / MARKER).is_file():
        raise SFTError(f"pack_responses: {src} is not a finished responses step (no {MARKER}); finish it first")
    dst.mkdir(parents=True, exist_ok=True)
    files = _chunk_files(src)  # a packed ``src`` is packed again: its chunks must not be dropped
    for f in files:
        # mtime 0: the packed bytes depend on the chunk's content only
        atomic_write_bytes(dst / f"chunk_{_chunk_index(f):05d}.jsonl.gz",
                           gzip.compress(_chunk_text(f).encode(), compresslevel=9, mtime=0))
    shutil.copyfile(src / MARKER, dst / MARKER)
    return len(files)


def _matching_chunk(donors: Sequence[Path], c: int, part: list[tuple[str, list[int]]]) -> Optional[bytes]:
    """The bytes of the first donor's chunk c (plain or packed) whose records answer exactly ``part``'s prompts, else None."""
    want = [(str(pid), list(p)) for pid, p in part]
    for d in donors:
        f = next((g for g in (d / f"chunk_{c:05d}.jsonl", d / f"chunk_{c:05d}.jsonl.gz") if g.is_file()), None)
        if f is None:
            continue
        try:
            text = _chunk_text(f)
            got = [(str(r["id"]), r["prompt_ids"]) for r in map(json.loads, text.splitlines()) if r]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if got == want:
            return text.encode()
    return None


def run_responses(d: Path, tokenized: list[tuple[str, list[int]]], bundle, cfg: ExperimentConfig,
                  donors: Sequence[Path] = (), remote: Optional[RemoteGenerate] = None) -> dict:
    """Generate the responses chunk by chunk; an existing chunk file is finished work and is kept.

    Chunk c covers prompts ``[c*chunk, (c+1)*chunk)``; sampling is seeded per
    prompt id, so a resumed run writes what the uninterrupted one would. ``donors``:
    finished responses steps with the same generation settings (``stepkeys.donor_steps``);
    a donor's chunk c whose prompts (ids and tokens, in order) are this chunk's is copied
    instead of generated, so a grown pool pays only for its new prompts. ``remote``: see
    ``generate_responses`` (None: the embedded target).
    """
    chunk = cfg.sft.chunk_prompts
    n_chunks = math.ceil(len(tokenized) / chunk)
    stop = set(bundle.stop_token_ids)
    done_before = sum((d / f"chunk_{c:05d}.jsonl").is_file() for c in range(n_chunks))
    bar = progress_bar(len(tokenized), "sft responses", "prompt", initial=min(len(tokenized), done_before * chunk))
    for c in range(n_chunks):
        f = d / f"chunk_{c:05d}.jsonl"
        if f.is_file():
            continue
        part = tokenized[c * chunk:(c + 1) * chunk]
        donor = _matching_chunk(donors, c, part)
        if donor is not None:
            atomic_write_bytes(f, donor)
            bar.update(len(part))
            continue
        # one continuous batch of sft.batch_size rows over the chunk's prompts, in prompt order
        outs = generate_responses(bundle, [p for _, p in part], cfg, seed=cfg.data.seed,
                                  sample_ids=[pid for pid, _ in part], batch_size=cfg.sft.batch_size, remote=remote)
        lines = []
        for (pid, p), o in zip(part, outs):
            resp, finished = cut_at_stop(o, stop, cfg.sft.max_new_tokens)
            lines.append(json.dumps(ResponseRecord(pid, p, resp, finished).__dict__))
        bar.update(len(part))
        atomic_write_bytes(f, ("\n".join(lines) + "\n").encode())
    bar.close()
    recs = read_responses(d)
    return {"samples": len(recs), "response_tokens": sum(len(r.response_ids) for r in recs),
            "finished": sum(r.finished for r in recs)}

