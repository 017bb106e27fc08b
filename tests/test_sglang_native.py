"""Native mode: the plugin's record conversion on hand-made SGLang-shaped tensors, and the whole
loop against the stand-in (SGLang's own DFLASH decoding stood in by the in-process target)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specforge_opd.config import SGLangConfig
from specforge_opd.sglang import native
from specforge_opd.sglang.contract import ContractError, NativeStep, native_request, parse_native_response
from specforge_opd.sglang.launcher import Endpoints, ServerError
from specforge_opd.sglang.native import (
    customized_info_of,
    draft_logprobs,
    native_rollout_async,
    record_from_native,
    step_payloads,
)
from specforge_opd.sglang.speculate import Drafter, LocalTarget, speculate_sequence
from specforge_opd.testing.standin import StandinBackend, ThreadedStandin, make_app

from conftest import make_tiny_drafter, make_tiny_target
from sglang_helpers import OracleDrafter

BS = 4


def test_step_payloads_on_hand_made_sglang_tensors():
    # batch of 2 requests, bs = 4, vocab 6, as DFlashWorkerV2 holds them after verify: the drafted block
    # [B, bs] (slot 0 = previous bonus), accept_lens [B] = accepted + 1, seq_lens [B] = anchors, logits [B*bs, V]
    draft_block = torch.tensor([[3, 1, 2, 5], [4, 0, 0, 0]])
    V = 6
    logits = torch.full((8, V), -5.0)
    for row, tok in enumerate([1, 2, 4, 0]):
        logits[row, tok] = 5.0
    for row, tok in enumerate([3, 0, 0, 1]):
        logits[4 + row, tok] = 5.0
    out = step_payloads(draft_block, torch.tensor([3, 1]), torch.tensor([10, 7]), logits, block_size=BS)
    assert [p["opd_anchor"] for p in out] == [10, 7]
    assert out[0]["opd_draft"] == [1, 2, 5] and out[1]["opd_draft"] == [0, 0, 0]
    # the accepted count is SGLang's own (accept_lens - 1), never recomputed: at T > 0 acceptance is sampled
    assert [p["opd_accepted"] for p in out] == [2, 0]
    lse = torch.logsumexp(torch.tensor([5.0] + [-5.0] * 5), 0)
    hit, miss = 5.0 - float(lse), -5.0 - float(lse)
    assert out[0]["opd_draft_logprob"] == pytest.approx([hit, hit, miss], abs=1e-5)
    assert out[1]["opd_draft_logprob"] == pytest.approx([miss, hit, hit], abs=1e-5)
    # the flat [B*bs] block and [B, bs, V] logits give the same answer; chunked log-probs equal unchunked
    assert step_payloads(draft_block.reshape(-1), torch.tensor([3, 1]), torch.tensor([10, 7]), logits.view(2, BS, V), block_size=BS) == out
    lp1 = draft_logprobs(logits, draft_block[:, 1:], block_size=BS, chunk_rows=1)
    assert torch.allclose(lp1, draft_logprobs(logits, draft_block[:, 1:], block_size=BS), atol=1e-6)
    # a padded lm_head: columns past the vocabulary are ignored
    padded = torch.cat([logits, torch.full((8, 2), 9.0)], 1)
    assert step_payloads(draft_block, torch.tensor([3, 1]), torch.tensor([10, 7]), padded, block_size=BS, vocab_size=V) == out
    # no logits: the records carry no log-probs
    bare = step_payloads(draft_block, torch.tensor([3, 1]), torch.tensor([10, 7]), None, block_size=BS)
    assert [p["opd_draft_logprob"] for p in bare] == [None, None] and bare[0]["opd_accepted"] == 2
    info = customized_info_of(out)
    assert info["opd_accepted"] == [2, 0] and len(info["opd_draft"]) == 2
    with pytest.raises(ValueError, match="seq_lens"):
        step_payloads(draft_block, torch.tensor([3, 1]), torch.tensor([1]), logits, block_size=BS)
    with pytest.raises(ValueError, match="accept_lens"):
        step_payloads(draft_block, torch.tensor([5, 1]), torch.tensor([10, 7]), logits, block_size=BS)
    with pytest.raises(ValueError, match="shard"):
        step_payloads(draft_block, torch.tensor([3, 1]), torch.tensor([10, 7]), logits[:, :3], block_size=BS, vocab_size=V)


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


def test_parse_native_response_reads_keys_at_top_level_of_meta_info():
    """0.5.23's tokenizer manager sets meta_info[key] for every customized_info key: no nested object."""
    meta = {"spec_verify_ct": 2, "num_retractions": 0, "opd_anchor": [3, 6], "opd_draft": [[7, 8, 9], "[4, 4, 4]"],
            "opd_accepted": [2, 0], "opd_draft_logprob": [[-0.1, -0.2, -3.0], None]}
    resp = parse_native_response({"output_ids": [20, 7, 8, 30, 31], "meta_info": meta}, block_size=BS)
    assert [s.anchor for s in resp.steps] == [3, 6] and resp.steps[1].draft == [4, 4, 4]
    assert resp.steps[1].draft_logprob is None and resp.spec_verify_ct == 2 and resp.num_retractions == 0


