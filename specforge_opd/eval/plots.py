"""PNG plots of an evaluation result (``specforge_opd.eval.evaluate``): matplotlib, Agg backend.

The two plots take the dict written to ``eval.json``
(``result["drafters"][name]["datasets"][dataset]`` with ``tau``, optional
``tau_std``, and ``histogram``: verify steps by accepted length r+1, index 0 unused).
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def pyplot():
    """``matplotlib.pyplot``, the backend set to Agg on the first call.

    matplotlib is imported on the first plot, not with this module, so that importing
    the evaluation modules stays cheap.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines; must precede pyplot
    import matplotlib.pyplot as plt

    return plt


def _datasets(result: dict) -> list[str]:
    names: list[str] = []
    for d in result["drafters"].values():
        for ds in d["datasets"]:
            if ds not in names:
                names.append(ds)
    return names


def plot_tau_per_dataset(result: dict, path: Path) -> Path:
    """Grouped bars: tau per dataset (x), one bar per drafter, error bars = spread over seeds.

    Returns the written path. Raises ValueError if the result holds no dataset.
    """
    path = Path(path)
    datasets = _datasets(result)
    if not datasets:
        raise ValueError("plot_tau_per_dataset: the result holds no dataset")
    plt = pyplot()
    drafters = list(result["drafters"])
    n = len(drafters)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(datasets) * max(1, n) ** 0.5 + 2), 3.8), dpi=120)
    for i, name in enumerate(drafters):
        per = result["drafters"][name]["datasets"]
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(datasets))]
        taus = [per.get(ds, {}).get("tau", 0.0) for ds in datasets]
        errs = [per.get(ds, {}).get("tau_std", 0.0) for ds in datasets]
        bars = ax.bar(xs, taus, width, yerr=errs if any(errs) else None, capsize=3, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(range(len(datasets)), datasets, rotation=15 if len(datasets) > 4 else 0)
    ax.set_ylabel("accepted length τ (tokens / verify step)")
    ax.set_ylim(0, max(1.0, ax.get_ylim()[1] * 1.12))
    ax.set_title(f"τ per dataset (T={result['eval']['temperature']}, {result['method']})")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_accept_histograms(result: dict, path: Path) -> Path:
    """One panel per dataset: share of verify steps by accepted length r+1, drafters side by side."""
    path = Path(path)
    datasets = _datasets(result)
    if not datasets:
        raise ValueError("plot_accept_histograms: the result holds no dataset")
    plt = pyplot()
    drafters = list(result["drafters"])
    n = len(drafters)
    width = 0.8 / n
    fig, axes = plt.subplots(1, len(datasets), figsize=(3.6 * len(datasets) + 0.6, 3.4), dpi=120, squeeze=False, sharey=True)
    for ax, ds in zip(axes[0], datasets):
        for i, name in enumerate(drafters):
            s = result["drafters"][name]["datasets"].get(ds)
            if not s:
                continue
            hist = s["histogram"][1:]
            total = sum(hist) or 1
            xs = [L + 1 + (i - (n - 1) / 2) * width for L in range(len(hist))]
            ax.bar(xs, [c / total for c in hist], width, label=f"{name} (τ={s['tau']:.2f})")
        ax.set_title(ds, fontsize=10)
        ax.set_xlabel("accepted length r+1")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of verify steps")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
