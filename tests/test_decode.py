"""The target's decode path on a preallocated KV cache (``specforge_opd.rollout.decode``), on tiny random targets.

Pinned: the runner's forward equals the HF forward (hidden states and the
features of every layer id, the last one included) for Llama, Qwen2 (QKV bias)
and Qwen3 (q/k norms), packed and unpacked; decoding never reallocates or
copies the cache; prefill is chunked; finished rows leave the batch; targets
the runner does not run itself go through HF on a DynamicCache, with the same
results.
"""

from __future__ import annotations

import pytest
import torch

try:
    from conftest import make_tiny_target
except ImportError:
    from .conftest import make_tiny_target

from specforge_opd.models.adapter import extract_context_feature
from specforge_opd.rollout.decode import HFCache, KVCache, TargetRunner, prefill, step_mask
from specforge_opd.rollout.engine import autoregressive_generate


def _qwen3(seed=0, **kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=1, bos_token_id=0,
                      tie_word_embeddings=False, **kw)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg).eval()


def _qwen2(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-zero biases, so a dropped bias shows
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return m


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P = len(lengths), max(lengths)
    ids = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for b, n in enumerate(lengths):
        ids[b, P - n:] = torch.randint(3, 90, (n,), generator=g)
        valid[b, P - n:] = True
    return ids, valid, (valid.long().cumsum(1) - 1).clamp(min=0)


def _hf(model, ids, pos, mask, layer_ids):
    with torch.no_grad():
        out = model.model(input_ids=ids, position_ids=pos, attention_mask=mask, output_hidden_states=True)
    return out.last_hidden_state, extract_context_feature(out.hidden_states, layer_ids)


@pytest.mark.parametrize("make", [make_tiny_target, _qwen3, _qwen2], ids=["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("pack", [True, False])
def test_runner_forward_equals_hf(make, pack):
    model = make()
    runner = TargetRunner(model, pack=pack)
    assert runner.native and (runner.packed == pack)
    n = len(model.model.layers)
    layer_ids = list(range(n))  # the last one too: HF's last entry is the final-norm output
    ids, valid, pos = _batch([9, 5, 12])
    B, P = ids.shape
    ref_h, ref_f = _hf(model, ids, pos, step_mask(torch.zeros(B, 0, dtype=torch.bool), valid), layer_ids)
    # prefill in chunks of 5, then the same tokens again one step at a time must give the same rows
    cache = runner.new_cache(B, 4)
    h_last, feats = prefill(runner, cache, ids, valid, pos, layer_ids, chunk=5)
    assert torch.allclose(feats, ref_f, atol=1e-5), float((feats - ref_f).abs().max())
    assert torch.allclose(h_last, ref_h[:, -1:], atol=1e-5)
    # a decode step after the prefill equals the HF forward over prompt + that token
    nxt = torch.randint(3, 90, (B, 1))
    npos = pos[:, -1:] + 1
    h1, f1 = runner.forward(nxt, npos, step_mask(valid, torch.ones(B, 1, dtype=torch.bool)), cache, layer_ids)
    full_valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool)], 1)
    rh, rf = _hf(model, torch.cat([ids, nxt], 1), torch.cat([pos, npos], 1),
                 step_mask(torch.zeros(B, 0, dtype=torch.bool), full_valid), layer_ids)
    assert torch.allclose(h1, rh[:, -1:], atol=1e-5) and torch.allclose(f1, rf[:, -1:], atol=1e-5)
    assert cache.get_seq_length() == P + 1


def test_bad_layer_id_is_refused():
    model = make_tiny_target()
    runner = TargetRunner(model)
    ids, valid, pos = _batch([4])
    with pytest.raises(ValueError, match="target_layer_ids"):
        runner.forward(ids, pos, step_mask(torch.zeros(1, 0, dtype=torch.bool), valid), runner.new_cache(1, 8), [0, 7])


def test_decode_writes_in_place():
    """No step reallocates or copies the cache: the buffers stay the same storage from prefill to the last token."""
    model = make_tiny_target()
    runner = TargetRunner.of(model)
    ids, valid, pos = _batch([6, 3])
    cache = runner.new_cache(2, 6 + 20)
    prefill(runner, cache, ids, valid, pos)
    ptrs = [k.data_ptr() for k in cache.keys] + [v.data_ptr() for v in cache.values]
    kv_valid, cur = valid, pos[:, -1]
    tok = torch.tensor([5, 6])
    for _ in range(20):
        cur = cur + 1
        q = torch.ones(2, 1, dtype=torch.bool)
        runner.forward(tok.unsqueeze(1), cur.unsqueeze(1), step_mask(kv_valid, q), cache)
        kv_valid = torch.cat([kv_valid, q], 1)
    assert cache.grown == 0 and cache.get_seq_length() == 26
    assert [k.data_ptr() for k in cache.keys] + [v.data_ptr() for v in cache.values] == ptrs


