"""Feature capture for SFT: the target's hidden states over each prompt + response, in SpecForge's offline layout.

Step 2 of the SFT stage. Each kept sample becomes one SpecForge offline DFlash feature
file ``rows_<i // 1000>/data_<i>.ckpt`` = ``torch.save({input_ids [S] int64, loss_mask
[S] int64, hidden_states [1, S, n*H]})``, ``loss_mask`` 1 exactly on response tokens,
features at the drafter's ``target_layer_ids`` (layer k = HF ``hidden_states[k + 1]``,
DESIGN.md section 3) in the drafter's training dtype, plus a ``manifest.json``. Files
are written atomically one by one, so a killed capture resumes at the first missing one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from specforge_opd.atomic import atomic_link, atomic_write, atomic_write_json
from specforge_opd.config import ExperimentConfig
from specforge_opd.precision import Precision, resolve_sft
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.decode import TargetRunner, capture
from specforge_opd.rollout.engine import length_batches
from specforge_opd.rollout.responses import ResponseRecord
from specforge_opd.stepkeys import SFTError

#: Feature files per ``rows_*`` directory (keeps directories listable at 100K samples).
ROWS_PER_DIR = 1000
#: Sequences per capture forward. Capture is compute-bound: on the 2-core CPU batches of 1-8
#: ran at 3.7-4.0 samples/s (the HF forward one at a time: 3.8), 32 at 2.2 (its
#: attention scores no longer fit the cache).
CAPTURE_BATCH = 4


#: DFlash anchors need a supervised token and a supervised successor
#: (SpecForge's ``has_consecutive_supervised_tokens``); fewer cannot train.
MIN_SUPERVISED_TOKENS = 2


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))


def feature_path(d: Path, i: int) -> Path:
    """SpecForge offline layout: ``rows_<i // 1000>/data_<i>.ckpt`` (sorted walk order = sample order)."""
    return d / f"rows_{i // ROWS_PER_DIR:05d}" / f"data_{i:08d}.ckpt"


def supervised_tokens(rec: ResponseRecord, max_context: int) -> int:
    """Response tokens left after truncation to ``max_context``: the sample's supervised token count."""
    return max(0, min(len(rec.prompt_ids) + len(rec.response_ids), max_context) - len(rec.prompt_ids))


def sft_precision(cfg: ExperimentConfig) -> Precision:
    """``training.mixed_precision`` resolved for the SFT stage on this machine (``precision.resolve_sft``).

    ``auto``: ``target.dtype`` on a GPU; on a CPU bf16 only where the CPU computes bf16
    natively (AVX512-BF16/AMX), fp32 otherwise.
    """
    return resolve_sft(cfg.training.mixed_precision, cfg.target.dtype, cfg.target.device)


def drafter_dtype(cfg: ExperimentConfig) -> str:
    """The SFT drafter's training dtype, which is also the stored features' dtype: ``sft_precision(cfg).dtype``.

    SpecForge's offline DFlash path feeds the stored features straight into the
    drafter's ``fc``, so they must share its dtype.
    """
    return sft_precision(cfg).dtype


def sample_ids(rec: ResponseRecord, max_context: int) -> list[int]:
    """The sample's tokens: prompt + response, truncated to ``max_context``."""
    return (rec.prompt_ids + rec.response_ids)[:max_context]


def feature_sample(rec: ResponseRecord, ids: list[int], features, dtype: Optional[str] = None) -> dict:
    """One SpecForge offline DFlash sample from a sequence's captured features.

    Returns ``{"input_ids": [S] int64, "loss_mask": [S] int64 (1 on response tokens),
    "hidden_states": [1, S, n * H] in ``dtype`` (default: as given)}``; ``ids`` = ``sample_ids(rec, ...)``
    (S tokens) and ``features`` [S, n * H] = ``decode.capture`` at the drafter's ``target_layer_ids``
    (layer k = HF ``hidden_states[k + 1]``, what SpecForge's ``extract_context_feature`` takes).
    """
    import torch

    input_ids = torch.tensor(ids, dtype=torch.long)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[len(rec.prompt_ids):] = 1
    hs = features.unsqueeze(0).cpu().contiguous()
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