def test_parse_native_response_names_missing_plugin_fields():
    payload = {"output_ids": [1, 2], "meta_info": {"spec_verify_ct": 1}}
    with pytest.raises(ContractError, match=r"opd_anchor`: missing.*native plugin.*Failed to apply hooks.*server version 9.9"):
        parse_native_response(payload, block_size=BS, server_version="9.9")
    payload["meta_info"].update({"opd_anchor": [3], "opd_draft": [[1, 2]], "opd_accepted": [0]})
    with pytest.raises(ContractError, match=r"opd_draft\[0\]`: expected 3 tokens"):
        parse_native_response(payload, block_size=BS)
    payload["meta_info"].update({"opd_anchor": [3, 4], "opd_draft": [[1, 2, 3]], "opd_accepted": [0]})
    with pytest.raises(ContractError, match=r"opd_anchor`: 2 entries != spec_verify_ct 1"):
        parse_native_response(payload, block_size=BS)
    # fewer values than steps: an early flush cut them by token offset
    payload["meta_info"].update({"spec_verify_ct": 2, "opd_anchor": [3], "opd_draft": [[1, 2, 3]], "opd_accepted": [0]})
    with pytest.raises(ContractError, match=r"1 entries != spec_verify_ct 2.*SGLANG_FORCE_STREAM_INTERVAL"):
        parse_native_response(payload, block_size=BS)


def test_parse_native_response_names_non_numeric_step_entries():
    """SGLang's JSON encoder (orjson) writes a non-finite float as null: a -inf teacher log-prob arrives as null inside
    its list, and must fail naming the entry and the way out, not as a TypeError from float(None)."""
    meta = {"spec_verify_ct": 1, "opd_anchor": [3], "opd_draft": [[1, 2, 3]], "opd_accepted": [0],
            "opd_draft_logprob": [[-0.1, None, -2.0]]}
    payload = {"output_ids": [5, 6], "meta_info": meta}
    with pytest.raises(ContractError, match=r"opd_draft_logprob\[0\]\[1\]`: None is not a finite float.*rollout.teacher=full"):
        parse_native_response(payload, block_size=BS)
    meta["opd_draft_logprob"] = [[-0.1, "x", -2.0]]
    with pytest.raises(ContractError, match=r"opd_draft_logprob\[0\]\[1\]`: 'x'"):
        parse_native_response(payload, block_size=BS)
    meta["opd_draft_logprob"] = [None]
    meta["opd_draft"] = [[1, None, 3]]
    with pytest.raises(ContractError, match=r"opd_draft\[0\]`: expected 3 tokens.*non-negative integers"):
        parse_native_response(payload, block_size=BS)
    # fewer entries than steps also names a verify hook that failed at some steps
    meta.update({"spec_verify_ct": 2, "opd_draft": [[1, 2, 3]]})
    with pytest.raises(ContractError, match="recording a DFLASH verify step failed"):
        parse_native_response(payload, block_size=BS)


