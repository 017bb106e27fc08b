"""Rollout throughput: speculative rollout vs the target's plain autoregressive decoding (issue 3).

On the embedded SmolLM2 target, at each batch size, measured side by side in one
run on the same prompts: generated tokens per second of
``SpeculativeEngine.generate`` and of ``autoregressive_generate``, the pooled
tau, and the ideal speedup ``tau * t_decode / (t_verify + t_draft)`` (per batch
step times measured in the same run). Measured speedup within 15% of the ideal
means the engine adds little of its own. A random drafter (default) has tau ~ 1;
pass ``--drafter DIR`` for a trained one.

    .venv/bin/python benchmarks/bench_rollout.py [--drafter DIR] [--batch 1 8] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", help="HF DFlash drafter directory (default: a random 1-layer drafter)")
    ap.add_argument("--block-size", type=int, default=16, help="block size of the random drafter")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge_opd.config import RolloutConfig
    from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID, ensure_target
    from specforge_opd.data.chat import render_prompt
    from specforge_opd.data.prompts import eval_prompts
    from specforge_opd.models.drafter import build_drafter, derive_draft_config, drafter_mask_token_id, load_drafter
    from specforge_opd.rollout.engine import SpeculativeEngine, autoregressive_generate

    path = ensure_target(progress=False)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    if args.drafter:
        drafter = load_drafter(args.drafter, target_config=target.config).eval()
    else:
        dcfg = derive_draft_config(target.config, num_hidden_layers=1, block_size=args.block_size, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
        drafter = build_drafter(dcfg, seed=0).eval()
    mask = drafter_mask_token_id(drafter)
    recs = eval_prompts("mtbench", limit=max(args.batch))
    prompts = [tok(render_prompt(tok, r.chat_messages(), thinking=False), add_special_tokens=False)["input_ids"] for r in recs]
    # no stop tokens: both decoders produce exactly max_new_tokens per row, so tokens/s compare like for like
    rc = RolloutConfig(max_new_tokens=args.max_new_tokens, teacher="token")
    engine = SpeculativeEngine(target, drafter, rc, stop_token_ids=[], mask_token_id=mask)
    # warm up both paths (allocator, thread pools)
    engine.generate(prompts[:1])
    autoregressive_generate(target, prompts[:1], 4, [])

    rows = []
    for B in args.batch:
        batch = prompts[:B]
        ar_stats: dict = {}
        t = time.perf_counter()
        ar = autoregressive_generate(target, batch, args.max_new_tokens, [], stats=ar_stats)
        t_ar = time.perf_counter() - t
        ar_tokens = sum(len(o) for o in ar)
        t = time.perf_counter()
        out = engine.generate(batch)
        t_spec = time.perf_counter() - t
        st = engine.stats
        spec_tokens = sum(r.completion_tokens for r in out)
        tau = spec_tokens / st["verify_steps"]
        steps = st["batch_steps"]
        t_decode = ar_stats["t_decode"] / max(ar_stats["decode_steps"], 1)
        t_verify, t_draft = st["t_verify"] / steps, st["t_draft"] / steps
        ideal = tau * t_decode / (t_verify + t_draft)
        measured = (spec_tokens / t_spec) / (ar_tokens / t_ar)
        lossless = all(r.input_ids[r.prompt_len:].tolist() == o for r, o in zip(out, ar))
        rows.append(
            {
                "batch": B, "block_size": engine.block_size, "max_new_tokens": args.max_new_tokens,
                "ar_tok_s": ar_tokens / t_ar, "spec_tok_s": spec_tokens / t_spec, "tau": tau,
                "t_decode_ms": 1e3 * t_decode, "t_verify_ms": 1e3 * t_verify, "t_draft_ms": 1e3 * t_draft,
                "t_other_ms": 1e3 * st["t_other"] / steps, "t_prefill_spec_s": st["t_prefill"], "t_prefill_ar_s": ar_stats["t_prefill"],
                "ideal_speedup": ideal, "measured_speedup": measured, "measured_over_ideal": measured / ideal,
                "greedy_outputs_equal": lossless,
            }
        )
    hdr = f"{'B':>3} {'AR tok/s':>9} {'spec tok/s':>10} {'tau':>6} {'decode ms':>9} {'verify ms':>9} {'draft ms':>8} {'ideal x':>8} {'measured x':>10} {'meas/ideal':>10} equal"
    print(hdr)
    for r in rows:
        print(f"{r['batch']:>3} {r['ar_tok_s']:>9.1f} {r['spec_tok_s']:>10.1f} {r['tau']:>6.2f} {r['t_decode_ms']:>9.1f} "
              f"{r['t_verify_ms']:>9.1f} {r['t_draft_ms']:>8.1f} {r['ideal_speedup']:>8.2f} {r['measured_speedup']:>10.2f} "
              f"{r['measured_over_ideal']:>10.2f} {r['greedy_outputs_equal']}")
    if args.json:
        with open(args.json, "w") as f:
            from specforge_opd.precision import machine_info

            json.dump({"machine": machine_info(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
