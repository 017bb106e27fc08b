"""Native mode: the plugin's record conversion on hand-made SGLang-shaped tensors, and the whole
loop against the stand-in (SGLang's own DFLASH decoding stood in by the in-process target)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specforge_opd.config import SGLangConfig
from specforge_opd.sglang.contract import ContractError, NativeStep, parse_native_response
from specforge_opd.sglang.launcher import Endpoints
from specforge_opd.sglang.native import customized_info_of, native_rollout_async, record_from_native, verify_step_payloads
from specforge_opd.sglang.speculate import Drafter, LocalTarget, speculate_sequence
from specforge_opd.sglang.standin import StandinBackend, ThreadedStandin, make_app

from conftest import make_tiny_drafter, make_tiny_target

BS = 4


def test_verify_step_payloads_on_hand_made_sglang_tensors():
    # batch of 2 requests, bs = 4, vocab 6; SGLang's flat layouts: draft_token [B*bs], logits [B*bs, V]
    draft_token = torch.tensor([3, 1, 2, 5, 4, 0, 0, 0])
    V = 6
    logits = torch.full((8, V), -5.0)
    # request 0: slot0 predicts 1 (= d_1), slot1 predicts 2 (= d_2), slot2 predicts 4 (!= d_3=5) -> r = 2
    for row, tok in enumerate([1, 2, 4, 0]):
        logits[row, tok] = 5.0
    # request 1: slot0 predicts 3 (!= d_1=0) -> r = 0, even though later slots would match
    for row, tok in enumerate([3, 0, 0, 1]):
        logits[4 + row, tok] = 5.0
    seq_lens = torch.tensor([10, 7])
    out = verify_step_payloads(draft_token, logits, seq_lens, BS)
    assert [p["opd_anchor"] for p in out] == [10, 7]
    assert out[0]["opd_draft"] == [1, 2, 5] and out[1]["opd_draft"] == [0, 0, 0]
    assert [p["opd_accepted"] for p in out] == [2, 0]
    lse = torch.logsumexp(torch.tensor([5.0] + [-5.0] * 5), 0)
    hit, miss = 5.0 - float(lse), -5.0 - float(lse)
    assert out[0]["opd_draft_logprob"] == pytest.approx([hit, hit, miss], abs=1e-5)
    assert out[1]["opd_draft_logprob"] == pytest.approx([miss, hit, hit], abs=1e-5)
    # the [B, bs, V] layout gives the same answer
    assert verify_step_payloads(draft_token.view(2, BS), logits.view(2, BS, V), seq_lens, BS) == out
    info = customized_info_of(out)
    assert info["opd_accepted"] == [2, 0] and len(info["opd_draft"]) == 2
    with pytest.raises(ValueError, match="seq_lens"):
        verify_step_payloads(draft_token, logits, torch.tensor([1]), BS)


def _steps():
    return [NativeStep(3, [7, 8, 9], 2, [-0.1, -0.2, -3.0]), NativeStep(6, [4, 4, 4], 0, [-2.0, -1.0, -1.0])]


def test_record_from_native_builds_anchor_records():
    prompt = [11, 12, 13]
    out = [20, 7, 8, 30, 31]  # a0=3 (token 20), accepts 7,8 + bonus 30 -> a1=6, bonus 31
    rec = record_from_native("s", prompt, out, _steps(), block_size=BS, teacher="token", stop_token_ids=[31])
    assert rec.anchors.tolist() == [3, 6] and rec.accepted.tolist() == [2, 0]
    assert rec.drafts.tolist() == [[7, 8, 9], [4, 4, 4]]
    assert rec.features is None and rec.finished
    assert rec.teacher_draft_logprob.shape == (2, BS - 1)
    assert rec.completion_tokens == 5 and rec.teacher_form() == "token"


def test_record_from_native_rejects_inconsistent_steps():
    prompt = [11, 12, 13]
    bad_anchor = [NativeStep(3, [7, 8, 9], 2, None), NativeStep(5, [4, 4, 4], 0, None)]
    with pytest.raises(ContractError, match=r"opd_anchor\[1\]`: 5 != expected 6"):
        record_from_native("s", prompt, [20, 7, 8, 30, 31], bad_anchor, block_size=BS, teacher="token", stop_token_ids=[])
    with pytest.raises(ContractError, match=r"opd_draft\[0\]`: accepted draft 2"):
        record_from_native("s", prompt, [20, 7, 99, 30, 31], _steps(), block_size=BS, teacher="token", stop_token_ids=[])


def test_parse_native_response_names_missing_plugin_fields():
    payload = {"output_ids": [1, 2], "meta_info": {"spec_verify_ct": 1}}
    with pytest.raises(ContractError, match=r"customized_info.*native plugin.*server version 9.9"):
        parse_native_response(payload, block_size=BS, server_version="9.9")
    payload["meta_info"]["customized_info"] = {"opd_anchor": [3], "opd_draft": [[1, 2]], "opd_accepted": [0]}
    with pytest.raises(ContractError, match=r"opd_draft\[0\]`: expected 3 tokens"):
        parse_native_response(payload, block_size=BS)
    payload["meta_info"]["customized_info"] = {"opd_anchor": [3, 4], "opd_draft": [[1, 2, 3]], "opd_accepted": [0]}
    with pytest.raises(ContractError, match=r"opd_anchor`: 2 entries != spec_verify_ct 1"):
        parse_native_response(payload, block_size=BS)


def test_native_loop_against_standin_matches_in_process_rollout():
    """Native mode end to end: the stand-in decodes with the DFlash drafter, reports steps through the plugin's
    conversion, the client builds feature-free records equal (anchors, drafts, accepted, tokens) to the
    in-process rollout with the same drafter; teacher token log-probs agree to 1e-4."""
    target = make_tiny_target()
    dm = make_tiny_drafter(target, block_size=BS, layers=1)
    drafter = Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings())
    prompts = [("p0", [5, 17, 33, 8]), ("p1", [40, 41, 42]), ("p2", [7, 9, 11, 13, 15, 3])]
    backend = StandinBackend(target, drafter=drafter, block_size=BS)
    cfg = SGLangConfig(request_timeout_s=30, max_retries=1, backoff_s=0.05)
    with ThreadedStandin(make_app(backend, native=True)) as srv:
        recs = asyncio.run(
            native_rollout_async(
                Endpoints([srv.url], version="0.5.23-standin"), prompts, sglang_cfg=cfg, block_size=BS,
                max_new_tokens=10, stop_token_ids=[1], teacher="token",
            )
        )
    local = LocalTarget(target, dm.target_layer_ids, top_k=1)
    for rec, (sid, ids) in zip(recs, prompts):
        ref = asyncio.run(speculate_sequence(local, drafter, ids, sample_id=sid, max_new_tokens=10, stop_token_ids=[1], teacher="token", store_features=True))
        assert rec.features is None
        assert torch.equal(rec.input_ids, ref.input_ids)
        assert torch.equal(rec.anchors, ref.anchors) and torch.equal(rec.drafts, ref.drafts) and torch.equal(rec.accepted, ref.accepted)
        assert torch.allclose(rec.teacher_draft_logprob, ref.teacher_draft_logprob, atol=1e-4)
