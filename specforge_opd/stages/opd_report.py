"""The OPD stage's report: ``report.md`` and ``tau_per_iteration.png`` from ``opd_metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from specforge_opd.atomic import atomic_write_text


def write_report(out: Path, final_rollout: Optional[dict] = None) -> Path:
    """``report.md`` and ``tau_per_iteration.png`` from ``opd_metrics.jsonl``.

    The plot: the on-policy rollout tau of the drafter entering each iteration (integer
    ticks, y from 1.0, the tau of no speculation), the start (iteration 1, the initial
    drafter) and, with ``final_rollout`` (``_final_rollout``), the final drafter on the
    same prompts as reference lines; the sequences per point in the legend.
    """
    rows = [json.loads(l) for l in (out / "opd_metrics.jsonl").read_text().splitlines() if l.strip()]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, taus = [r["iteration"] + 1 for r in rows], [r["rollout_tau"] for r in rows]
    ax.plot(xs, taus, marker="o", label=f"drafter entering the iteration ({rows[0]['rollout_sequences']} seq each)")
    ax.axhline(taus[0], color="gray", ls=":", label=f"start: initial drafter, tau {taus[0]:.3f}")
    top = max(taus)
    if final_rollout:
        ax.axhline(final_rollout["tau"], color="tab:green", ls="--",
                   label=f"final drafter, iteration 1's prompts: tau {final_rollout['tau']:.3f} ({final_rollout['sequences']} seq)")
        top = max(top, final_rollout["tau"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0.5, max(xs) + 0.5)
    ax.set_ylim(1.0, top + max(0.1, 0.15 * (top - 1.0)))
    ax.set_xlabel("OPD iteration")
    ax.set_ylabel("on-policy rollout tau")
    ax.set_title("Accepted length per iteration (1.0 = no speculation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "tau_per_iteration.png", dpi=120)
    plt.close(fig)
    lines = [
        "# OPD report",
        "",
        "Rollout tau is measured on-policy: the drafter of the previous iteration decodes this iteration's prompts.",
        "",
        "| iter | rollout tau | seqs | rollout tok/s | train steps | loss | L_acc | L_rej | accepted frac | spool MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, fmt="{:.4f}"):
        return "-" if x is None else fmt.format(x)

    for r in rows:
        lines.append(
            f"| {r['iteration'] + 1} | {r['rollout_tau']:.3f} | {r['rollout_sequences']} | {f(r['rollout_tokens_per_s'], '{:.1f}')} | "
            f"{r['train_steps']} | {f(r['loss'])} | {f(r['L_acc'])} | {f(r['L_rej'])} | {f(r['accepted_fraction'], '{:.3f}')} | "
            f"{r['spool_bytes'] / 2**20:.1f} |"
        )
    last = rows[-1]["flops"]
    if final_rollout:
        lines += ["", f"Final drafter: rollout tau {final_rollout['tau']:.3f} on iteration 1's {final_rollout['sequences']} "
                      f"prompts (the initial drafter: {rows[0]['rollout_tau']:.3f} on the same prompts)."]
    lines += ["", f"Drafter-training FLOPs of the OPD stage: {last['drafter_budget']:.3e} (teacher lm_head included); "
              f"target rollout FLOPs: {last['target_rollout']:.3e}.", "", "![tau per iteration](tau_per_iteration.png)", ""]
    p = out / "report.md"
    atomic_write_text(p, "\n".join(lines))
    return p
