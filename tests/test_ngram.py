"""Prompt-lookup drafting (``specforge_opd.eval.ngram``): proposals, exact offline replay, its row in evaluation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specforge_opd.eval.ngram import ngram_offline_tau, propose
from specforge_opd.rollout.records import tau_of


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

    from specforge_opd.stages.compare import render_summary

    root = Path(__file__).resolve().parents[1]
    summary = json.loads((root / "benchmarks/results/tiny_main_job.json").read_text())
    readme = (root / "README.md").read_text()
    block = readme.split("<!-- tiny_main_job:begin -->\n", 1)[1].split("\n<!-- tiny_main_job:end -->", 1)[0]
    assert block.strip() == render_summary(summary).strip()
    names = [r["drafter"] for r in summary["rows"]]
    # the fair baseline's best validation point gets its own row when it is not the matched-FLOPs one
    assert [n for n in names if n != "SFT + best-val SFT"] == ["prompt lookup (ngram)", "SFT", "SFT + matched-FLOPs SFT",
                                                              "SFT + OPD"]
    assert names.index("SFT + OPD") == len(names) - 1
    assert summary["commit"] and summary["seeds"] and set(summary["stage_seconds"]) >= {"sft", "opd", "eval"}


@torch.no_grad()
def test_ngram_drafter_rollout_equals_greedy_and_its_offline_tau():
    """Prompt lookup plugged into the shared step against the in-process target: the output is the target's greedy
    decoding, short proposals are padded and never accepted past their length, and tau equals the offline replay
    (``ngram_offline_tau``) of the same trajectories, block for block."""
    from specforge_opd.eval.ngram import NgramDrafter
    from specforge_opd.rollout.step import InProcessTarget, StepConfig, run_inline, speculate

    from conftest import make_tiny_target

    target = make_tiny_target(seed=0)
    prompts = [("a", [5, 6, 7, 5, 6, 7, 5, 6]), ("b", [9, 10, 11, 12]), ("c", [20, 21, 20, 21, 20, 22, 23])]
    bs, N = 4, 24
    cfg = StepConfig(block_size=bs, max_new_tokens=N, stop_token_ids=frozenset({1}), teacher="token")
    recs = run_inline(speculate(InProcessTarget(target, (), slack=N + 2 * bs), NgramDrafter(bs), prompts, cfg))
    short = 0
    for rec, (sid, p) in zip(recs, prompts):
        ids, gaps = list(p), []
        for _ in range(N):  # plain greedy, one full forward per token
            logits = target(torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            ids.append(int(logits.argmax()))
            if ids[-1] == 1:
                break
        assert min(gaps) > 1e-4  # no numerical tie: exact token equality is the right check
        assert rec.input_ids.tolist() == ids, sid
        assert rec.features is None and rec.teacher_draft_logprob.shape == (rec.num_blocks, bs - 1)
        proposed = (rec.drafts >= 0).sum(1)
        assert (rec.accepted <= proposed).all()  # padding (-1) is never accepted
        short += int((proposed < bs - 1).sum())
    assert short > 0  # short and empty proposals were exercised
    offline = ngram_offline_tau([SimpleNamespace(input_ids=r.input_ids, prompt_len=r.prompt_len, finished=r.finished) for r in recs], bs)
    assert sum(int(r.accepted.sum()) for r in recs) > 0  # lookup did accept tokens
    for rec, off in zip(recs, offline):
        assert torch.equal(rec.anchors, off.anchors) and torch.equal(rec.accepted, off.accepted)
        assert torch.equal(rec.drafts, off.drafts)
    assert tau_of(recs) == tau_of(offline)