def test_parse_native_response_zero_verify_steps():
    """SGLang omits spec_verify_ct when a request finished with no verify step: zero steps, not an error;
    but many output tokens without any verify step mean the server did not decode speculatively."""
    resp = parse_native_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}, block_size=BS)
    assert resp.steps == [] and resp.spec_verify_ct == 0 and resp.finish_reason == "stop"
    # batched with other requests, a zero-step request may carry empty or None-padded values
    padded = {"opd_anchor": [None], "opd_draft": [None], "opd_accepted": [None], "opd_draft_logprob": [None]}
    assert parse_native_response({"output_ids": [1], "meta_info": padded}, block_size=BS).steps == []
    with pytest.raises(ContractError, match=r"spec_verify_ct`: absent or 0 with 5 output tokens.*DFLASH"):
        parse_native_response({"output_ids": [1, 2, 3, 4, 5], "meta_info": {}}, block_size=BS)


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


# ---------------------------------------------------------------------------
# the 0.5.23 behaviours the stand-in reproduces, end to end

LAYERS = [0, 2]


def _native(backend, prompts, *, max_new=12, stops=(1,), teacher="token", cfg=None, urls=None):
    cfg = cfg or SGLangConfig(request_timeout_s=30, max_retries=0, backoff_s=0.05)
    with ThreadedStandin(make_app(backend, native=True)) as srv:
        ep = Endpoints.connect([srv.url]) if urls is None else urls(srv)
        recs = asyncio.run(native_rollout_async(ep, prompts, sglang_cfg=cfg, block_size=BS, max_new_tokens=max_new,
                                                stop_token_ids=list(stops), teacher=teacher))
        return recs, srv.max_in_flight


def _reference(target, drafter, prompts, max_new=12, stops=(1,)):
    local = LocalTarget(target, LAYERS, top_k=1)
    return [asyncio.run(speculate_sequence(local, drafter, ids, sample_id=sid, max_new_tokens=max_new, stop_token_ids=list(stops),
                                           teacher="token", store_features=True)) for sid, ids in prompts]


PROMPTS = [("p0", [5, 17, 33, 8]), ("p1", [40, 41, 42]), ("p2", [7, 9, 11, 13, 15, 3])]


def test_native_values_survive_early_flushes():
    """0.5.23 flushes a non-streaming response whenever len(output_ids) % SGLANG_FORCE_STREAM_INTERVAL == 0 and
    slices per-step values by output-token offset; the plugin's keys are request-level, so every step arrives.
    Without that marking the client names the cut instead of writing a record with lost steps."""
    target = make_tiny_target()
    oracle = OracleDrafter(target, BS, seed=2)
    backend = StandinBackend(target, drafter=oracle, block_size=BS, force_stream_interval=3)
    recs, _ = _native(backend, PROMPTS, max_new=24)
    assert backend.early_flushes > 0
    ref = _reference(target, OracleDrafter(target, BS, seed=2), PROMPTS, max_new=24)
    seen = set()
    for rec, r in zip(recs, ref):
        assert torch.equal(rec.input_ids, r.input_ids)
        assert torch.equal(rec.anchors, r.anchors) and torch.equal(rec.drafts, r.drafts) and torch.equal(rec.accepted, r.accepted)
        assert torch.allclose(rec.teacher_draft_logprob, r.teacher_draft_logprob, atol=1e-4)
        seen.update(rec.accepted.tolist())
    assert len(seen) >= 3, seen
    cut = StandinBackend(target, drafter=OracleDrafter(target, BS, seed=2), block_size=BS, force_stream_interval=3,
                         request_level=lambda key: False)
    with pytest.raises(ContractError, match="SGLANG_FORCE_STREAM_INTERVAL"):
        _native(cut, PROMPTS, max_new=24)


