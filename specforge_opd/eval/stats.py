"""Bootstrap intervals for pooled accepted length (tau) over prompts.

tau of a dataset is pooled (``records.tau_of``: completion tokens / verify steps),
and the main job's mean tau is the mean of the datasets' taus. The bootstrap
resamples prompts with replacement within each dataset, recomputes both, and
takes percentiles. Resampling is paired: every drafter sees the same resampled
prompts in a replicate, so the interval of a ratio of two drafters' mean tau
reflects only how they differ on the same prompts.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

#: {drafter: {dataset: (completion tokens per prompt, verify steps per prompt)}}
Counts = Mapping[str, Mapping[str, tuple[Sequence[int], Sequence[int]]]]


def bootstrap_mean_tau(counts: Counts, *, replicates: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
    """Bootstrap replicates of each drafter's mean-over-datasets pooled tau.

    Returns {drafter: float64 array [replicates]}.

    Raises:
        ValueError: drafters disagree on the datasets or on a dataset's prompt count
            (pairing needs the same prompts), or a dataset has no prompt.
    """
    names = list(counts)
    if not names:
        raise ValueError("no drafter to bootstrap")
    dsets = list(counts[names[0]])
    rng = np.random.default_rng(seed)
    out = {n: np.zeros(replicates) for n in names}
    for ds in dsets:
        sizes = {n: len(counts[n][ds][0]) if ds in counts[n] else None for n in names}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(f"dataset {ds}: drafters were evaluated on different prompts ({sizes}); pairing needs the same")
        k = sizes[names[0]]
        if k == 0:
            raise ValueError(f"dataset {ds} has no prompt")
        idx = rng.integers(0, k, size=(replicates, k))
        for n in names:
            tok = np.asarray(counts[n][ds][0], dtype=np.float64)[idx].sum(1)
            steps = np.asarray(counts[n][ds][1], dtype=np.float64)[idx].sum(1)
            out[n] += tok / np.maximum(steps, 1.0) / len(dsets)
    return out


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap ``samples``."""
    a = (1.0 - level) / 2.0
    return float(np.quantile(samples, a)), float(np.quantile(samples, 1.0 - a))


def counts_of(eval_result: dict, name: str) -> dict[str, tuple[list[int], list[int]]]:
    """{dataset: (tokens, steps) per prompt} of drafter ``name`` in an ``eval.json`` result."""
    return {ds: (e["tokens_per_prompt"], e["steps_per_prompt"])
            for ds, e in eval_result["drafters"][name]["datasets"].items()}
