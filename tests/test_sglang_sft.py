"""SFT responses through SGLang (``responses.sglang_generate``): one request per prompt, bounded in flight, timeouts
that grow with the response length, against the stand-in's plain (greedy) generation."""

from __future__ import annotations

import pytest

from specforge_opd.rollout.responses import sglang_generate
from specforge_opd.sglang.standin import StandinBackend, ThreadedStandin, make_app
from specforge_opd.stages.sft import SFTError

from conftest import make_tiny_target
from sglang_helpers import greedy_reference

PROMPTS = [[5, 17, 33, 8], [40, 41, 42], [7, 9, 11, 13, 15, 3], [20, 21], [30, 31, 32, 33], [60, 61, 62]]


def test_sglang_generate_bounded_concurrency_equals_greedy():
    """Many small requests, at most max_in_flight at once (not one blocking request holding every prompt),
    answers in prompt order equal to plain greedy decoding."""
    target = make_tiny_target()
    with ThreadedStandin(make_app(StandinBackend(target), delay_s=0.2)) as srv:
        out = sglang_generate([srv.url], PROMPTS, max_new_tokens=6, stop_token_ids=[1], temperature=0.0, seed=0,
                              timeout_s=30, max_in_flight=3)
        peak = srv.max_in_flight
    assert 2 <= peak <= 3
    for p, o in zip(PROMPTS, out):
        ref, _ = greedy_reference(target, p, 6, [1])
        assert p + o == ref


def test_sglang_generate_timeout_grows_with_max_new_tokens():
    target = make_tiny_target()
    with ThreadedStandin(make_app(StandinBackend(target), delay_s=0.6)) as srv:
        out = sglang_generate([srv.url], PROMPTS[:1], max_new_tokens=4, stop_token_ids=[1], temperature=0.0, seed=0,
                              timeout_s=0.2, timeout_per_token_s=0.25, max_retries=0)
        assert len(out) == 1
        with pytest.raises(SFTError, match="TimeoutError"):
            sglang_generate([srv.url], PROMPTS[:1], max_new_tokens=4, stop_token_ids=[1], temperature=0.0, seed=0,
                            timeout_s=0.2, timeout_per_token_s=0.0, max_retries=0)
    with pytest.raises(SFTError, match="sglang.urls is empty"):
        sglang_generate([], PROMPTS, max_new_tokens=4, stop_token_ids=[], temperature=0.0, seed=0, timeout_s=1)