def test_native_zero_verify_steps():
    """A request that ends at its prefill token (max_new_tokens 1, or a stop token first) has no verify step:
    SGLang omits spec_verify_ct and the plugin's keys; the record has no blocks."""
    target = make_tiny_target()
    backend = StandinBackend(target, drafter=OracleDrafter(target, BS), block_size=BS)
    recs, _ = _native(backend, PROMPTS, max_new=1)
    for rec, (_, ids) in zip(recs, PROMPTS):
        assert rec.num_blocks == 0 and rec.input_ids.numel() == len(ids) + 1
    first = int(target(torch.tensor([PROMPTS[0][1]])).logits[0, -1].argmax())
    recs, _ = _native(backend, PROMPTS[:1], max_new=8, stops=[first])
    assert recs[0].num_blocks == 0 and recs[0].finished and recs[0].input_ids.tolist() == PROMPTS[0][1] + [first]


def test_native_retraction_ends_the_record_at_the_last_exact_block():
    """A retracted request is re-prefilled, which emits one token outside any verify step (num_retractions 1):
    the record ends at the last block before it, a prefix of the unretracted rollout."""
    target = make_tiny_target()
    backend = StandinBackend(target, drafter=OracleDrafter(target, BS, seed=4), block_size=BS, retract_after_steps=2)
    recs, _ = _native(backend, PROMPTS, max_new=16, stops=())
    ref = _reference(target, OracleDrafter(target, BS, seed=4), PROMPTS, max_new=16, stops=())
    for rec, r in zip(recs, ref):
        assert rec.num_blocks == 2 and not rec.finished
        end = int(r.anchors[1]) + int(r.accepted[1]) + 1
        assert rec.input_ids.tolist() == r.input_ids[: end + 1].tolist()
        assert torch.equal(rec.anchors, r.anchors[:2]) and torch.equal(rec.accepted, r.accepted[:2])


def test_native_in_flight_bounded_by_the_kv_pool():
    """At most as many requests as the server's pool holds at full length are in flight (no queueing past the
    timeout, no retraction); a request larger than the pool is refused before any is sent."""
    target = make_tiny_target()
    cost = native.request_tokens(6, 8, BS)  # the longest prompt
    prompts = [(f"q{i}", [5 + i, 17, 33, 8, 9, 10][: 3 + i % 4]) for i in range(6)]
    backend = StandinBackend(target, drafter=OracleDrafter(target, BS), block_size=BS, pool_tokens=2 * cost + 1)
    cfg = SGLangConfig(request_timeout_s=30, max_retries=0, max_in_flight=8)
    recs, peak = _native(backend, prompts, max_new=8, cfg=cfg)
    assert len(recs) == 6 and 1 <= peak <= 2
    small = StandinBackend(target, drafter=OracleDrafter(target, BS), block_size=BS, pool_tokens=cost - 1)
    with pytest.raises(ValueError, match="raise sglang.max_total_tokens"):
        _native(small, prompts, max_new=8, cfg=cfg)


def test_native_in_flight_bounded_by_the_servers_running_requests():
    """DFLASH serves at most max_running_requests at once (0.5.23 resets it to 48); a request past that waits in
    SGLang's queue for a whole generation and can time out, so at most that many are sent to each server."""
    from specforge_opd.sglang.contract import parse_running_slots

    assert parse_running_slots({"max_running_requests": 48, "internal_states": [{"effective_max_running_requests_per_dp": 20},
                                                                                {"effective_max_running_requests_per_dp": 20}]}) == 40
    assert parse_running_slots({"max_running_requests": 48}) == 48 and parse_running_slots({"internal_states": []}) is None
    target = make_tiny_target()
    prompts = [(f"q{i}", [5 + i, 17, 33, 8]) for i in range(6)]
    backend = StandinBackend(target, drafter=OracleDrafter(target, BS), block_size=BS, running_slots=2)
    cfg = SGLangConfig(request_timeout_s=30, max_retries=0, max_in_flight=8)
    with ThreadedStandin(make_app(backend, native=True, delay_s=0.3)) as srv:
        ep = Endpoints.connect([srv.url])
        assert ep.running_slots == [2]
        recs = asyncio.run(native_rollout_async(ep, prompts, sglang_cfg=cfg, block_size=BS, max_new_tokens=6,
                                                stop_token_ids=[1], teacher="token"))
        peak = srv.max_in_flight
    assert len(recs) == 6 and peak == 2


