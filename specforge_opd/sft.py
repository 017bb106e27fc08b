"""The SFT stage on SpecForge: responses -> features -> train -> export (issue 4).

``specforge-opd sft -c configs/<exp>/sft.yaml`` trains a DFlash drafter with
SpecForge's own DFlash SFT trainer on the target's own responses:

1. **responses**: training prompts (``prompts.training_pool``) rendered with the
   target's chat template (``chat.render_prompt``, the rendering rollout and
   benchmarks use) and answered by the target, greedy or sampled
   (``sft.temperature``); JSONL chunks of token ids.
2. **features**: the target runs over prompt + response; each kept sample is a
   SpecForge offline DFlash feature file ``rows_*/data_*.ckpt`` =
   ``torch.save({input_ids [S] int64, loss_mask [S] int64, hidden_states
   [1, S, n*H]})``, ``loss_mask`` 1 exactly on response tokens, features at the
   drafter's ``target_layer_ids`` (layer k = HF ``hidden_states[k + 1]``,
   DESIGN.md section 3), plus our ``manifest.json``.
3. **train**: a SpecForge run YAML (strategy dflash, offline features) and
   ``python -m specforge.cli train -c run.yaml`` as a subprocess, resumed from
   its ``-latest`` checkpoint when one exists.
4. **export**: the final SpecForge checkpoint, read with
   ``torch.load(weights_only=True)``, exported by ``drafter.save_drafter`` to
   ``<output.dir>/final`` and verified: reloaded, and a short speculative decode
   must equal greedy target decoding.

Every step writes into a directory named by a hash of its inputs and a
``DONE.json`` marker last, so a rerun skips finished steps, a changed input
redoes only what depends on it, and a killed run resumes by chunk / by sample /
from SpecForge's checkpoint without duplicating samples.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .atomic import atomic_write, atomic_write_bytes, atomic_write_json
from .config import ConfigError, ExperimentConfig

STEPS = ("responses", "features", "train", "export")
MARKER = "DONE.json"
#: Feature files per ``rows_*`` directory (keeps directories listable at 100K samples).
ROWS_PER_DIR = 1000
#: SpecForge run id: checkpoints are ``<train dir>/checkpoints/sft-step<N>`` and ``sft-latest``.
SPECFORGE_RUN_ID = "sft"
#: DFlash anchors need a supervised token and a supervised successor
#: (SpecForge's ``has_consecutive_supervised_tokens``); fewer cannot train.
MIN_SUPERVISED_TOKENS = 2

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SFTError(RuntimeError):
    """The SFT stage cannot go on; the message names the step, the cause and the fix."""


# ---------------------------------------------------------------------------
# several nodes

#: Node 0's record of the SpecForge launch the other nodes join (``<output.dir>/LAUNCH_FILE``).
LAUNCH_FILE = "multinode_launch.json"


@dataclass(frozen=True)
class Nodes:
    """The nodes the SFT train step spans (torchrun's rendezvous, by its environment names).

    Attributes:
        nnodes: ``NNODES`` (1: this node alone); node_rank: ``NODE_RANK`` (0..nnodes-1);
        master_addr: ``MASTER_ADDR``, node 0's address; master_port: ``MASTER_PORT`` (29500).
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: int = 29500


def nodes_from_env(env: Optional[dict] = None) -> Nodes:
    """Read ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``os.environ`` by default).

    Raises:
        SFTError: a value that is not a number in range, or NNODES > 1 without MASTER_ADDR / NODE_RANK.
    """
    env = os.environ if env is None else env

    def num(name: str, default: int, lo: int, hi: Optional[int] = None) -> int:
        raw = str(env.get(name, "") or default)
        if not raw.isdigit() or int(raw) < lo or (hi is not None and int(raw) > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise SFTError(f"{name}={raw!r}: must be an integer {rng}")
        return int(raw)

    nnodes = num("NNODES", 1, 1)
    if nnodes == 1:
        return Nodes()
    if not env.get("MASTER_ADDR"):
        raise SFTError(f"NNODES={nnodes} needs MASTER_ADDR: the address of the node with NODE_RANK=0")
    if not str(env.get("NODE_RANK", "")):
        raise SFTError(f"NNODES={nnodes} needs NODE_RANK: this node's rank, 0..{nnodes - 1}")
    return Nodes(nnodes, num("NODE_RANK", 0, 0, nnodes - 1), str(env["MASTER_ADDR"]), num("MASTER_PORT", 29500, 1, 65535))


def _specforge_train_cmd(run_yaml: Path) -> tuple[list[str], dict]:
    from .adapter import specforge_cli_module

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return [sys.executable, "-m", specforge_cli_module(), "train", "-c", str(run_yaml)], env


def _publish_launch(out: Path, run_yaml: Optional[Path] = None, *, end: bool = False, error: Optional[str] = None) -> None:
    """Node 0: tell the other nodes to join a SpecForge launch of ``run_yaml``, or (``end``) that the stage is over."""
    import uuid

    atomic_write_json(out / LAUNCH_FILE, {"id": uuid.uuid4().hex, "time": time.time(), "end": end, "error": error,
                                          "run_yaml": None if run_yaml is None else str(run_yaml)})


def follow_node0(out: Path, *, poll_s: float = 5.0, idle_timeout_s: float = 86400.0) -> Path:
    """A node with NODE_RANK > 0: join every SpecForge launch node 0 publishes under ``out``, until it ends.

    Node 0 alone writes responses, features, validation points and the export: they need one
    writer, and the other nodes only add GPUs to SpecForge's training (its torchrun rendezvous
    waits for them). ``out`` (``output.dir``) must be on a filesystem every node sees, with the
    target at the same path. A record that was there before this node started is joined unless it
    is an end record (a finished earlier run).

    Returns:
        ``out / "final"``, which node 0 writes.
    Raises:
        SFTError: a SpecForge launch failed here, node 0 ended with an error, or no launch came
            for ``idle_timeout_s`` seconds.
    """
    f = out / LAUNCH_FILE
    started, seen, waited_since = time.time(), None, time.time()
    print(f"[sft node] following node 0's SpecForge launches in {f}", flush=True)
    while True:
        try:
            rec = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            rec = None
        if rec is not None and rec["id"] != seen:
            seen = rec["id"]
            if rec["end"]:
                if rec["time"] >= started:
                    if rec.get("error"):
                        raise SFTError(f"sft: node 0 stopped with an error ({rec['error']}); fix it there and start every node again")
                    print("[sft node] node 0 finished the stage", flush=True)
                    return out / "final"
            else:
                cmd, env = _specforge_train_cmd(Path(rec["run_yaml"]))
                print(f"[sft node] joining: {' '.join(cmd)}", flush=True)
                rc = subprocess.call(cmd, env=env)
                if rc != 0:
                    raise SFTError(f"sft train: SpecForge exited with status {rc} on this node (its log is above; "
                                   f"run.yaml: {rec['run_yaml']})")
            waited_since = time.time()
        if time.time() - waited_since > idle_timeout_s:
            raise SFTError(f"sft: node 0 published no SpecForge launch in {f} for {idle_timeout_s:.0f} s; is it running "
                           "with the same output.dir on a shared filesystem?")
        time.sleep(poll_s)


# ---------------------------------------------------------------------------
# small durable-file helpers


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_json(path, obj)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))