def test_cache_grows_when_full_and_keeps_contents():
    c = KVCache(2, 1, 1, 2, capacity=2, dtype=torch.float32, device="cpu")
    for i in range(5):
        c.reserve(1)
        c.write(0, torch.full((1, 1, 1, 2), float(i)), torch.full((1, 1, 1, 2), -float(i)))
        c.write(1, torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
        c.length += 1
    assert c.grown == 2 and c.capacity >= 5
    assert c.keys[0][0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4] and c.values[0][0, 0, :5, 1].tolist() == [0, -1, -2, -3, -4]


def test_cache_verbs_match_dynamic_cache():
    """crop / select_rows / gather_slots do to ``KVCache`` what they do to transformers' DynamicCache."""
    model = make_tiny_target()
    native, hf = TargetRunner(model), TargetRunner(model)
    hf.native = False  # the same model through the HF path
    ids, valid, pos = _batch([7, 4, 6])
    caches = []
    for r in (native, hf):
        c = r.new_cache(3, 16)
        prefill(r, c, ids, valid, pos)
        c.crop(6)
        c.select_rows(torch.tensor([2, 0]))
        c.gather_slots(torch.tensor([[0, 2, 5], [1, 3, 4]]))
        caches.append(c)
    kv, dyn = caches
    assert isinstance(kv, KVCache) and isinstance(dyn, HFCache)
    assert kv.get_seq_length() == dyn.get_seq_length() == 3
    for i, layer in enumerate(dyn._layers()):
        assert torch.allclose(kv.keys[i][:, :, :3], layer.keys, atol=1e-6)
        assert torch.allclose(kv.values[i][:, :, :3], layer.values, atol=1e-6)


def test_prefill_is_chunked():
    model = make_tiny_target()
    runner = TargetRunner(model)
    seen = []
    orig = runner.forward

    def spy(ids, *a, **k):
        seen.append(ids.shape[1])
        return orig(ids, *a, **k)

    runner.forward = spy
    ids, valid, pos = _batch([23, 11])
    prefill(runner, runner.new_cache(2, 32), ids, valid, pos, chunk=8)
    assert seen == [8, 8, 7]
    with pytest.raises(ValueError, match="prefill_chunk"):
        prefill(runner, runner.new_cache(2, 32), ids, valid, pos, chunk=0)


def test_finished_rows_leave_the_batch(monkeypatch):
    """A row that hits its stop token is dropped from the batch; the others decode on unchanged."""
    model = make_tiny_target()
    prompts = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 8, 3)]
    free = autoregressive_generate(model, prompts, 12, [])
    stop = free[1][2]  # row 1 stops at its third token
    runner = TargetRunner.of(model)
    sizes = []
    orig = runner.forward

    def spy(ids, *a, **k):
        sizes.append(ids.shape[0])
        return orig(ids, *a, **k)

    monkeypatch.setattr(runner, "forward", spy)
    stats = {}
    outs = autoregressive_generate(model, prompts, 12, [stop], stats=stats)
    for o, f in zip(outs, free):
        cut = f[: f.index(stop) + 1] if stop in f else f
        assert o == cut
    first = min(len(o) for o in outs)  # the first row to finish (row 1 at the latest, at its third token)
    assert first <= 3 and len(outs[1]) <= 3
    # the prefill and first-1 decode steps at batch 3, then that row is gone (rows only ever leave)
    assert sizes[:first] == [3] * first and max(sizes[first:]) <= 2 and sizes == sorted(sizes, reverse=True)
    assert stats["decode_tokens"] == sum(len(o) for o in outs) - len(outs)


def _qwen3_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, eos_token_id=1, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return Qwen3MoeForCausalLM(cfg).eval()