def test_kv_budget_waiters_stay_bounded_by_max_in_flight(monkeypatch):
    """Every KV-budget release wakes all its waiters, so only requests holding a global slot may wait on it: with
    thousands of prompts the wake-ups stay O(max_in_flight) per release, not O(prompts)."""
    from types import SimpleNamespace

    from specforge_opd.sglang import verify_client

    waiting = {"now": 0, "peak": 0}
    acquire = verify_client.TokenBudget.acquire

    async def counted(self, n):
        waiting["now"] += 1
        waiting["peak"] = max(waiting["peak"], waiting["now"])
        try:
            await acquire(self, n)
        finally:
            waiting["now"] -= 1

    monkeypatch.setattr(verify_client.TokenBudget, "acquire", counted)

    async def fn(client, i, sid, ids):
        await asyncio.sleep(0)
        return sid

    ep = SimpleNamespace(urls=["http://127.0.0.1:9"], pool_tokens=[10], running_slots=[None], url=lambda i: "http://127.0.0.1:9")
    prompts = [(f"s{i}", [1, 2]) for i in range(300)]
    out = asyncio.run(verify_client.for_each_prompt(ep, SGLangConfig(max_in_flight=4), prompts, fn, token_cost=lambda ids: 5))
    assert out == [sid for sid, _ in prompts] and 1 <= waiting["peak"] <= 4


def test_native_timeout_grows_with_max_new_tokens():
    target = make_tiny_target()
    backend = StandinBackend(target, drafter=OracleDrafter(target, BS), block_size=BS)
    slow = dict(delay_s=0.8)
    base = dict(request_timeout_s=0.3, max_retries=0, backoff_s=0.01)

    def run(per_token):
        cfg = SGLangConfig(timeout_per_token_s=per_token, **base)
        with ThreadedStandin(make_app(backend, native=True, **slow)) as srv:
            return asyncio.run(native_rollout_async(Endpoints([srv.url]), PROMPTS[:1], sglang_cfg=cfg, block_size=BS,
                                                    max_new_tokens=8, stop_token_ids=[1], teacher="token"))

    assert len(run(0.2)) == 1  # 0.3 + 8 * 0.2 s
    with pytest.raises(ServerError, match="TimeoutError"):
        run(0.0)


def test_native_teacher_hazards_are_refused():
    with pytest.raises(ValueError, match="repetition_penalty=1.1.*refuse"):
        native_request([1, 2], max_new_tokens=4, temperature=0.0, stop_token_ids=[], extra_sampling={"repetition_penalty": 1.1})
    body = native_request([1, 2], max_new_tokens=4, temperature=0.0, stop_token_ids=[], extra_sampling={"top_p": 0.9})
    assert body["return_logprob"] is True and body["sampling_params"]["top_p"] == 0.9  # keeps the verify logits
    steps = [NativeStep(3, [7, 8, 9], 2, None), NativeStep(6, [4, 4, 4], 0, [-2.0, -1.0, -1.0])]
    with pytest.raises(ContractError, match=r"opd_draft_logprob\[0\]`: null at 1 of 2 steps.*adjusted"):
        record_from_native("s", [11, 12, 13], [20, 7, 8, 30, 31], steps, block_size=BS, teacher="token", stop_token_ids=[])
    rec = record_from_native("s", [11, 12, 13], [20, 7, 8, 30, 31], steps, block_size=BS, teacher="full", stop_token_ids=[])
    assert rec.teacher_draft_logprob is None and rec.num_blocks == 2