def hash_inputs(inputs: dict) -> str:
    """SHA-256 of a JSON-canonical dict: the key a step's output is stored under."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def step_dir(out: Path, step: str, key: str) -> Path:
    return out / f"{step}-{key[:12]}"


def _reusable_step(cfg: ExperimentConfig, out: Path, step: str, key: str) -> Path:
    """``out``'s directory for ``step``, or a finished one with the same key under ``sft.reuse_from``.

    Continued SFT (the matched-FLOPs baseline) trains on the first stage's cached
    features instead of generating and capturing them again.
    """
    own = step_dir(out, step, key)
    if not is_done(own, key) and cfg.sft.reuse_from:
        other = step_dir(Path(cfg.resolve_path(cfg.sft.reuse_from)), step, key)
        if is_done(other, key):
            return other
    return own


def is_done(d: Path, key: str) -> bool:
    """True when ``d`` holds a finished step whose marker records ``key``."""
    m = d / MARKER
    if not m.is_file():
        return False
    try:
        return json.loads(m.read_text()).get("key") == key
    except (OSError, json.JSONDecodeError):
        return False


def _mark_done(d: Path, key: str, inputs: dict, stats: dict) -> None:
    _write_json(d / MARKER, {"key": key, "inputs": inputs, "stats": stats, "finished_at": time.time()})


def _keyed_step(name: str, d: Path, key: str, inputs: dict, run, skipped: list[str]) -> dict:
    """Run one resumable SFT step: skip it when ``d`` is done under ``key``, else ``run()`` -> stats and mark
    it done, unless the stats say it paused (``paused_at``: the same command continues it). Returns the stats."""
    if is_done(d, key):
        skipped.append(name)
        print(f"[sft {name}] done already: {d}", flush=True)
        return json.loads((d / MARKER).read_text())["stats"]
    stats = run()
    if stats.get("paused_at") is None:
        _mark_done(d, key, inputs, stats)
    return stats


def dir_bytes(path: Path) -> int:
    """Bytes under ``path`` (symlinks not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


# ---------------------------------------------------------------------------
# target, mask token and draft config


def target_dir(cfg: ExperimentConfig) -> str:
    """The target's HF directory (or hub id) as SpecForge's ``model.target_model_path``."""
    if cfg.target.path is None:
        from .assets import ensure_target

        return str(ensure_target())
    p = cfg.resolve_path(cfg.target.path)
    if p is not None and p.exists():
        return str(p)
    from .target import resolve_target_path

    return str(resolve_target_path(cfg.target.path))  # a hub id: its snapshot, so SpecForge reads local files


def target_identity(tdir: str) -> str:
    """A cheap identity of the target: its config.json and its weight files' names and sizes.

    Reading no weights keeps the skip decision instant; a re-converted or
    replaced checkpoint changes the sizes or the config and redoes the steps.
    """
    p = Path(tdir)
    if not p.is_dir():
        return f"hub:{tdir}"
    h = hashlib.sha256()
    cfg_file = p / "config.json"
    if cfg_file.is_file():
        h.update(cfg_file.read_bytes())
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def resolve_mask_token_id(cfg: ExperimentConfig, target_config, tokenizer=None) -> int:
    """The drafter's ``dflash_config.mask_token_id`` (DESIGN.md section 3, "Mask token").

    Embedded target: ``assets.EMBEDDED_MASK_TOKEN_ID`` (engineer A's documented
    choice for SmolLM2) unless ``draft.mask_token_id`` overrides it. Other
    targets: ``draft.mask_token_id``, else SpecForge's own resolution (the
    tokenizer's mask token, then the first embedding row past the tokenizer,
    e.g. 151669 for Qwen3), refusing a token that chat text produces (eos/stop).

    Raises:
        ConfigError: no safe id can be found; set ``draft.mask_token_id``.
    """
    if cfg.draft.mask_token_id is not None:
        return int(cfg.draft.mask_token_id)
    if cfg.target.path is None:
        from .assets import EMBEDDED_MASK_TOKEN_ID

        return int(EMBEDDED_MASK_TOKEN_ID)
    if tokenizer is None:
        raise ConfigError(
            "draft.mask_token_id is not set and the target tokenizer is not loaded (dry run); "
            "set draft.mask_token_id (Qwen3: 151669, the first embedding row past the tokenizer)"
        )
    from .adapter import specforge_resolve_mask_token_id

    vocab = int(getattr(target_config, "text_config", target_config).vocab_size)
    mask = specforge_resolve_mask_token_id(explicit=None, tokenizer=tokenizer, embedding_vocab_size=vocab)
    produced = {tokenizer.eos_token_id, *list(cfg.target.stop_token_ids)}
    if mask in produced:
        raise ConfigError(
            f"SpecForge's mask-token resolution picked {mask}, a token the target emits (eos/stop); "
            "set draft.mask_token_id to an embedding row chat text never produces"
        )
    return int(mask)


def make_draft_config(cfg: ExperimentConfig, target_config, mask_token_id: int):
    """The drafter's HF config derived from the target (``drafter.derive_draft_config``)."""
    from .drafter import DrafterError, derive_draft_config

    try:
        return derive_draft_config(
            target_config,
            num_hidden_layers=cfg.draft.num_hidden_layers,
            block_size=cfg.draft.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=cfg.draft.target_layer_ids,
            intermediate_size=cfg.draft.intermediate_size,
        )
    except DrafterError as e:
        raise ConfigError(str(e)) from None


def draft_config_dict(draft_config) -> dict:
    d = draft_config.to_dict()
    for k in ("transformers_version", "_name_or_path", "auto_map"):
        d.pop(k, None)
    if "dtype" in d and not isinstance(d["dtype"], (str, type(None))):
        d["dtype"] = str(d["dtype"]).replace("torch.", "")
    return d


# ---------------------------------------------------------------------------
# step 1: responses


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


def render_training_prompt(tokenizer, record, cfg: ExperimentConfig) -> str:
    """The generation prompt of a ``PromptRecord`` exactly as rollout renders it.

    ``record.messages`` (a conversation ending in a user turn) goes through
    ``chat.render_prompt(..., thinking=cfg.target.thinking)``; a bare
    ``record.prompt`` string becomes one user message.

    Raises:
        SFTError: the record has neither messages nor a prompt.
    """
    messages = getattr(record, "messages", None)
    if not messages:
        text = getattr(record, "prompt", None)
        if not text:
            raise SFTError(f"prompt record {getattr(record, 'id', '?')!r} has neither messages nor a prompt")
        messages = [{"role": "user", "content": text}]
    from .chat import render_prompt

    return render_prompt(tokenizer, messages, thinking=cfg.target.thinking, system_prompt=cfg.target.system_prompt)


def _prompt_limit(cfg: ExperimentConfig) -> int:
    return min(cfg.data.max_prompt_tokens, cfg.target.max_context - cfg.sft.max_new_tokens)


def tokenize_prompts(records: Sequence, tokenizer, cfg: ExperimentConfig) -> tuple[list[tuple[str, list[int]]], int]:
    """Render and tokenize prompt records, applying ``target.too_long``.

    Returns ``([(id, prompt_ids)], n_skipped)``. The template already carries
    any BOS, so no special tokens are added.

    Raises:
        SFTError: a prompt is too long and ``target.too_long`` is ``error``, or
            ``target.max_context`` leaves no room for ``sft.max_new_tokens``.
    """
    limit = _prompt_limit(cfg)
    if limit <= 0:
        raise SFTError(
            f"target.max_context={cfg.target.max_context} leaves no room for prompts after "
            f"sft.max_new_tokens={cfg.sft.max_new_tokens}; raise max_context or lower max_new_tokens"
        )
    out, skipped = [], 0
    for r in records:
        ids = tokenizer(render_training_prompt(tokenizer, r, cfg), add_special_tokens=False)["input_ids"]
        if len(ids) > limit:
            if cfg.target.too_long == "error":
                raise SFTError(
                    f"prompt {r.id!r} has {len(ids)} tokens > {limit} (min of data.max_prompt_tokens and "
                    "target.max_context - sft.max_new_tokens); set target.too_long=skip or truncate_left"
                )
            if cfg.target.too_long == "skip":
                skipped += 1
                continue
            ids = ids[-limit:]
        out.append((str(r.id), list(ids)))
    return out, skipped


def _cut_at_stop(ids: list[int], stop_ids: set[int], max_new: int) -> tuple[list[int], bool]:
    ids = list(ids)[:max_new]
    for j, t in enumerate(ids):
        if t in stop_ids:
            return ids[: j + 1], True
    return ids, False


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
                    timeout_per_token_s: float = 0.05, max_retries: int = 2) -> list[list[int]]:
    """Target decoding through SGLang's native ``/generate`` (``input_ids`` in, ``output_ids`` out).

    One request per prompt, at most ``max_in_flight`` in flight at once (SGLang
    batches the requests it holds by itself), spread round-robin over ``urls``.
    A request may take ``timeout_s + timeout_per_token_s * max_new_tokens``
    seconds; a transient failure (connection error, timeout, HTTP 5xx/429) is
    retried ``max_retries`` times with backoff, so one slow prompt no longer
    fails the whole set. Returns the new tokens of each prompt, in prompt order.

    Raises:
        SFTError: no URL configured, a server unreachable after the retries, or a
            reply without ``output_ids``.
    """
    import asyncio

    from .config import SGLangConfig
    from .sglang.contract import ContractError, request_timeout_s
    from .sglang.launcher import Endpoints, ServerError
    from .sglang.verify_client import for_each_prompt

    if not urls:
        raise SFTError("rollout.backend is sglang but sglang.urls is empty; start a server and list its URL")
    cfg = SGLangConfig(urls=list(urls), request_timeout_s=timeout_s, timeout_per_token_s=timeout_per_token_s,
                       max_in_flight=max_in_flight, max_retries=max_retries)
    timeout = request_timeout_s(cfg, max_new_tokens)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                "stop_token_ids": list(stop_token_ids), "sampling_seed": seed}

    async def one(client, i: int, _sid: str, ids: list[int]) -> list[int]:
        reply = await client.post(i, "/generate", {"input_ids": ids, "sampling_params": sampling}, timeout_s=timeout)
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        if not isinstance(reply, dict) or "output_ids" not in reply:
            keys = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise SFTError(f"SGLang server {client.endpoints.url(i)} replied without output_ids (keys {keys})")
        return [int(t) for t in reply["output_ids"]]

    try:
        return asyncio.run(for_each_prompt(Endpoints(list(urls)), cfg, [(str(i), list(p)) for i, p in enumerate(prompts)], one))
    except (ServerError, ContractError) as e:
        raise SFTError(f"SGLang /generate failed: {e}") from e


