"""Embedded target decoding against the CPU's ceilings (greedy decode tok/s, verify-step cost).

Measured in one run, per dtype (fp32, bf16) at the given thread count, on the
SFT prompt pool of ``configs/tiny/sft.yaml`` rendered with the chat template:

- greedy decoding with ``rollout.autoregressive_generate`` at each batch size:
  tok/s including the prefill, and decode-only tok/s (tokens of the decode
  forwards / their time);
- the verify step of ``bs``-token blocks at batch 1 and 8 after a prompt's
  cache, against one decode step on the same cache (the ideal speedup of
  speculative decoding is tau / (verify / decode));
- three ceilings, each a tok/s bound at the same batch:
  * ``chain``: the decode step's GEMMs alone, with the model's shapes (fused QKV,
    o, fused gate/up, down per layer, then the lm_head) on oneDNN-prepacked weights;
  * ``bandwidth``: the weights' bytes at the memory bandwidth measured by
    streaming a buffer of the same size;
  * ``matmul``: the step's matmul FLOPs (``flops.target_forward_flops``, 2·m·n·k,
    the one FLOP definition of every report) at one large matmul's rate;
  * ``chain_kv``: the chain plus one read of the step's KV cache (``kv_read_bytes``,
    the mean cache length of the run) at the measured bandwidth: attention over the
    cache is memory-bound at decode, so no attention kernel in the cache's dtype runs
    a step below this;
  and the achieved decode rate as a fraction of each.

Run it alone: two processes with 2 OpenMP threads each slow a small matmul
about 20x on a 2-core machine.

    .venv/bin/python benchmarks/bench_decode.py [--threads 2] [--batch 1 8 32 64] [--dtype float32 bfloat16]
        [--max-new-tokens 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _time(f, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up call (the median resists a stray slow call)."""
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def chain_ceiling(cfg, dtype, batch: int, reps: int = 5) -> float:
    """Seconds of one decode step's GEMM chain alone (model shapes, prepacked weights, random values)."""
    H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = [(nq + 2 * nkv, H), (H, nq), (2 * I, H), (H, I)]

    def pack(o, i):
        w = torch.randn(o, i, dtype=dtype) * 0.02
        return torch.ops.mkldnn._reorder_linear_weight(w, batch)

    layers = [[pack(o, i) for o, i in shapes] for _ in range(L)]
    head = pack(V, H)
    xs = {i: torch.randn(batch, i, dtype=dtype) for i in {H, nq, I}}

    def run():
        for ws in layers:
            for w, (o, i) in zip(ws, shapes):
                torch.ops.mkldnn._linear_pointwise(xs[i], w, None, "none", [], "")
        torch.ops.mkldnn._linear_pointwise(xs[H], head, None, "none", [], "")

    return _time(run, reps)