def test_sliding_window_target_is_refused():
    model = _qwen3(layer_types=["full_attention", "sliding_attention", "full_attention"], use_sliding_window=True,
                   sliding_window=4, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding-window"):
        TargetRunner.of(model)


def test_unsupported_architecture_runs_through_hf():
    """A MoE MLP is not the runner's: HF's forward on a DynamicCache, same greedy tokens."""
    model = _qwen3_moe()
    runner = TargetRunner.of(model)
    assert not runner.native and "qwen3_moe" in runner.reason
    assert isinstance(runner.new_cache(1, 8), HFCache)
    prompt = torch.randint(3, 90, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    out = autoregressive_generate(model, [prompt], 6, [])[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_bf16_runner_matches_hf_bf16():
    """bf16 (the AMX/AVX512-BF16 option): the runner agrees with HF's bf16 forward to bf16 resolution."""
    model = make_tiny_target().to(torch.bfloat16)
    runner = TargetRunner(model)
    ids, valid, pos = _batch([6, 9])
    cache = runner.new_cache(2, 16)
    h, f = prefill(runner, cache, ids, valid, pos, [1, 3])
    rh, rf = _hf(model, ids, pos, step_mask(torch.zeros(2, 0, dtype=torch.bool), valid), [1, 3])
    assert h.dtype == torch.bfloat16
    rel = float((f.float() - rf.float()).norm() / rf.float().norm())
    assert rel < 2e-2, rel


def test_threads_follow_the_config_and_the_process_share(monkeypatch):
    from specforge_opd.models import target as tgt

    monkeypatch.setattr(tgt, "usable_cores", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert tgt.thread_count(2) == 2 and tgt.thread_count(1) == 1 and tgt.thread_count(8) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two torchrun ranks on this node: one core each
    assert tgt.thread_count(2) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert tgt.thread_count(2) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    n = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    try:
        assert tgt.apply_threads(1) == 1 and torch.get_num_threads() == 1
        import os

        assert os.environ["OMP_NUM_THREADS"] == "1"  # what the SpecForge subprocess inherits
    finally:
        torch.set_num_threads(n)


def test_every_verb_sets_threads(monkeypatch, tmp_path):
    """parse_experiment (every verb's entry) applies target.threads before the verb runs."""
    from specforge_opd.cli import experiment_parser, parse_experiment
    from specforge_opd.models import target as tgt

    seen = []
    monkeypatch.setattr(tgt, "apply_threads", lambda n: seen.append(n) or n)
    parse_experiment(experiment_parser("x"), ["target.threads=1"])
    assert seen == [1]


def test_drafter_of_another_target_dtype_is_refused():
    from specforge_opd.models.drafter import DrafterError, check_target_dtype

    check_target_dtype({}, "bfloat16", "pub")  # published checkpoints record nothing: accepted
    check_target_dtype({"target_dtype": "float32"}, "float32", "d")
    with pytest.raises(DrafterError, match="target.dtype=float32"):
        check_target_dtype({"target_dtype": "float32"}, "bfloat16", "d")


def test_runner_does_not_keep_its_model_alive_and_follows_in_place_edits():
    import gc
    import weakref

    model = make_tiny_target()
    r1 = TargetRunner.of(model)
    assert TargetRunner.of(model) is r1  # built once
    ids, valid, pos = _batch([5])
    with torch.no_grad():
        model.lm_head.weight[3].fill_(100.0)  # an in-place edit after the runner packed its copy
    r2 = TargetRunner.of(model)
    assert r2 is not r1
    h, _ = prefill(r2, r2.new_cache(1, 8), ids, valid, pos)
    assert int(r2.logits(h)[0, -1].argmax()) == 3
    ref = weakref.ref(model)
    del model, r1, r2, h
    gc.collect()
    assert ref() is None  # the cache holds the runner weakly through its model


@pytest.mark.parametrize("kind", ["granite", "mistral_window", "dynamic_rope"])
def test_look_alike_architectures_take_the_hf_path_or_are_refused(kind):
    """Same module names, other maths: only the listed model types run natively."""
    if kind == "granite":
        from transformers import GraniteConfig, GraniteForCausalLM

        cfg = GraniteConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0)
        cfg._attn_implementation = "sdpa"
        runner = TargetRunner(GraniteForCausalLM(cfg).eval())
        assert not runner.native and "granite" in runner.reason
    elif kind == "mistral_window":
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, sliding_window=8)
        cfg._attn_implementation = "sdpa"
        with pytest.raises(ValueError, match="sliding-window"):
            TargetRunner(MistralForCausalLM(cfg).eval())
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=16,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
        cfg._attn_implementation = "sdpa"
        runner = TargetRunner(LlamaForCausalLM(cfg).eval())
        assert not runner.native and "dynamic" in runner.reason


def test_zero_new_tokens_returns_empty_rows_and_fills_stats():
    model = make_tiny_target()
    stats = {}
    assert autoregressive_generate(model, [[5, 6], [7]], 0, [], stats=stats) == [[], []]
    assert stats == {"t_prefill": 0.0, "t_decode": 0.0, "decode_steps": 0, "decode_tokens": 0, "admissions": 0,
                     "compactions": 0}


def test_logits_of_a_strided_view_are_one_gemm_with_the_same_values():
    """The drafter reads logits of slots 1..bs-1 (a strided view): one 2-D GEMM over all rows, equal to the lm_head's own."""
    runner = TargetRunner(_qwen3())
    hidden = torch.randn(3, 8, 64)
    view = hidden[:, 1:]
    assert not view.is_contiguous()
    out = runner.logits(view)
    assert out.shape == (3, 7, 97)
    assert torch.equal(out, runner.lm_head(view.contiguous()))
    calls, head = [], runner.lm_head
    runner.lm_head = lambda x: calls.append(x.dim()) or head(x)
    runner.logits(view)
    assert calls == [2]  # CUDA's matmul would batch a 3-D strided input row by row