def generate_responses(bundle, prompts: list[list[int]], cfg: ExperimentConfig, seed: int,
                       sample_ids: Optional[list[str]] = None) -> list[list[int]]:
    """New tokens for each prompt (prompt excluded), from the configured backend.

    The embedded backend is ``rollout.autoregressive_generate`` (KV cache,
    batched, per-sample generators seeded by ``seed`` and the sample id, so a
    resumed run samples what the uninterrupted one would).
    """
    kw = dict(max_new_tokens=cfg.sft.max_new_tokens, stop_token_ids=list(bundle.stop_token_ids),
              temperature=cfg.sft.temperature, seed=seed)
    if cfg.rollout.backend != "embedded":
        return sglang_generate(cfg.sglang.urls, prompts, timeout_s=cfg.sglang.request_timeout_s, **kw)
    try:
        from .rollout import autoregressive_generate
    except ImportError:
        autoregressive_generate = None
    if autoregressive_generate is not None:
        return [list(r) for r in autoregressive_generate(bundle.model, prompts, sample_ids=sample_ids,
                                                                  prefill_chunk=cfg.target.prefill_chunk, **kw)]
    pad = bundle.tokenizer.pad_token_id
    pad = bundle.stop_token_ids[0] if pad is None else pad
    return hf_generate(bundle.model, prompts, pad_token_id=pad, **kw)


def read_responses(d: Path) -> list[ResponseRecord]:
    """All response records of a responses directory, chunk by chunk, in order."""
    out = []
    for f in sorted(d.glob("chunk_*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                out.append(ResponseRecord(**json.loads(line)))
    return out


def run_responses(d: Path, tokenized: list[tuple[str, list[int]]], bundle, cfg: ExperimentConfig) -> dict:
    """Generate the responses chunk by chunk; an existing chunk file is finished work and is kept.

    Chunk c covers prompts ``[c*chunk, (c+1)*chunk)``; sampling is seeded per
    prompt id, so a resumed run writes what the uninterrupted one would.
    """
    from tqdm import tqdm

    chunk = cfg.sft.chunk_prompts
    n_chunks = math.ceil(len(tokenized) / chunk)
    stop = set(bundle.stop_token_ids)
    done_before = sum((d / f"chunk_{c:05d}.jsonl").is_file() for c in range(n_chunks))
    bar = tqdm(total=len(tokenized), desc="sft responses", unit="prompt", initial=min(len(tokenized), done_before * chunk))
    for c in range(n_chunks):
        f = d / f"chunk_{c:05d}.jsonl"
        if f.is_file():
            continue
        part = tokenized[c * chunk:(c + 1) * chunk]
        lines = [""] * len(part)  # in prompt order, whatever order the batches ran in
        from .rollout import length_batches

        for idx in length_batches([len(p) for _, p in part], cfg.sft.batch_size):
            batch = [part[i] for i in idx]
            outs = generate_responses(bundle, [p for _, p in batch], cfg, seed=cfg.data.seed,
                                      sample_ids=[pid for pid, _ in batch])
            for i, (pid, p), o in zip(idx, batch, outs):
                resp, finished = _cut_at_stop(o, stop, cfg.sft.max_new_tokens)
                lines[i] = json.dumps(ResponseRecord(pid, p, resp, finished).__dict__)
            bar.update(len(batch))
        atomic_write_bytes(f, ("\n".join(lines) + "\n").encode())
    bar.close()
    recs = read_responses(d)
    return {"samples": len(recs), "response_tokens": sum(len(r.response_ids) for r in recs),
            "finished": sum(r.finished for r in recs)}


# ---------------------------------------------------------------------------
# step 2: features


def feature_path(d: Path, i: int) -> Path:
    """SpecForge offline layout: ``rows_<i // 1000>/data_<i>.ckpt`` (sorted walk order = sample order)."""
    return d / f"rows_{i // ROWS_PER_DIR:05d}" / f"data_{i:08d}.ckpt"


def supervised_tokens(rec: ResponseRecord, max_context: int) -> int:
    """Response tokens left after truncation to ``max_context``: the sample's supervised token count."""
    return max(0, min(len(rec.prompt_ids) + len(rec.response_ids), max_context) - len(rec.prompt_ids))


def drafter_dtype(cfg: ExperimentConfig) -> str:
    """The SFT drafter's training dtype, which is also the stored features' dtype.

    ``training.mixed_precision``: "bf16" -> "bfloat16", "fp32" -> "float32",
    "auto" -> ``target.dtype``. SpecForge's offline DFlash path feeds the stored
    features straight into the drafter's ``fc``, so they must share its dtype.
    """
    mp = cfg.training.mixed_precision
    return {"bf16": "bfloat16", "fp32": "float32"}.get(mp, cfg.target.dtype)


def build_feature_sample(model, rec: ResponseRecord, layer_ids: list[int], max_context: int,
                         dtype: Optional[str] = None) -> dict:
    """One SpecForge offline DFlash sample.

    Returns ``{"input_ids": [S] int64, "loss_mask": [S] int64 (1 on response
    tokens), "hidden_states": [1, S, len(layer_ids) * H] in ``dtype`` (default: the target's)}``,
    S = prompt + response tokens truncated to ``max_context``; features are
    SpecForge's ``extract_context_feature`` of HF ``hidden_states`` (layer k =
    ``hidden_states[k + 1]``), the same call its ``spec_generate`` uses.
    """
    import torch

    from .adapter import extract_context_feature

    ids = (rec.prompt_ids + rec.response_ids)[:max_context]
    input_ids = torch.tensor(ids, dtype=torch.long)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[len(rec.prompt_ids):] = 1
    dev = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids[None].to(dev), output_hidden_states=True, use_cache=False, logits_to_keep=1)
    hs = extract_context_feature(out.hidden_states, layer_ids).cpu().contiguous()
    if dtype is not None:
        hs = hs.to(getattr(torch, dtype))
    return {"input_ids": input_ids, "loss_mask": loss_mask, "hidden_states": hs}


def plan_features(records: list[ResponseRecord], max_context: int) -> tuple[list[int], list[tuple[str, int]]]:
    """Split samples into kept indices and ``(id, supervised tokens)`` of dropped ones.

    A sample trains only with >= 2 supervised tokens (an empty response, a
    response cut off by ``max_context``, or a template that marks no assistant
    span gives fewer).
    """
    kept, dropped = [], []
    for i, r in enumerate(records):
        n = supervised_tokens(r, max_context)
        (kept.append(i) if n >= MIN_SUPERVISED_TOKENS else dropped.append((r.id, n)))
    return kept, dropped


def run_features(d: Path, records: list[ResponseRecord], get_model: Callable, layer_ids: list[int],
                 cfg: ExperimentConfig) -> dict:
    """Write one feature file per kept sample; an existing file (written atomically) is kept.

    The i-th kept sample goes to ``feature_path(d, i)`` in response order, so a
    resumed run never writes a sample twice. ``manifest.json`` lists counts.

    Raises:
        SFTError: no sample has >= 2 supervised tokens.
    """
    from tqdm import tqdm

    kept, dropped = plan_features(records, cfg.target.max_context)
    if dropped:
        warnings.warn(
            f"sft features: dropped {len(dropped)} of {len(records)} samples with fewer than "
            f"{MIN_SUPERVISED_TOKENS} supervised (response) tokens, e.g. {dropped[:3]}",
            stacklevel=2,
        )
    if not kept:
        raise SFTError(
            f"sft features: none of {len(records)} samples has >= {MIN_SUPERVISED_TOKENS} supervised tokens "
            "(empty responses or prompts filling target.max_context); check the chat template, "
            "sft.max_new_tokens and target.max_context"
        )
    model = None
    sup = 0
    for j, i in enumerate(tqdm(kept, desc="sft features", unit="sample")):
        rec = records[i]
        sup += supervised_tokens(rec, cfg.target.max_context)
        path = feature_path(d, j)
        if path.is_file():
            continue
        model = model or get_model()
        _atomic_torch_save(build_feature_sample(model, rec, layer_ids, cfg.target.max_context, drafter_dtype(cfg)), path)
    stats = {"samples": len(kept), "dropped": len(dropped), "dropped_ids": [x for x, _ in dropped],
             "supervised_tokens": sup, "target_layer_ids": layer_ids, "format": "specforge_hidden_states_v1",
             "files": [str(feature_path(d, j).relative_to(d)) for j in range(len(kept))]}
    _write_json(d / "manifest.json", stats)
    return {k: v for k, v in stats.items() if k != "files"}


# ---------------------------------------------------------------------------
# step 3: train (SpecForge subprocess)


#: The ``training.*`` fields the SFT train step reads (``specforge_run_config``). Only these key
#: it, so a field added for the OPD trainer does not restart every SFT run from scratch.
SFT_TRAINING_FIELDS = ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm", "num_epochs", "batch_size",
                       "accumulation_steps", "num_anchors", "seed", "log_interval", "attention_backend",
                       "mixed_precision")


