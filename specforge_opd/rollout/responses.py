"""The target's responses to the SFT training prompts: generation through HF, the embedded engine or SGLang.

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
from typing import Optional, Sequence

from specforge_opd.atomic import atomic_write_bytes
from specforge_opd.config import ExperimentConfig
from specforge_opd.models.target import cut_at_stop
from specforge_opd.progress import progress_bar
from specforge_opd.stepkeys import MARKER, SFTError


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


def hf_generate(model, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int],
                temperature: float, seed: int, pad_token_id: int) -> list[list[int]]:
    """Batched target decoding with HF ``generate`` and left padding (fallback backend).

    Returns the new tokens per prompt (prompt excluded), not yet cut at a stop token.
    """
    import torch

    torch.manual_seed(seed)
    width = max(len(p) for p in prompts)
    dev = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, eos_token_id=list(stop_token_ids),
                  pad_token_id=pad_token_id)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), **kwargs)
    return [row[width:].tolist() for row in out.cpu()]


def sglang_generate(urls: list[str], prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int],
                    temperature: float, seed: int, timeout_s: float, max_in_flight: int = 32,
                    timeout_per_token_s: float = 0.05, max_retries: int = 2,
                    sample_ids: Optional[list[str]] = None) -> list[list[int]]:
    """Target decoding through SGLang's native ``/generate`` (``input_ids`` in, ``output_ids`` out).

    One request per prompt, at most ``max_in_flight`` in flight at once (SGLang
    batches the requests it holds by itself), spread round-robin over ``urls``.
    A request may take ``timeout_s + timeout_per_token_s * max_new_tokens``
    seconds; a transient failure (connection error, timeout, HTTP 5xx/429) is
    retried ``max_retries`` times with backoff, so one slow prompt no longer
    fails the whole set. Each request's ``sampling_seed`` is ``step.sample_seed(seed,
    sample id)`` (31 bits; ids default to the prompt index), as the embedded backend seeds
    each row, so prompts do not share one random stream. Returns the new tokens of each
    prompt, in prompt order.

    Raises:
        SFTError: no URL configured, a server unreachable after the retries, or a
            reply without ``output_ids``.
    """
    import asyncio

    from specforge_opd.config import SGLangConfig
    from specforge_opd.sglang.contract import ContractError, request_timeout_s
    from specforge_opd.sglang.launcher import Endpoints, ServerError
    from specforge_opd.sglang.verify_client import for_each_prompt

    if not urls:
        raise SFTError("rollout.backend is sglang but sglang.urls is empty; start a server and list its URL")
    cfg = SGLangConfig(urls=list(urls), request_timeout_s=timeout_s, timeout_per_token_s=timeout_per_token_s,
                       max_in_flight=max_in_flight, max_retries=max_retries)
    timeout = request_timeout_s(cfg, max_new_tokens)
    from specforge_opd.rollout.step import sample_seed

    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": list(stop_token_ids)}

    async def one(client, i: int, sid: str, ids: list[int]) -> list[int]:
        params = dict(sampling, sampling_seed=sample_seed(seed, sid, bits=31))
        reply = await client.post(i, "/generate", {"input_ids": ids, "sampling_params": params}, timeout_s=timeout)
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        if not isinstance(reply, dict) or "output_ids" not in reply:
            keys = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise SFTError(f"SGLang server {client.endpoints.url(i)} replied without output_ids (keys {keys})")
        return [int(t) for t in reply["output_ids"]]

    try:
        ids = [str(i) for i in range(len(prompts))] if sample_ids is None else [str(s) for s in sample_ids]
        return asyncio.run(for_each_prompt(Endpoints(list(urls)), cfg, [(s, list(p)) for s, p in zip(ids, prompts)], one))
    except (ServerError, ContractError) as e:
        raise SFTError(f"SGLang /generate failed: {e}") from e


def generate_responses(bundle, prompts: list[list[int]], cfg: ExperimentConfig, seed: int,
                       sample_ids: Optional[list[str]] = None, batch_size: Optional[int] = None) -> list[list[int]]:
    """New tokens for each prompt (prompt excluded), from the configured backend.

    The embedded backend is ``rollout.autoregressive_generate`` (KV cache, a continuous
    batch of ``batch_size`` rows, None: all at once; per-sample generators seeded by
    ``seed`` and the sample id, so a resumed run samples what the uninterrupted one would).
    SGLang batches on its own side.
    """
    kw = dict(max_new_tokens=cfg.sft.max_new_tokens, stop_token_ids=list(bundle.stop_token_ids),
              temperature=cfg.sft.temperature, seed=seed)
    if cfg.rollout.backend != "embedded":
        return sglang_generate(cfg.sglang.urls, prompts, timeout_s=cfg.sglang.request_timeout_s, sample_ids=sample_ids, **kw)
    try:
        from specforge_opd.rollout.engine import autoregressive_generate
    except ImportError:
        autoregressive_generate = None
    if autoregressive_generate is not None:
        return [list(r) for r in autoregressive_generate(bundle.model, prompts, sample_ids=sample_ids,
                                                                  prefill_chunk=cfg.target.prefill_chunk,
                                                                  batch_size=batch_size, **kw)]
    pad = bundle.tokenizer.pad_token_id
    pad = bundle.stop_token_ids[0] if pad is None else pad
    return hf_generate(bundle.model, prompts, pad_token_id=pad, **kw)


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
                  donors: Sequence[Path] = ()) -> dict:
    """Generate the responses chunk by chunk; an existing chunk file is finished work and is kept.

    Chunk c covers prompts ``[c*chunk, (c+1)*chunk)``; sampling is seeded per
    prompt id, so a resumed run writes what the uninterrupted one would. ``donors``:
    finished responses steps with the same generation settings (``stepkeys.donor_steps``);
    a donor's chunk c whose prompts (ids and tokens, in order) are this chunk's is copied
    instead of generated, so a grown pool pays only for its new prompts.
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
                                  sample_ids=[pid for pid, _ in part], batch_size=cfg.sft.batch_size)
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