def kv_read_bytes(cfg, dtype, batch: int, mean_slots: float) -> float:
    """Bytes one decode step reads from the KV cache: keys and values of every layer, ``batch`` rows of
    ``mean_slots`` slots each (the left-padded cache length, averaged over the run's steps)."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2.0 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * elem * batch * mean_slots


def bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of streaming (summing) a buffer of ``nbytes``: the memory-bound rate of reading weights once."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t = _time(lambda: buf.sum(), reps)
    return nbytes / t


def matmul_rate(dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of one n x n x n matmul (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _time(lambda: a @ b, reps)


def load_prompts(tokenizer, n: int) -> list[list[int]]:
    from specforge_opd.config import load_config
    from specforge_opd.data.prompts import prompt_limit, render_training_prompt, training_pool

    cfg = load_config("configs/tiny/sft.yaml")
    limit = prompt_limit(cfg)
    out = []
    for rec in training_pool(cfg.data):
        ids = tokenizer(render_training_prompt(tokenizer, rec, cfg), add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            out.append(ids)
        if len(out) == n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--verify-batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge_opd.data.assets import ensure_target
    from specforge_opd.eval.flops import target_forward_flops
    from specforge_opd.rollout.decode import step_mask
    from specforge_opd.rollout.engine import autoregressive_generate

    path = ensure_target(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = load_prompts(tok, max(args.batch + args.verify_batch))
    from specforge_opd.precision import machine_info

    results = {"machine": machine_info(), "threads": args.threads, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "dtypes": {}}
    for dname in args.dtype:
        dtype = getattr(torch, dname)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        cfg = model.config
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - (
            model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
            if model.config.tie_word_embeddings else 0
        )
        # the lm_head is read every step even when tied (the embedding rows are gathered, not streamed)
        weight_bytes += 0 if not model.config.tie_word_embeddings else model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        bw = bandwidth(weight_bytes)
        mm = matmul_rate(dtype)
        row = {"weight_bytes": weight_bytes, "bandwidth_GBps": bw / 1e9, "matmul_GFLOPps": mm / 1e9, "decode": {}, "verify": {}}
        autoregressive_generate(model, prompts[:1], 4, [])  # warm-up (packing, allocator)
        for B in args.batch:
            batch = prompts[:B]
            st: dict = {}
            t = time.perf_counter()
            outs = autoregressive_generate(model, batch, args.max_new_tokens, [], stats=st)
            wall = time.perf_counter() - t
            toks = sum(len(o) for o in outs)
            dec_toks = st.get("decode_tokens", B * st["decode_steps"])
            dec = dec_toks / st["t_decode"]
            P = max(len(p) for p in batch)
            keys = B * (P + args.max_new_tokens // 2)
            step_flops = target_forward_flops(cfg, tokens=B, attended_keys=keys, lm_head_tokens=B)
            t_chain = chain_ceiling(cfg, dtype, B)
            t_kv = kv_read_bytes(cfg, dtype, B, P + args.max_new_tokens / 2) / bw
            ceil = {"chain": B / t_chain, "bandwidth": B * bw / weight_bytes, "matmul": B * mm / step_flops,
                    "chain_kv": B / (t_chain + t_kv)}
            row["decode"][B] = {
                "tok_s_with_prefill": toks / wall,
                "decode_tok_s": dec,
                "step_ms": 1e3 * B / dec,
                "ceiling_tok_s": ceil,
                "achieved_over": {k: dec / v for k, v in ceil.items()},
                "achieved_GFLOPps": dec / B * step_flops / 1e9,
            }
            print(f"{dname} batch {B:3d}: {toks / wall:6.1f} tok/s incl. prefill, decode {dec:6.1f} tok/s "
                  f"({1e3 * B / dec:.1f} ms/step); ceilings chain {ceil['chain']:.0f} / bandwidth {ceil['bandwidth']:.0f} / "
                  f"matmul {ceil['matmul']:.0f} / chain+KV read {ceil['chain_kv']:.0f} tok/s -> achieved "
                  f"{dec / ceil['chain']:.0%} / {dec / ceil['bandwidth']:.0%} / {dec / ceil['matmul']:.0%} / "
                  f"{dec / ceil['chain_kv']:.0%}", flush=True)
        # verify step vs decode step on a prompt's cache
        try:
            from specforge_opd.rollout.decode import TargetRunner, left_pad, prefill
        except ImportError:  # a checkout from before the static-cache decode path: decode rows only
            args.verify_batch = []
        else:
            runner = TargetRunner.of(model)
        for B in args.verify_batch:
            batch = prompts[:B]
            ids, valid, pos = left_pad(batch)
            P = ids.shape[1]
            cache = runner.new_cache(B, P + 64)
            prefill(runner, cache, ids, valid, pos)
            S = cache.get_seq_length()

            def step(q):
                blk = torch.randint(100, 40000, (B, q))
                bpos = pos[:, -1:] + 1 + torch.arange(q)
                m = step_mask(valid, torch.ones(B, q, dtype=torch.bool))

                def run():
                    h, _ = runner.forward(blk, bpos, m, cache, None)
                    runner.logits(h)
                    cache.crop(S)

                return _time(run, 15)

            t1 = step(1)
            for bs in args.block_sizes:
                tv = step(bs)
                row["verify"][f"b{B}_bs{bs}"] = {"verify_ms": 1e3 * tv, "decode_ms": 1e3 * t1, "verify_over_decode": tv / t1}
                print(f"{dname} verify batch {B} block {bs}: {1e3 * tv:.1f} ms vs decode step {1e3 * t1:.1f} ms -> {tv / t1:.2f}x", flush=True)
        results["dtypes"][dname] = row
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