def sft_training_inputs(cfg: ExperimentConfig) -> dict:
    """The ``training`` part of the SFT train step's key: ``SFT_TRAINING_FIELDS`` only."""
    return {k: getattr(cfg.training, k) for k in SFT_TRAINING_FIELDS}


def on_gpu(cfg: ExperimentConfig) -> bool:
    import torch

    dev = cfg.target.device
    return (dev == "auto" and torch.cuda.is_available()) or dev.startswith("cuda")


def sft_steps(cfg: ExperimentConfig, num_samples: int, gpus: int) -> tuple[int, int, int]:
    """(optimizer steps per epoch, epochs, total steps) of the SFT train step, as SpecForge counts them."""
    t = cfg.training
    # SpecForge drops the last partial batch: steps = samples // (batch * ranks) * epochs // accumulation
    steps_per_epoch = max(1, num_samples // (t.batch_size * max(1, gpus)) // t.accumulation_steps)
    num_epochs = t.num_epochs
    if cfg.sft.max_steps is not None:
        # enough epochs to reach max_steps; SpecForge stops at max_steps and its schedule spans them
        num_epochs = max(num_epochs, math.ceil(cfg.sft.max_steps / steps_per_epoch))
    return steps_per_epoch, num_epochs, cfg.sft.max_steps or steps_per_epoch * num_epochs


def specforge_run_config(cfg: ExperimentConfig, *, target_path: str, draft_config_file: Path, features: Path,
                         out_dir: Path, num_samples: int, mask_token_id: int, gpus: int,
                         nodes: Optional[Nodes] = None) -> dict:
    """The SpecForge run config (``specforge/config/schema.py``) of the SFT train step.

    CPU: ``attention_backend: sdpa`` (flex_attention has no CPU backward) and
    ``fsdp_sharding: NO_SHARD`` (FSDP1 refuses a CPU), no loader workers.
    GPU: one process per GPU, SpecForge's FSDP default; with ``nodes`` spanning
    several, ``deployment.trainer.{nnodes, master_addr, master_port}`` (every node's
    SpecForge reads its own rank from ``NODE_RANK``, so one run.yaml serves all) and
    the step counts of ``gpus x nnodes`` ranks. ``sft.specforge_overrides``
    (dotted keys) apply last.

    Raises:
        ConfigError: an override names a key outside the nesting it must extend.
        SFTError: several nodes without GPUs.
    """
    t = cfg.training
    nodes = nodes or Nodes()
    if nodes.nnodes > 1 and gpus == 0:
        raise SFTError(f"NNODES={nodes.nnodes}: a multi-node SFT needs GPUs (target.device); run it on one node on a CPU")
    steps_per_epoch, num_epochs, total = sft_steps(cfg, num_samples, gpus * nodes.nnodes)
    run = {
        "run_id": SPECFORGE_RUN_ID,
        "output_dir": str(out_dir),
        "model": {
            "target_model_path": target_path,
            "draft_model_config": str(draft_config_file),
            "torch_dtype": drafter_dtype(cfg),
            "mask_token_id": int(mask_token_id),
        },
        "data": {
            "hidden_states_path": str(features),
            "max_length": cfg.target.max_context,
        },
        "training": {
            "strategy": "dflash",
            "num_epochs": num_epochs,
            "batch_size": t.batch_size,
            "accumulation_steps": t.accumulation_steps,
            "learning_rate": t.learning_rate,
            "lr_scheduler": t.lr_scheduler,
            "warmup_ratio": t.warmup_ratio,
            "max_grad_norm": t.max_grad_norm,
            "num_anchors": t.num_anchors,
            "seed": t.seed,
            "log_interval": t.log_interval,
            "save_interval": cfg.sft.save_interval or max(1, total // 5),
            # each checkpoint carries the optimizer state (~4x the drafter); resume needs the newest only
            "max_checkpoints": 2,
            "attention_backend": t.attention_backend,
        },
    }
    if cfg.sft.max_steps is not None:
        run["training"]["max_steps"] = int(cfg.sft.max_steps)
    if cfg.sft.init_drafter:
        run["model"]["draft_checkpoint_path"] = str(cfg.resolve_path(cfg.sft.init_drafter))
    if gpus == 0:
        if t.attention_backend == "flex_attention":
            warnings.warn("training.attention_backend=flex_attention has no CPU backward; SFT uses sdpa on CPU",
                          stacklevel=2)
            run["training"]["attention_backend"] = "sdpa"
        run["training"]["fsdp_sharding"] = "NO_SHARD"
        run["data"]["dataloader_num_workers"] = 0
    else:
        run["deployment"] = {"trainer": {"nproc_per_node": gpus}}
        if nodes.nnodes > 1:
            run["deployment"]["trainer"].update(nnodes=nodes.nnodes, master_addr=nodes.master_addr,
                                                master_port=nodes.master_port)
    if cfg.output.tensorboard and gpus > 0:
        run["tracking"] = {"report_to": "tensorboard"}
    from .config import apply_override

    for k, v in cfg.sft.specforge_overrides.items():
        apply_override(run, k, v)
    return run


def validate_specforge_run(run: dict) -> None:
    """Validate ``run`` against SpecForge's schema before spending a subprocess on it.

    Raises:
        ConfigError: SpecForge rejects it (e.g. a bad ``sft.specforge_overrides`` key).
    """
    from .adapter import specforge_run_config_class

    try:
        specforge_run_config_class().model_validate(run)
    except Exception as e:  # pydantic ValidationError or SpecForge's ValueError
        raise ConfigError(f"SpecForge rejects the SFT run config (check sft.specforge_overrides): {e}") from None


def latest_checkpoint(ckpt_root: Path) -> Optional[Path]:
    """SpecForge's newest complete step directory under ``ckpt_root``, or None."""
    from .adapter import specforge_checkpoint_layout

    state_file, resolve = specforge_checkpoint_layout()
    if not ckpt_root.is_dir() or not any(ckpt_root.glob(f"{SPECFORGE_RUN_ID}-step*")):
        return None
    try:
        d = Path(resolve(str(ckpt_root)))
    except (FileNotFoundError, ValueError):
        return None
    return d if (d / state_file).is_file() else None


def run_train(d: Path, run: dict, cfg: ExperimentConfig, gpus: int) -> dict:
    """Run ``specforge train -c run.yaml`` (output streamed), resuming from its latest checkpoint.

    Raises:
        SFTError: SpecForge exits non-zero (its output above says why).
    """
    import yaml

    ckpts = Path(run["output_dir"])
    latest = latest_checkpoint(ckpts)
    if latest is not None:
        run = json.loads(json.dumps(run))
        run["training"]["resume_from"] = str(ckpts)
        run["model"].pop("draft_checkpoint_path", None)  # SpecForge: warm start and full resume are exclusive
        print(f"[sft train] resuming SpecForge from {latest.name}", flush=True)
    validate_specforge_run(run)
    run_yaml = d / "run.yaml"
    atomic_write_bytes(run_yaml, yaml.safe_dump(run, sort_keys=False).encode())
    cmd, env = _specforge_train_cmd(run_yaml)
    if run.get("deployment", {}).get("trainer", {}).get("nnodes", 1) > 1:
        _publish_launch(d.parent, run_yaml)  # the other nodes join this launch (follow_node0)
    print(f"[sft train] {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise SFTError(f"sft train: SpecForge exited with status {rc} (its log is above; run.yaml: {run_yaml}); "
                       "rerunning the same command resumes from its last checkpoint")
    latest = latest_checkpoint(ckpts)
    if latest is None:
        raise SFTError(f"sft train: SpecForge finished but wrote no checkpoint under {ckpts}")
    return {"checkpoint": str(latest), "step": int(re.search(r"-step(\d+)$", latest.name).group(1))}


def run_train_validated(d: Path, run: dict, cfg: ExperimentConfig, gpus: int, *, num_samples: int, valset,
                        target_config, flops_at, tensorboard_dir: Optional[Path], plot_path: Path) -> dict:
    """The train step in segments of ``sft.val_interval`` steps with a validation point after each
    (``specforge_opd.validation``); resumable at any point.

    Every segment is one ``specforge train`` run resumed from the previous one's checkpoint,
    with SpecForge's ``total_steps`` (the LR schedule's horizon) fixed to the whole run and
    ``max_steps`` (its early stop) at the segment's end, so the schedule is the one an
    unsegmented run follows. Each segment's checkpoint is exported to
    ``curve/step_<N>`` before SpecForge may prune it, and its validation tau recorded.

    With ``sft.plateau_patience`` set, training stops before the next segment once the
    curve has plateaued (``validation.plateaued``); ``sft.max_steps`` is then only a cap.

    Returns the step's stats: ``checkpoint``/``step`` of the last segment, ``curve``, ``selected``
    ``plateau_step`` (the step at which the plateau rule stopped it, or None) and ``paused_at``
    (``sft.pause_at_step`` reached: the step is not marked done, so the same command continues it).

    Raises:
        SFTError: a segment ended at another step than planned.
    """
    from .drafter import save_drafter
    from .validation import add_point, plateaued, plot_curve, read_curve, segment_ends, select

    steps_per_epoch, _, total = sft_steps(cfg, num_samples, gpus)
    ends = segment_ends(total, cfg.sft.val_interval or steps_per_epoch)
    curve = read_curve(d)
    tb = None
    stopped = paused = None
    for end in ends:
        if any(p["step"] == end for p in curve):
            continue
        done = max((p["step"] for p in curve), default=0)
        if cfg.sft.pause_at_step is not None and done >= cfg.sft.pause_at_step:
            paused = done
            print(f"[sft val] pausing at step {done} (sft.pause_at_step={cfg.sft.pause_at_step}); the same command "
                  "with a later or no sft.pause_at_step continues", flush=True)
            break
        if plateaued(curve, cfg.sft.plateau_patience, cfg.sft.plateau_band):
            stopped = done
            print(f"[sft val] plateau at step {stopped}: the last {cfg.sft.plateau_patience} validation points are "
                  f"within {cfg.sft.plateau_band} tau of the best before them; stopping", flush=True)
            break
        seg = json.loads(json.dumps(run))
        seg["training"]["total_steps"] = total
        seg["training"]["max_steps"] = end
        seg_stats = run_train(d, seg, cfg, gpus)
        if seg_stats["step"] != end:
            raise SFTError(f"sft train: the segment to step {end} ended at step {seg_stats['step']} "
                           f"({seg_stats['checkpoint']}); delete that train directory to start the step again")
        model = load_specforge_checkpoint(seg_stats["checkpoint"], target_config)
        export = save_drafter(model, d / "curve" / f"step_{end:07d}", metadata={"stage": "sft", "step": end,
                                                                                 "target_dtype": cfg.target.dtype},
                              dtype=cfg.target.dtype)
        tau = valset.tau(model)
        curve = add_point(d, {"step": end, "tau": tau, "drafter_flops": flops_at(end), "export": str(export),
                              "checkpoint": seg_stats["checkpoint"]})
        print(f"[sft val] step {end}/{total}: validation tau {tau:.3f} on {len(valset.prompts)} prompts", flush=True)
        if tensorboard_dir is not None:
            if tb is None:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(tensorboard_dir))
            tb.add_scalar("sft/val_tau", tau, end)
            tb.flush()
    if tb is not None:
        tb.close()
    last = max(curve, key=lambda p: p["step"])  # the newest segment, whether it ran now or before
    stats = {"checkpoint": last["checkpoint"], "step": last["step"]}
    if stopped is None and plateaued(curve, cfg.sft.plateau_patience, cfg.sft.plateau_band):
        stopped = max(p["step"] for p in curve)
    stats["plateau_step"] = stopped
    stats["paused_at"] = paused
    chosen = select(curve, cfg.sft.select)
    plot_curve(curve, plot_path, chosen["step"])
    print(f"[sft val] exporting step {chosen['step']} (sft.select={cfg.sft.select}: validation tau {chosen['tau']:.3f}); "
          f"curve: {plot_path}", flush=True)
    return dict(stats, curve=curve, selected=chosen)


# ---------------------------------------------------------------------------
# SpecForge checkpoints -> DFlashDraftModel


def _resolve_state_file(path: Path) -> Path:
    from .adapter import specforge_checkpoint_layout
    from .drafter import DrafterError

    state_file, resolve = specforge_checkpoint_layout()
    if path.is_file():
        if path.name != state_file:
            raise DrafterError(f"{path} is not a SpecForge {state_file}")
        return path
    if (path / state_file).is_file():
        return path / state_file
    try:
        return Path(resolve(str(path))) / state_file
    except (FileNotFoundError, ValueError) as e:
        raise DrafterError(f"{path}: no SpecForge checkpoint ({state_file}, a -step<N> dir or a -latest link): {e}")


def recorded_draft_config(state: dict) -> Optional[dict]:
    """The draft config.json a SpecForge checkpoint was trained with, if still on disk unchanged.

    SpecForge records ``("file-stat-v2", path, ("sha256", "", size, digest))``
    under ``specforge_model_provenance["draft_config"]``; the file is trusted
    only when its sha256 still matches. Returns the parsed JSON or None.
    """
    try:
        rec = dict(state.get("specforge_model_provenance") or ()).get("draft_config")
        _kind, fpath, (algo, _name, _size, digest) = rec
        data = Path(fpath).read_bytes()
    except (TypeError, ValueError, OSError):
        return None
    if algo != "sha256" or hashlib.sha256(data).hexdigest() != digest:
        return None
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return None


def load_specforge_checkpoint(path: str | os.PathLike, target_config, attention_backend: str = "sdpa"):
    """Load the drafter of a SpecForge DFlash checkpoint without unpickling code.

    ``path``: a ``training_state.pt``, a ``<run>-step<N>`` directory, a
    ``<run>-latest`` link, or the run's output directory. The state is read with
    ``torch.load(weights_only=True)`` (tensors and plain metadata only; SpecForge's
    own resume uses ``weights_only=False``, which this project forbids). The
    architecture comes from the checkpoint's ``dflash_*`` resume contract and
    the target config (hidden size, heads, vocabulary); the MLP width from the
    weights. Returns a ``DFlashDraftModel`` in fp32 on CPU.

    Raises:
        DrafterError: no checkpoint there, not weights-only readable, not a
            DFlash checkpoint, or weights that do not fit the target.
    """
    import torch

    from .drafter import DrafterError, build_drafter, check_compatible, derive_draft_config

    state_path = _resolve_state_file(Path(path))
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DrafterError(
            f"{state_path} cannot be read safely (torch.load weights_only=True): {e}; "
            "export it to an HF directory with a trusted SpecForge install and pass that instead"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise DrafterError(f"{state_path} has no draft_state_dict (not a SpecForge training state)")
    if state.get("strategy") not in (None, "dflash"):
        raise DrafterError(f"{state_path} was trained with strategy {state.get('strategy')!r}, not dflash")
    need = ("dflash_draft_num_hidden_layers", "dflash_target_layer_ids", "dflash_block_size", "dflash_mask_token_id")
    missing = [k for k in need if k not in state]
    if missing:
        raise DrafterError(f"{state_path} lacks the DFlash resume contract fields {missing}")
    weights = {k: v for k, v in state["draft_state_dict"].items() if "embed_tokens" not in k and "lm_head" not in k}
    t = getattr(target_config, "text_config", target_config)
    fc = weights.get("fc.weight")
    if fc is not None and fc.shape[0] != t.hidden_size:
        raise DrafterError(f"drafter {state_path} does not fit the target: hidden size {fc.shape[0]} != target "
                           f"{t.hidden_size}")
    # The drafter borrows the target's embedding and lm_head, so its weights do not
    # show the vocabulary; the draft config it was trained with does.
    recorded = recorded_draft_config(state)
    if recorded is None:
        warnings.warn(f"{state_path}: its draft config.json is gone or changed; the vocabulary it was trained "
                      "for cannot be checked against the target", stacklevel=2)
    else:
        problems = [f"{k} {recorded[k]} != target {getattr(t, k)}" for k in ("vocab_size", "hidden_size")
                    if k in recorded and recorded[k] != getattr(t, k)]
        n = recorded.get("num_target_layers")
        if n is not None and n != t.num_hidden_layers:
            problems.append(f"num_target_layers {n} != target's {t.num_hidden_layers} layers")
        if problems:
            raise DrafterError(f"drafter {state_path} does not fit the target: " + "; ".join(problems))
    gate = weights.get("layers.0.mlp.gate_proj.weight")
    try:
        dcfg = derive_draft_config(
            target_config,
            num_hidden_layers=int(state["dflash_draft_num_hidden_layers"]),
            block_size=int(state["dflash_block_size"]),
            mask_token_id=int(state["dflash_mask_token_id"]),
            target_layer_ids=[int(i) for i in state["dflash_target_layer_ids"]],
            intermediate_size=int(gate.shape[0]) if gate is not None else None,
        )
    except DrafterError as e:
        raise DrafterError(f"drafter {state_path} does not fit the target: {e}") from None
    check_compatible(dcfg, target_config)
    model = build_drafter(dcfg, attention_backend)
    try:
        missing_k, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    except RuntimeError as e:
        raise DrafterError(f"drafter {state_path} weights do not fit the target-derived architecture: {e}") from None
    missing_k = [k for k in missing_k if "embed_tokens" not in k and "lm_head" not in k]
    if missing_k or unexpected:
        raise DrafterError(f"drafter {state_path}: weights do not match (missing {missing_k[:5]}, "
                           f"unexpected {list(unexpected)[:5]})")
    return model.float()


def load_any_drafter(path: str | os.PathLike, target_config, *, expected_mask_token_id: Optional[int] = None,
                     attention_backend: str = "sdpa", target_dtype: Optional[str] = None):
    """Load an existing drafter to reuse instead of SFT (DESIGN.md section 6, "In").

    Accepts a SpecForge step directory / ``training_state.pt`` / ``-latest``
    link / run directory, a SpecForge HF export, our export, or a published
    DFlash directory. Compatibility with the target (hidden size, target layer
    count, vocabulary, mask token) is checked before use; with ``target_dtype``
    (``target.dtype``) an HF directory whose ``config.json`` declares the other half precision
    (bfloat16 against float16) is refused (``drafter.load_drafter``).

    Raises:
        DrafterError: the path holds no drafter, or what does not fit the target.
    """
    from .drafter import DrafterError, check_compatible, drafter_path, load_draft_config, load_drafter

    p = drafter_path(path)
    if not p.exists():
        raise DrafterError(f"drafter path {p} does not exist (draft.path)")
    if p.is_dir() and (p / "config.json").is_file():
        check_compatible(load_draft_config(p), target_config, expected_mask_token_id=expected_mask_token_id)
        return load_drafter(p, attention_backend, target_config=target_config, target_dtype=target_dtype)
    model = load_specforge_checkpoint(p, target_config, attention_backend)
    check_compatible(model.config, target_config, expected_mask_token_id=expected_mask_token_id)
    return model


# ---------------------------------------------------------------------------
# step 4: export + verification


class _CallCounter:
    """Counts forward calls of a module (the target's verify steps inside ``spec_generate``)."""

    def __init__(self, module):
        self.n = 0
        self._h = module.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))

    def close(self):
        self._h.remove()


