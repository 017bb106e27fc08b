"""SFT responses through SGLang (``sglang.generate.sglang_generate``): one request per prompt, bounded in flight, timeouts
that grow with the response length, against the stand-in's plain (greedy) generation."""

from __future__ import annotations

import pytest

from specforge_opd.config import load_config
from specforge_opd.models.target import TargetBundle
from specforge_opd.rollout.responses import read_responses, run_responses
from specforge_opd.sglang.generate import sglang_generate
from specforge_opd.stages.rollout import response_generator
from specforge_opd.stages.sft import SFTError
from specforge_opd.testing.standin import StandinBackend, ThreadedStandin, make_app

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


def test_sglang_generate_seeds_each_prompt_by_its_sample_id():
    """Each request's sampling_seed comes from (seed, sample id), as the embedded backend seeds each row: two
    samples of one prompt do not repeat one random stream, and a sample draws the same tokens in any order."""
    from specforge_opd.rollout.step import sample_seed

    target = make_tiny_target()
    kw = dict(max_new_tokens=8, stop_token_ids=[1], temperature=1.0, seed=3, timeout_s=30)
    with ThreadedStandin(make_app(StandinBackend(target, deterministic=True))) as srv:
        a, b = sglang_generate([srv.url], [PROMPTS[0], PROMPTS[0]], sample_ids=["a", "b"], **kw)
        (b2,) = sglang_generate([srv.url], [PROMPTS[0]], sample_ids=["b"], **kw)
    assert a != b and b == b2
    assert sample_seed(3, "a", bits=31) < 2**31 and sample_seed(3, "a", bits=31) != sample_seed(3, "b", bits=31)


def test_sft_responses_step_through_sglang_equals_the_embedded_target(tmp_path):
    """The responses step with ``rollout.backend`` naming SGLang (``stages.rollout.response_generator``) writes the
    chunks the embedded target writes: the same greedy responses, cut at the stop token, in prompt order."""
    target = make_tiny_target()
    bundle = TargetBundle(model=target, tokenizer=None, path=tmp_path, identity="tiny", stop_token_ids=[1])
    tokenized = [(f"p{i}", p) for i, p in enumerate(PROMPTS)]
    common = ["sft.max_new_tokens=6", "sft.chunk_prompts=4", "sft.temperature=0.0"]
    emb = load_config(None, common)
    assert response_generator(emb) is None
    run_responses(tmp_path / "embedded", tokenized, bundle, emb)
    with ThreadedStandin(make_app(StandinBackend(target))) as srv:
        cfg = load_config(None, common + ["rollout.backend=sglang_verify", f"sglang.urls=[{srv.url}]"])
        run_responses(tmp_path / "sglang", tokenized, bundle, cfg, remote=response_generator(cfg))
        assert srv.max_in_flight >= 1  # the responses came from the server
    ref, got = read_responses(tmp_path / "embedded"), read_responses(tmp_path / "sglang")
    assert [r.__dict__ for r in got] == [r.__dict__ for r in ref] and len(got) == len(PROMPTS)


def test_the_sft_stage_takes_its_responses_from_sglang_when_configured(tmp_path, monkeypatch):
    """``run_sft`` with ``rollout.backend=sglang_verify`` asks the server for its responses (the stage hands
    ``stages.rollout.response_generator`` down), and they are the embedded target's greedy responses."""
    from specforge_opd.stages import sft

    from sft_helpers import make_prompts, make_target_dir, tiny_cfg

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(sft, "_features_step", stop)  # the responses step is all this test needs
    bundle = make_target_dir(tmp_path / "target")
    prompts = make_prompts(6)
    with pytest.raises(Stop):
        sft.run_sft(tiny_cfg(tmp_path / "embedded"), bundle=bundle, prompts=prompts, target_path=bundle.path)
    with ThreadedStandin(make_app(StandinBackend(bundle.model))) as srv:
        cfg = tiny_cfg(tmp_path / "sglang", **{"rollout.backend": "sglang_verify", "sglang.urls": f"[{srv.url}]"})
        with pytest.raises(Stop):
            sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
        assert srv.max_in_flight >= 1
    (ref,), (got,) = (list((tmp_path / d).glob("responses-*")) for d in ("embedded", "sglang"))
    assert [r.__dict__ for r in read_responses(got)] == [r.__dict__ for r in read_responses(ref)]
    assert len(read_responses(got)) == 6