def _link_donor(donors: Sequence[Path], j: int, ids: list[int], n_prompt: int, dst: Path) -> bool:
    """Link the first donor's sample ``j`` into ``dst`` when it holds exactly these tokens and loss mask."""
    import torch

    for d in donors:
        src = feature_path(d, j)
        if not src.is_file():
            continue
        try:
            # mmap: only the token ids and the mask are read, not the hidden states
            s = torch.load(src, weights_only=True, mmap=True)
        except Exception:  # a damaged donor file is not ours to judge: capture instead
            continue
        if s["input_ids"].tolist() == ids and int(s["loss_mask"][:n_prompt].sum()) == 0 \
                and int(s["loss_mask"][n_prompt:].sum()) == len(ids) - n_prompt:
            atomic_link(src, dst)
            return True
    return False


def run_features(d: Path, records: list[ResponseRecord], get_model: Callable, layer_ids: list[int],
                 cfg: ExperimentConfig, donors: Sequence[Path] = ()) -> dict:
    """Write one feature file per kept sample; an existing file (written atomically) is kept.

    The i-th kept sample goes to ``feature_path(d, i)`` in response order, so a
    resumed run never writes a sample twice. ``manifest.json`` lists counts. ``donors``:
    finished feature steps with the same target, layers, context and dtype
    (``stepkeys.donor_steps``); a donor's sample i with exactly this sample's tokens is
    linked instead of captured (a grown pool captures only its new samples).

    Raises:
        SFTError: no sample has >= 2 supervised tokens.
    """
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
    sup = sum(supervised_tokens(records[i], cfg.target.max_context) for i in kept)
    todo = [(j, i) for j, i in enumerate(kept) if not feature_path(d, j).is_file()]
    if donors:
        todo = [(j, i) for j, i in todo
                if not _link_donor(donors, j, sample_ids(records[i], cfg.target.max_context), len(records[i].prompt_ids),
                                   feature_path(d, j))]
    dtype = drafter_dtype(cfg)
    bar = progress_bar(len(kept), "sft features", "sample", initial=len(kept) - len(todo))
    if todo:
        runner = TargetRunner.of(get_model())
        seqs = [sample_ids(records[i], cfg.target.max_context) for _, i in todo]
        # batches of similar length (little padding), each file written as its batch ends
        for idx in length_batches([len(x) for x in seqs], CAPTURE_BATCH):
            outs = capture(runner, [seqs[k] for k in idx], layer_ids, chunk=cfg.target.prefill_chunk)
            for k, (f, _) in zip(idx, outs):
                j, i = todo[k]
                _atomic_torch_save(feature_sample(records[i], seqs[k], f, dtype), feature_path(d, j))
            bar.update(len(idx))
    bar.close()
    stats = {"samples": len(kept), "dropped": len(dropped), "dropped_ids": [x for x, _ in dropped],
             "supervised_tokens": sup, "target_layer_ids": layer_ids, "format": "specforge_hidden_states_v1",
             "files": [str(feature_path(d, j).relative_to(d)) for j in range(len(kept))]}
    atomic_write_json(d / "manifest.json", stats)
    return {k: v for k, v in stats.items() if k != "files"}


def subset_features(d: Path, sub: Path, n: int) -> Path:
    """The first ``n`` samples of the finished feature step ``d`` as their own offline directory ``sub``.

    Files are hard links (a copy where the filesystem has none), so a data curve's points
    cost no capture and little disk; an existing link is finished work. Returns ``sub``.

    Raises:
        SFTError: ``d`` holds fewer than ``n`` samples.
    """
    import json

    have = json.loads((d / "manifest.json").read_text())["samples"]
    if n > have:
        raise SFTError(f"sft.train_samples={n} but the features step holds {have} samples; "
                       "lower sft.train_samples or raise data.num_prompts")
    for j in range(n):
        dst = feature_path(sub, j)
        if not dst.is_file():
            atomic_link(feature_path(d, j), dst)
    atomic_write_json(sub / "manifest.json", {"samples": n, "subset_of": str(d), "format": "specforge_hidden_states_v1",
                                             "files": [str(feature_path(sub, j).relative_to(sub)) for j in range(n)]})
    return sub