def _greedy(model, prompt: list[int], max_new: int, stop: list[int]) -> list[int]:
    import torch

    dev = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt], device=dev), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=stop, pad_token_id=stop[0])
    return _cut_at_stop(out[0, len(prompt):].tolist(), set(stop), max_new)[0]


def _top2_gap(model, prefix: list[int]) -> float:
    import torch

    dev = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prefix], device=dev), logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def verify_export(drafter, target_model, prompts: list[list[int]], stop_token_ids: list[int], max_new: int) -> dict:
    """Speculative decoding with ``drafter`` must reproduce greedy target decoding.

    Uses SpecForge's ``DFlashDraftModel.spec_generate`` at temperature 0. A
    divergence is tolerated only where the target's top-2 logit gap on the
    greedy prefix is below 1e-4 (DESIGN.md section 3, "Numerical ties").
    Returns ``{"prompts", "tokens", "verify_steps", "tau"}``; tau = completion
    tokens (prefill token included) / verify steps, pooled over the prompts.

    Raises:
        SFTError: an output differs from greedy decoding at a non-tie position.
    """
    import torch

    drafter = drafter.to(next(target_model.parameters()).device).eval()
    tokens = steps = 0
    for p in prompts:
        ref = _greedy(target_model, p, max_new, stop_token_ids)
        counter = _CallCounter(target_model)
        try:
            with torch.inference_mode():
                out = drafter.spec_generate(target_model, torch.tensor([p], device=next(target_model.parameters()).device),
                                            max_new, list(stop_token_ids), 0.0)
        finally:
            counter.close()
        got = out[0, len(p):].tolist()
        n = min(len(got), len(ref))
        first = next((j for j in range(n) if got[j] != ref[j]), None)
        if first is None and len(got) != len(ref):
            first = n
        if first is not None and first < min(len(got), len(ref)):
            gap = _top2_gap(target_model, p + ref[:first])
            if gap >= 1e-4:
                raise SFTError(f"sft export check: speculative output differs from greedy decoding at response "
                               f"token {first} (top-2 gap {gap:.3g}, not a tie): the export or its "
                               "mask token / layer ids are wrong")
        elif first is not None:
            raise SFTError(f"sft export check: speculative output has {len(got)} tokens, greedy {len(ref)}")
        tokens += len(got)
        steps += max(1, counter.n - 1)  # the first call is the prefill
    return {"prompts": len(prompts), "tokens": tokens, "verify_steps": steps,
            "tau": tokens / steps if steps else float("nan")}


