"""The stand-in behaves as SGLang 0.5.23 does where the tests depend on it (tests/test_sglang_contract.py reads the
wheel for each point): stop sets, log-prob entry 0, hidden-state refusals, layer checks, the pool it reports,
queueing and 503, batched native decoding with per-request temperature, seeds, bf16 rounding."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from specforge_opd.config import SGLangConfig
from specforge_opd.sglang.launcher import Endpoints
from specforge_opd.sglang.native import native_rollout_async
from specforge_opd.sglang.speculate import Drafter, LocalTarget, speculate_sequence
from specforge_opd.testing.standin import ThreadedStandin, backend_from_args, check_layer_range, make_app, parse_flags
from specforge_opd.testing.standin_model import StandinBackend, StandinRequestError

from conftest import make_tiny_drafter, make_tiny_target
from sglang_helpers import OracleDrafter, greedy_reference

BS = 4
PROMPTS = [("p0", [5, 17, 33, 8]), ("p1", [40, 41, 42]), ("p2", [7, 9, 11, 13, 15, 3]), ("p3", [20, 21, 22])]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _plain(backend, ids, **sp):
    return backend.generate_plain({"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, **sp}})


# ---------------------------------------------------------------------------
# stop sets


def test_stops_on_the_generation_config_eos_unless_ignore_eos():
    target = make_tiny_target()
    ref, _ = greedy_reference(target, [5, 17, 33, 8], 8, [])
    third = ref[4 + 2]
    assert third not in ref[4:6] and third != 1
    target.generation_config.eos_token_id = [1, third]  # generation_config.json adds an eos
    backend = StandinBackend(target)
    out = _plain(backend, [5, 17, 33, 8], stop_token_ids=[])
    assert out["output_ids"] == ref[4:7] and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert _plain(backend, [5, 17, 33, 8], stop_token_ids=[], ignore_eos=True)["output_ids"] == ref[4:12]
    # native decoding stops there too
    dm = make_tiny_drafter(target, block_size=BS, layers=1)
    nb = StandinBackend(target, drafter=Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings()), block_size=BS)
    res = nb.generate_native({"input_ids": [5, 17, 33, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                                                "stop_token_ids": []}})
    assert res["output_ids"] == ref[4:7]


# ---------------------------------------------------------------------------
# log-probs and hidden states


def test_input_logprob_entry_zero_is_none_and_top_logprobs_absent_at_k0():
    target = make_tiny_target()
    backend = StandinBackend(target, aux_layer_ids=[0, 2])
    ids = [5, 17, 33, 8, 9, 10]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 3, "top_logprobs_num": 0}
    meta = backend.generate_verify(body)["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 8, None] and meta["input_token_logprobs"][1][0] is not None
    assert "input_top_logprobs" not in meta
    meta = backend.generate_verify(dict(body, top_logprobs_num=2))["meta_info"]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2


def test_hidden_states_need_the_server_flag_and_the_last_layer_is_never_captured(tmp_path):
    target = make_tiny_target()
    body = {"input_ids": [5, 17, 33], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_hidden_states": True}
    with ThreadedStandin(make_app(StandinBackend(target))) as srv:
        status, payload = _post(srv.url, body)
    assert status == 400 and "not configured to return hidden states" in payload["error"]["message"]
    # id 3 of a 4-layer target: captured "before layer 4", which does not exist
    rows = StandinBackend(target, aux_layer_ids=[0, 3]).generate_verify(body)["meta_info"]["hidden_states"][0]
    assert torch.tensor(rows).shape == (3, 64)
    with pytest.raises(ValueError, match=r"--return-aux-hidden-state-layer-ids \[4\] out of range for a target with 4 layers"):
        check_layer_range([0, 4], 4)


# ---------------------------------------------------------------------------
# what the server says about itself, queueing


def test_server_info_reports_the_flags(tmp_path):
    target = make_tiny_target()
    target.save_pretrained(tmp_path)
    args = parse_flags(["--model-path", str(tmp_path), "--port", "1", "--max-total-tokens", "4096", "--max-running-requests",
                        "7", "--enable-deterministic-inference"])
    info = backend_from_args(args, native=False).server_info()
    assert info["max_total_num_tokens"] == 4096 and info["max_running_requests"] == 7
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 7 and info["enable_deterministic_inference"]
    assert backend_from_args(parse_flags(["--model-path", str(tmp_path), "--port", "1"]), native=False).server_info()[
        "max_total_num_tokens"] == 65536


def test_native_requests_queue_past_the_running_slots_and_503_past_the_queue():
    target = make_tiny_target()
    backend = StandinBackend(target, drafter=OracleDrafter(target, BS), block_size=BS, running_slots=1, max_queued_requests=1)
    body = {"input_ids": [5, 17, 33, 8], "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "stop_token_ids": []}}
    results = []
    threads = [threading.Thread(target=lambda: results.append(backend.generate_native(body))) for _ in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while not backend._running and time.monotonic() < deadline:
        time.sleep(0.01)
    threads[1].start()
    while len(backend._waiting) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(StandinRequestError, match="The request queue is full") as e:
        backend.generate_native(body)
    assert e.value.status == 503
    for t in threads:
        t.join(60)
    assert len(results) == 2 and results[0]["output_ids"] == results[1]["output_ids"]
    assert max(backend.batch_sizes) == 1  # one running slot: never batched


# ---------------------------------------------------------------------------
# batched native decoding, temperature, seeds


def test_batched_native_decoding_matches_the_in_process_rollout():
    target = make_tiny_target()
    oracle = OracleDrafter(target, BS)
    backend = StandinBackend(target, drafter=oracle, block_size=BS)
    cfg = SGLangConfig(request_timeout_s=60, max_retries=0, backoff_s=0.05)
    with ThreadedStandin(make_app(backend, native=True, delay_s=0.2)) as srv:
        recs = asyncio.run(native_rollout_async(Endpoints.connect([srv.url]), PROMPTS, sglang_cfg=cfg, block_size=BS,
                                                max_new_tokens=12, stop_token_ids=[1], teacher="token"))
    assert max(backend.batch_sizes) > 1, "the requests were never batched"
    local = LocalTarget(target, [0, 2], top_k=1)
    for rec, (sid, ids) in zip(recs, PROMPTS):
        ref = asyncio.run(speculate_sequence(local, oracle, ids, sample_id=sid, max_new_tokens=12, stop_token_ids=[1],
                                             teacher="token", store_features=True))
        assert torch.equal(rec.input_ids, ref.input_ids) and torch.equal(rec.anchors, ref.anchors)
        assert torch.equal(rec.accepted, ref.accepted) and torch.allclose(rec.teacher_draft_logprob, ref.teacher_draft_logprob, atol=1e-4)


def test_per_request_temperature_in_one_batch():
    target = make_tiny_target()
    oracle = OracleDrafter(target, BS)
    backend = StandinBackend(target, drafter=oracle, block_size=BS)
    greedy_body = {"input_ids": [5, 17, 33, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "stop_token_ids": []}}
    hot_body = {"input_ids": [5, 17, 33, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 5.0, "stop_token_ids": []}}
    out = {}
    ts = [threading.Thread(target=lambda k=k, b=b: out.__setitem__(k, backend.generate_native(b)))
          for k, b in (("greedy", greedy_body), ("hot", hot_body))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert max(backend.batch_sizes) == 2
    ref, _ = greedy_reference(target, [5, 17, 33, 8], 16, [])
    assert out["greedy"]["output_ids"] == ref[4:]
    assert out["hot"]["output_ids"] != ref[4:]  # at T=5 over 97 tokens, sampling leaves the greedy path
    # the recorded teacher is the target's at temperature 1 whatever the request's temperature
    seq = [5, 17, 33, 8] + out["hot"]["output_ids"]
    meta = out["hot"]["meta_info"]
    a, d = meta["opd_anchor"][1], meta["opd_draft"][1]
    with torch.no_grad():
        lp = torch.log_softmax(target(torch.tensor([seq[: a + 1] + d])).logits[0].float(), -1)
    want = [float(lp[a + k, d[k]]) for k in range(BS - 1)]
    assert meta["opd_draft_logprob"][1] == pytest.approx(want, abs=1e-4)


def test_sampling_seed_only_in_deterministic_mode_and_the_client_says_so(caplog):
    from specforge_opd.sglang.generate import sglang_generate

    target = make_tiny_target()
    kw = dict(max_new_tokens=6, stop_token_ids=[1], temperature=1.0, seed=3, timeout_s=30)
    with ThreadedStandin(make_app(StandinBackend(target, deterministic=True))) as srv:
        with caplog.at_level(logging.WARNING, logger="specforge_opd.sglang.verify_client"):
            a = sglang_generate([srv.url], [[5, 17, 33, 8]], **kw)
            b = sglang_generate([srv.url], [[5, 17, 33, 8]], **kw)
    assert a == b and "ignores sampling_seed" not in caplog.text
    with ThreadedStandin(make_app(StandinBackend(target))) as srv:
        with caplog.at_level(logging.WARNING, logger="specforge_opd.sglang.verify_client"):
            sglang_generate([srv.url], [[5, 17, 33, 8], [40, 41, 42]], **kw)
    assert caplog.text.count("ignores sampling_seed") == 1
    assert "start the server with --enable-deterministic-inference" in caplog.text


# ---------------------------------------------------------------------------
# bf16


def test_bf16_rounding_of_logits_and_hidden_states():
    target = make_tiny_target()
    body = {"input_ids": [5, 17, 33, 8], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 1, "top_logprobs_num": 2, "return_hidden_states": True}
    fp32 = StandinBackend(target, aux_layer_ids=[0, 2]).generate_verify(body)["meta_info"]
    bf16 = StandinBackend(target, aux_layer_ids=[0, 2], bf16=True).generate_verify(body)["meta_info"]
    h = torch.tensor(bf16["hidden_states"][0])
    assert torch.equal(h, h.bfloat16().float()) and not torch.equal(h, torch.tensor(fp32["hidden_states"][0]))
    assert torch.allclose(h, torch.tensor(fp32["hidden_states"][0]), rtol=1e-2, atol=1e-2)
    lp32 = torch.tensor([e[0] for e in fp32["input_token_logprobs"][1:]])
    lp16 = torch.tensor([e[0] for e in bf16["input_token_logprobs"][1:]])
    assert not torch.equal(lp16, lp32) and torch.allclose(lp16, lp32, atol=0.05)
