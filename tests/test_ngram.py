"""Prompt-lookup drafting (``specforge_opd.ngram``): proposals, exact offline replay, its row in evaluation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specforge_opd.ngram import ngram_offline_tau, propose
from specforge_opd.records import tau_of


def test_propose_takes_the_longest_latest_match():
    seq = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]
    # suffix [6, 7]: latest earlier occurrence at index 6 -> followed by 3, 4, 8
    assert propose(seq, 3) == [3, 4, 8]
    # a longer suffix [8, 6, 7] does not recur; [1, 6, 7] neither: still the 2-gram answer
    assert propose(seq, 2, max_ngram=3) == [3, 4]
    assert propose([1, 2, 3], 4) == []  # nothing recurs
    assert propose([4, 4], 3) == [4]  # the 1-gram at index 0, followed by what there is
    with pytest.raises(ValueError, match="ngram_max"):
        propose(seq, 2, max_ngram=0)


def _traj(ids, prompt_len):
    return SimpleNamespace(input_ids=torch.tensor(ids), prompt_len=prompt_len, finished=True)


def test_offline_replay_follows_the_anchor_recurrence():
    # prompt [1 2 3 4], response repeats it: after the first token (1) every block proposes the rest of the cycle
    ids = [1, 2, 3, 4] + [1, 2, 3, 4, 1, 2, 3, 4]
    rec = ngram_offline_tau([_traj(ids, 4)], block_size=4)[0]
    a = rec.anchors.tolist()
    assert a[0] == 4
    for m in range(1, len(a)):
        assert a[m] == a[m - 1] + int(rec.accepted[m - 1]) + 1
    assert rec.accepted.tolist()[0] == 3  # at anchor 4 (token 1): proposes 2, 3, 4
    # the last block is clipped to the tokens the trajectory has
    assert a[-1] + int(rec.accepted[-1]) + 1 <= len(ids)
    assert tau_of([rec]) == pytest.approx(rec.completion_tokens / rec.num_blocks)
    assert tau_of([rec]) > 2.0


def test_no_repetition_accepts_nothing():
    ids = list(range(10, 30))
    rec = ngram_offline_tau([_traj(ids, 5)], block_size=8)[0]
    # one verify step per token after the prefill's: tau = completion tokens / (completion tokens - 1)
    assert rec.accepted.sum() == 0 and rec.num_blocks == 14 and tau_of([rec]) == pytest.approx(15 / 14)


def test_readme_main_job_table_is_generated_from_the_committed_summary():
    """The README's main-job table is ``compare.render_summary`` of benchmarks/results/tiny_main_job.json."""
    import json
    from pathlib import Path

    from specforge_opd.compare import render_summary

    root = Path(__file__).resolve().parents[1]
    summary = json.loads((root / "benchmarks/results/tiny_main_job.json").read_text())
    readme = (root / "README.md").read_text()
    block = readme.split("<!-- tiny_main_job:begin -->\n", 1)[1].split("\n<!-- tiny_main_job:end -->", 1)[0]
    assert block.strip() == render_summary(summary).strip()
    names = [r["drafter"] for r in summary["rows"]]
    assert names == ["prompt lookup (ngram)", "SFT", "SFT + matched-FLOPs SFT", "SFT + OPD"]
    assert summary["commit"] and summary["seeds"] and set(summary["stage_seconds"]) >= {"sft", "opd", "eval"}