# ---------------------------------------------------------------------------
# the stage


@dataclass
class SFTInputs:
    """What ``run_sft`` works on; tests pass their own (tiny target, own prompts)."""

    bundle_loader: Callable[[], Any]
    target_path: str
    prompts: Optional[Sequence] = None
    timings: dict = field(default_factory=dict)


def _load_bundle(cfg: ExperimentConfig):
    from .target import load_target

    return load_target(cfg.target)


def _load_prompts(cfg: ExperimentConfig) -> list:
    from .prompts import training_pool

    pool = list(training_pool(cfg.data))
    return pool[: cfg.data.num_prompts] if cfg.data.num_prompts is not None else pool


def _load_val_prompts(cfg: ExperimentConfig) -> list:
    """``sft.val_prompts`` records of the training pool right after the ``data.num_prompts`` SFT trains on.

    Raises:
        SFTError: ``data.num_prompts`` is unset (the whole pool trains), or the pool has no prompt left.
    """
    from .prompts import training_pool

    if cfg.data.num_prompts is None:
        raise SFTError("sft.val_prompts needs data.num_prompts: validation prompts come from the pool after the ones SFT trains on")
    # the pool is shuffled with data.seed and then capped, so a larger cap keeps the trained prompts first
    n = cfg.data.num_prompts
    pool = list(training_pool(cfg.data.model_copy(update={"num_prompts": n + cfg.sft.val_prompts})))
    val = pool[n: n + cfg.sft.val_prompts]
    if not val:
        raise SFTError(f"sft.val_prompts={cfg.sft.val_prompts}: the pool has no prompt after data.num_prompts="
                       f"{cfg.data.num_prompts}; lower data.num_prompts or add data slices")
    return val


def run_sft(cfg: ExperimentConfig, **kwargs) -> Path:
    """Run the SFT stage end to end on this node (``_run_sft``: arguments, outputs, errors).

    With ``NNODES`` > 1 (``nodes_from_env``) every node runs this: node 0 runs the stage,
    the others join its SpecForge training (``follow_node0``); ``output.dir`` must be on a
    filesystem every node sees. Returns ``<output.dir>/final``.

    Raises:
        SFTError, ConfigError, DrafterError: with the step and the fix named.
    """
    nodes = nodes_from_env()
    if nodes.nnodes == 1:
        return _run_sft(cfg, **kwargs)
    if not on_gpu(cfg):
        raise SFTError(f"NNODES={nodes.nnodes}: a multi-node SFT needs GPUs (target.device); run it on one node on a CPU")
    if cfg.sft.plateau_patience:
        # node 0 decides alone when the plateau stops training; the others could not know
        raise SFTError(f"NNODES={nodes.nnodes} with sft.plateau_patience={cfg.sft.plateau_patience}: set "
                       "sft.plateau_patience=0 (and sft.max_steps) for a multi-node SFT")
    out = Path(cfg.resolve_path(cfg.output.dir))
    if nodes.node_rank > 0:
        return follow_node0(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        final = _run_sft(cfg, **kwargs)
    except BaseException as e:
        _publish_launch(out, end=True, error=f"{type(e).__name__}: {e}"[:500])
        raise
    _publish_launch(out, end=True)
    return final


def _run_sft(cfg: ExperimentConfig, *, bundle=None, prompts: Optional[Sequence] = None,
             target_path: Optional[str] = None, val_prompts: Optional[Sequence] = None,
             max_steps_for: Optional[Callable[[list], int]] = None) -> Path:
    """Run the SFT stage end to end; returns the exported HF DFlash directory ``<output.dir>/final``.

    ``bundle`` (a ``TargetBundle``-like object with ``model``, ``tokenizer``,
    ``stop_token_ids``), ``prompts`` (``PromptRecord``-like) and ``target_path``
    (HF directory SpecForge loads the target embedding / lm_head / tokenizer
    from) default to ``target.load_target``, ``prompts.training_pool`` and
    ``target_dir(cfg)``; ``val_prompts`` (records, with ``sft.val_prompts`` > 0)
    defaults to the pool's prompts after the trained ones. ``max_steps_for``, given the
    finished responses (``ResponseRecord`` list), sets ``sft.max_steps`` before training:
    a budget that depends on the data (the matched-FLOPs baseline). Writes ``<output.dir>/sft_report.json`` (wall time per
    step, disk used, the export check's tau).

    Raises:
        SFTError, ConfigError, DrafterError: with the step and the fix named.
    """
    out = Path(cfg.resolve_path(cfg.output.dir))
    out.mkdir(parents=True, exist_ok=True)
    tpath = target_path or target_dir(cfg)
    timings: dict[str, float] = {}
    skipped: list[str] = []
    cache: dict[str, Any] = {"bundle": bundle}

    def get_bundle():
        if cache["bundle"] is None:
            print("[sft] loading target", flush=True)
            cache["bundle"] = _load_bundle(cfg)
        return cache["bundle"]

    from transformers import AutoConfig, AutoTokenizer

    target_config = get_bundle().model.config if bundle is not None else AutoConfig.from_pretrained(tpath)
    tokenizer = bundle.tokenizer if bundle is not None else AutoTokenizer.from_pretrained(tpath)
    mask = resolve_mask_token_id(cfg, target_config, tokenizer)
    dcfg = make_draft_config(cfg, target_config, mask)
    layer_ids = [int(i) for i in dcfg.dflash_config["target_layer_ids"]]
    tid = target_identity(tpath)

    # -- responses
    t0 = time.time()
    records_in = list(prompts) if prompts is not None else _load_prompts(cfg)
    if not records_in:
        raise SFTError("sft responses: the training prompt pool is empty (check data.train_sources and data.slices)")
    tokenized, too_long = tokenize_prompts(records_in, tokenizer, cfg)
    if not tokenized:
        raise SFTError(f"sft responses: all {len(records_in)} prompts are longer than {_prompt_limit(cfg)} tokens")
    r_inputs = {"target": tid, "prompts": hash_inputs({"p": tokenized}), "n": len(tokenized),
                "temperature": cfg.sft.temperature, "max_new_tokens": cfg.sft.max_new_tokens,
                "chunk": cfg.sft.chunk_prompts, "seed": cfg.data.seed, "stop": list(cfg.target.stop_token_ids),
                "backend": cfg.rollout.backend}
    r_key = hash_inputs(r_inputs)
    r_dir = _reusable_step(cfg, out, "responses", r_key)
    _keyed_step("responses", r_dir, r_key, r_inputs,
                lambda: dict(run_responses(r_dir, tokenized, get_bundle(), cfg), prompts_too_long_skipped=too_long), skipped)
    timings["responses"] = time.time() - t0
    if max_steps_for is not None:
        steps = int(max_steps_for(read_responses(r_dir)))
        cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"max_steps": steps})})

    # -- features
    t0 = time.time()
    f_inputs = {"responses": r_key, "target": tid, "layer_ids": layer_ids, "max_context": cfg.target.max_context,
                "dtype": drafter_dtype(cfg)}
    f_key = hash_inputs(f_inputs)
    f_dir = _reusable_step(cfg, out, "features", f_key)
    _keyed_step("features", f_dir, f_key, f_inputs,
                lambda: run_features(f_dir, read_responses(r_dir), lambda: get_bundle().model, layer_ids, cfg), skipped)
    n_samples = json.loads((f_dir / MARKER).read_text())["stats"]["samples"]
    timings["features"] = time.time() - t0

    # -- train
    t0 = time.time()
    gpus = _gpu_count() if on_gpu(cfg) else 0
    dcfg_dict = draft_config_dict(dcfg)
    t_inputs = {"features": f_key, "draft": dcfg_dict, "training": sft_training_inputs(cfg),
                "overrides": cfg.sft.specforge_overrides, "save_interval": cfg.sft.save_interval, "gpus": gpus,
                "init_drafter": cfg.sft.init_drafter, "max_steps": cfg.sft.max_steps}
    nodes = nodes_from_env()
    if nodes.nnodes > 1:  # the step counts change with the ranks (one node keeps its earlier keys)
        t_inputs["nnodes"] = nodes.nnodes
    val_tok: list = []
    if cfg.sft.val_prompts:
        val_recs = list(val_prompts) if val_prompts is not None else _load_val_prompts(cfg)
        val_tok, _ = tokenize_prompts(val_recs, tokenizer, cfg)
        if not val_tok:
            raise SFTError(f"sft.val_prompts: all {len(val_recs)} validation prompts are longer than {_prompt_limit(cfg)} tokens")
        t_inputs["validation"] = {"prompts": hash_inputs({"p": val_tok}), "interval": cfg.sft.val_interval,
                                  "select": cfg.sft.select}
    t_key = hash_inputs(t_inputs)
    t_dir = step_dir(out, "train", t_key)

    def train() -> dict:
        dfile = t_dir / "draft_config" / "config.json"
        text = json.dumps(dcfg_dict, indent=2, sort_keys=True) + "\n"
        # SpecForge's resume contract hashes this file: rewrite only when it changed.
        if not dfile.is_file() or dfile.read_text() != text:
            atomic_write_bytes(dfile, text.encode())
        run = specforge_run_config(cfg, target_path=tpath, draft_config_file=dfile, features=f_dir,
                                   out_dir=t_dir / "checkpoints", num_samples=n_samples, mask_token_id=mask, gpus=gpus,
                                   nodes=nodes)
        if not val_tok:
            return run_train(t_dir, run, cfg, gpus)
        from .validation import ValidationSet

        b = get_bundle()
        valset = ValidationSet(b.model, tid, [p for _, p in val_tok], max_new_tokens=cfg.sft.max_new_tokens,
                               stop_token_ids=list(b.stop_token_ids), cache_dir=out / "val_trajectories")
        responses = read_responses(r_dir)
        init = (FlopsLedger.from_dict(read_drafter_metadata(cfg.resolve_path(cfg.sft.init_drafter)).get("flops"))
                if cfg.sft.init_drafter else FlopsLedger())

        def flops_at(step: int) -> float:
            here = sft_flops(cfg, dcfg, target_config, responses, steps=step,
                             captured_here=r_dir.resolve().is_relative_to(out.resolve()))
            return init.add(here).drafter_budget

        # segment ends count the steps of every rank on every node
        return run_train_validated(t_dir, run, cfg, gpus * nodes.nnodes, num_samples=n_samples, valset=valset, target_config=target_config,
                                   flops_at=flops_at, tensorboard_dir=out / "tensorboard" if cfg.output.tensorboard else None,
                                   plot_path=out / "sft_curve.png")

    from .drafter import read_drafter_metadata, save_drafter
    from .flops import FlopsLedger

    train_stats = _keyed_step("train", t_dir, t_key, t_inputs, train, skipped)
    ckpt = Path(train_stats["checkpoint"])
    chosen = train_stats.get("selected")
    timings["train"] = time.time() - t0

    # -- export
    t0 = time.time()

    final = out / "final"
    meta = read_drafter_metadata(final) if final.is_dir() else {}
    if (meta.get("sft_key") == t_key and meta.get("verify") is not None
            and (chosen is None or meta.get("step") == chosen["step"])):
        skipped.append("export")
        verify = meta["verify"]
        print(f"[sft export] done already: {final}", flush=True)
    else:
        if chosen is not None:  # the validated checkpoint, exported before SpecForge could prune it
            from .drafter import load_drafter

            model = load_drafter(chosen["export"], target_config=target_config, target_dtype=cfg.target.dtype)
            ckpt = Path(chosen["checkpoint"])
        else:
            model = load_specforge_checkpoint(ckpt, target_config)
        b = get_bundle()
        held = [p for _, p in tokenized[-cfg.sft.verify_prompts:]] if cfg.sft.verify_prompts else []
        verify = verify_export(model, b.model, held, list(b.stop_token_ids), cfg.sft.verify_max_new_tokens)
        if verify["prompts"]:
            print(f"[sft export] speculative decode == greedy on {verify['prompts']} prompts; tau {verify['tau']:.3f}",
                  flush=True)
        else:
            print("[sft export] lossless check skipped (sft.verify_prompts=0)", flush=True)
        responses = read_responses(r_dir)
        step = int(chosen["step"] if chosen is not None else train_stats["step"])
        ledger = sft_flops(cfg, dcfg, target_config, responses, steps=step,
                           captured_here=r_dir.resolve().is_relative_to(out.resolve()))
        if cfg.sft.init_drafter:
            ledger = FlopsLedger.from_dict(read_drafter_metadata(cfg.resolve_path(cfg.sft.init_drafter)).get("flops")).add(ledger)
        save_drafter(model, final, metadata={"stage": "sft", "sft_key": t_key, "specforge_checkpoint": str(ckpt),
                                             "target": tpath, "target_identity": tid, "target_dtype": cfg.target.dtype,
                                             "samples": n_samples,
                                             "step": step, "verify": verify,
                                             "init_drafter": cfg.sft.init_drafter, "flops": ledger.to_dict(),
                                             "validation": None if chosen is None else {
                                                 "select": cfg.sft.select, "selected_step": step,
                                                 "selected_tau": chosen["tau"], "curve": train_stats["curve"],
                                                 "val_prompts": len(val_tok),
                                                 "plateau_step": train_stats.get("plateau_step"),
                                                 "paused_at": train_stats.get("paused_at")}},
                     dtype=cfg.target.dtype)
        from .drafter import load_drafter

        load_drafter(final, target_config=target_config, target_dtype=cfg.target.dtype)  # the export must load back through the public loader
    timings["export"] = time.time() - t0

    report = {"final": str(final), "timings_s": timings, "skipped": skipped, "verify": verify,
              "validation": None if chosen is None else {"selected": chosen, "curve": train_stats["curve"]},
              "disk_bytes": {d.name: dir_bytes(d) for d in (r_dir, f_dir, t_dir, final)}}
    report["disk_bytes"]["total"] = dir_bytes(out)
    _write_json(out / "sft_report.json", report)
    print(f"[sft] done: {final} | " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())
          + f" | disk {report['disk_bytes']['total'] / 2**20:.1f} MiB", flush=True)
    return final


def sft_flops(cfg: ExperimentConfig, draft_config, target_config, responses: list, *, steps: int,
              captured_here: bool = True):
    """FLOPs of this SFT run as a ``flops.FlopsLedger`` (``specforge_opd.flops`` conventions).

    ``drafter_train`` = steps x batch_size x the mean per-sequence cost of SpecForge's
    DFlash SFT (``flops.sft_step_flops`` with ``training.num_anchors``) over the
    training samples. ``target_capture`` = response generation (plain decoding)
    plus the feature capture forward of every sample; 0 when the responses and
    features were reused from another run (``sft.reuse_from``: already paid there).
    """
    from .flops import FlopsLedger, autoregressive_target_flops, capture_target_flops, sft_step_flops

    lens = [len(r.prompt_ids) + len(r.response_ids) for r in responses] or [0]
    per_seq = sum(sft_step_flops(draft_config, seq_len=n, num_anchors=cfg.training.num_anchors)["total"] for n in lens) / len(lens)
    ledger = FlopsLedger(drafter_train=float(per_seq * cfg.training.batch_size * cfg.training.accumulation_steps * steps))
    if captured_here:
        for r in responses:
            ledger.target_capture += autoregressive_target_flops(target_config, prompt_len=len(r.prompt_ids), new_tokens=len(r.response_ids))
            ledger.target_capture += capture_target_flops(target_config, seq_len=len(r.prompt_ids) + len(r.response_ids))
    return ledger


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


# ---------------------------------------------------------------------------
# --dry-run


def _plan_target_config(cfg: ExperimentConfig):
    """The target's HF config without loading weights: a local dir, the embedded target, or a Qwen3 fixture."""
    from transformers import AutoConfig

    if cfg.target.path is not None:
        p = cfg.resolve_path(cfg.target.path)
        if p is not None and (p / "config.json").is_file():
            return AutoConfig.from_pretrained(str(p)), str(p)
        m = re.search(r"qwen3-(\d+b(?:-a\d+b)?)", cfg.target.path.lower())
        if m:
            from . import assets

            fx = assets.qwen3_fixture_dir(m.group(1))
            if not (fx / "config.json").is_file():
                raise ConfigError(f"dry run of target.path={cfg.target.path!r} needs the Qwen3 config fixture "
                                  f"{fx}/config.json, which is missing (reinstall the package)")
            return AutoConfig.from_pretrained(str(fx)), f"{cfg.target.path} (config fixture {fx})"
        raise ConfigError(f"target.path={cfg.target.path!r} is neither a local HF directory nor a known Qwen3 size "
                          "(dry run reads the config only)")
    d = target_dir(cfg)
    return AutoConfig.from_pretrained(d), d


def estimate(cfg: ExperimentConfig, target_config, draft_config, num_prompts: Optional[int]) -> dict:
    """Upper-bound memory and disk estimates of the SFT stage (bytes; no weights loaded).

    Sequences are assumed to fill ``data.max_prompt_tokens + sft.max_new_tokens``
    (capped by ``target.max_context``). Features: S * n_layers * H * bytes of the
    drafter's dtype (``drafter_dtype``) per sample. Train: fp32 drafter weights + grads + Adam moments (16 B/param),
    the frozen embedding and lm_head in the run dtype, and SpecForge's DFlash
    logits chunk of min(num_anchors, 128) blocks * block_size * vocab fp32 (x3 for
    softmax and its gradient).
    """
    t = getattr(target_config, "text_config", target_config)
    H, V, L = int(t.hidden_size), int(t.vocab_size), int(t.num_hidden_layers)
    dt = _DTYPE_BYTES[cfg.target.dtype]
    S = min(cfg.target.max_context, cfg.data.max_prompt_tokens + cfg.sft.max_new_tokens)
    n_ids = len(draft_config.dflash_config["target_layer_ids"])
    inter = int(getattr(t, "intermediate_size", 4 * H))
    n_experts = int(getattr(t, "num_experts", 0) or 0)
    moe_inter = int(getattr(t, "moe_intermediate_size", 0) or 0)
    heads, kv, hd = int(t.num_attention_heads), int(t.num_key_value_heads), int(getattr(t, "head_dim", H // t.num_attention_heads) or H // t.num_attention_heads)
    attn = H * hd * (heads * 2 + kv * 2)
    mlp = 3 * H * (moe_inter * n_experts if n_experts else inter)
    target_params = L * (attn + mlp) + 2 * V * H
    dl = draft_config.num_hidden_layers
    d_inter = int(draft_config.intermediate_size)
    d_attn = H * int(draft_config.head_dim) * (draft_config.num_attention_heads * 2 + draft_config.num_key_value_heads * 2)
    draft_params = dl * (d_attn + 3 * H * d_inter) + n_ids * H * H
    blocks = min(cfg.training.num_anchors, 128)
    logits = blocks * draft_config.block_size * V * 4 * 3
    per_sample = S * (n_ids * H * _DTYPE_BYTES[drafter_dtype(cfg)] + 16)
    n = num_prompts
    return {
        "target_params": target_params,
        "target_weights_bytes": target_params * dt,
        "drafter_params": draft_params,
        "train_memory_bytes_per_rank": draft_params * 16 + 2 * V * H * dt + logits * cfg.training.batch_size,
        "feature_bytes_per_sample_max": per_sample,
        "features_disk_bytes_max": per_sample * n if n else None,
        "responses_disk_bytes_max": S * 8 * n if n else None,
        "max_sequence_tokens": S,
    }


def dry_run(cfg: ExperimentConfig) -> dict:
    """Print every step, the draft config and the estimates; loads no weights."""
    tconf, where = _plan_target_config(cfg)
    mask = resolve_mask_token_id(cfg, tconf, None)
    dcfg = make_draft_config(cfg, tconf, mask)
    n = cfg.data.num_prompts
    est = estimate(cfg, tconf, dcfg, n)
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    out = cfg.resolve_path(cfg.output.dir)
    print(f"SFT stage plan for {cfg.name} (dry run: no weights loaded)")
    print(f"  target: {where}")
    print(f"  prompts: {n if n is not None else 'the whole pool'} from {cfg.data.train_sources} "
          f"(slices {cfg.data.slices} of {cfg.data.num_slices}); thinking={cfg.target.thinking}")
    print(f"  1. responses -> {out}/responses-<key>/chunk_*.jsonl: backend {cfg.rollout.backend}, "
          f"temperature {cfg.sft.temperature}, max_new_tokens {cfg.sft.max_new_tokens}, batch {cfg.sft.batch_size}; "
          f"disk <= {gib(est['responses_disk_bytes_max'])}")
    print(f"  2. features -> {out}/features-<key>/rows_*/data_*.ckpt: target layers "
          f"{dcfg.dflash_config['target_layer_ids']}, <= {est['feature_bytes_per_sample_max'] / 2**20:.1f} MiB/sample, "
          f"disk <= {gib(est['features_disk_bytes_max'])}; samples with < {MIN_SUPERVISED_TOKENS} response tokens dropped")
    print(f"  3. train -> {out}/train-<key>/checkpoints: specforge train (dflash, {cfg.training.num_epochs} epochs, "
          f"lr {cfg.training.learning_rate}, num_anchors {cfg.training.num_anchors}, batch {cfg.training.batch_size}); "
          f"memory ~{gib(est['train_memory_bytes_per_rank'])} per rank; target weights {gib(est['target_weights_bytes'])}")
    print(f"  4. export -> {out}/final (HF DFlash, SGLang-loadable), verified against greedy decoding "
          f"on {cfg.sft.verify_prompts} prompts")
    print("  draft config:")
    print("    " + json.dumps(draft_config_dict(dcfg), sort_keys=True).replace(", \"", ",\n    \""))
    print(f"  drafter params {est['drafter_params'] / 1e6:.1f}M; target params {est['target_params'] / 1e9:.2f}B")
    return {"draft_config": draft_config_dict(dcfg), "estimate": est}


# ---------------------------------------------------------------------------
# CLI


def cli(argv: list[str]) -> int:
    """``specforge-opd sft -c CFG [section.field=value ...] [--dry-run] [--out DIR]``."""
    from .cli import experiment_parser, parse_experiment
    from .drafter import DrafterError

    parser = experiment_parser("sft", "the SFT stage on SpecForge (responses, features, train, export)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, draft config and estimates; load nothing")
    args, cfg = parse_experiment(parser, argv)
    if args.dry_run:
        dry_run(cfg)
        return 0
    try:
        run_sft(cfg)
    except (SFTError, DrafterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
