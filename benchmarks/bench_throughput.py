"""Data throughput of the embedded target, before and after continuous batching, in one run.

Every embedded experiment is paid in target forwards. Measured side by side on the 2-core
machine (run it alone), each "before" the way the pipeline ran before continuous batching:

- ``rollout``: the OPD rollout of ``--rollout-prompts`` prompts of ``configs/tiny/opd.yaml``'s
  pool with the 1-layer published ``-b8`` drafter: after = one continuous batch of
  ``--rollout-batch`` rows. Two befores, both length-bucketed batches of 8 (the old
  ``rollout.batch_size``), each run until its last row ends: ``before_revision`` runs the
  package as it was at ``--before-rev`` (the last commit before continuous batching, the code
  the issue measured; ``rollout_at_revision.py`` in a subprocess on an extracted copy), and
  ``before`` drives today's engine that way. ``rollout_speedup`` is after over
  ``before_revision`` (what the change bought); ``rollout_speedup_same_code`` is after over
  ``before`` (what the batching alone buys today; ``bench_throughput_xeon.json``, written before
  the revision run existed, has only this ratio, under the name ``rollout_speedup``). Each of
  the three rollouts runs once, one after another: on a machine that drifts, compare them
  within one run only. ``rollout_of_compute_bound``: after's
  tokens/s over the bound of the run's target + drafter FLOPs per token at one 2048^3
  matmul's rate (``bench_rollout.py``).
- ``generation``: plain greedy generation for the SFT pool of ``configs/small/sft.yaml``
  (mixed prompt lengths, its stop tokens, 128 new tokens) at batch ``--gen-batch``: generated
  tokens per second of the whole job, prefill included, before (length-bucketed batches)
  and after (continuous), against the decode-only tokens/s of a full batch of the same
  prompts without stop tokens (what ``bench_decode.py`` reports).
- ``capture``: SFT feature capture of those sequences at the tiny SFT config's layers: the HF
  forward with every layer's hidden states, one sample at a time (before) against
  ``decode.capture`` of the requested layers in length-bucketed batches (after); the
  largest relative difference of the features, and both rates over the compute bound (the body's
  FLOPs over every token at the matmul rate), which caps the speedup any batching can give.
- ``decode_of_chain``: decode-only tokens/s at batch 32 over the chain ceiling (``bench_decode.py``);
  ``generation.decode_of_chain_kv`` the same over the chain plus one read of the step's fp32 KV
  cache at the measured bandwidth (``bench_decode.kv_read_bytes``), the floor of a step whose
  attention is memory-bound.

    .venv/bin/python benchmarks/bench_throughput.py [--json benchmarks/results/bench_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def sft_pool_prompts(tok, n: int) -> tuple[list, list]:
    """The first ``n`` prompts of ``configs/small/sft.yaml``'s pool, tokenized as the SFT stage does: (ids, sample ids)."""
    from specforge_opd.config import load_config
    from specforge_opd.data.prompts import tokenize_prompts, training_pool

    scfg = load_config(ROOT / "configs/small/sft.yaml", [])
    tokenized, _ = tokenize_prompts(training_pool(scfg.data, tokenizer=tok)[:n], tok, scfg)
    return [p for _, p in tokenized], [s for s, _ in tokenized]


def rollout_setup(cfg, bundle, drafter, n: int):
    """A ``SpeculativeEngine`` for OPD config ``cfg`` with ``drafter``, warmed up, and the first ``n`` prompts of its
    pool rendered with the chat template: (engine, prompt ids, sample ids)."""
    from specforge_opd.data.chat import render_prompt
    from specforge_opd.models.drafter import drafter_mask_token_id
    from specforge_opd.rollout.engine import SpeculativeEngine
    from specforge_opd.stages.opd import _pool

    tok = bundle.tokenizer
    pool, _ = _pool(cfg, tokenizer=tok)
    pool = pool[:n]
    prompts = [tok(render_prompt(tok, p.chat_messages(), thinking=False), add_special_tokens=False)["input_ids"] for p in pool]
    ids = [str(p.id) for p in pool]
    engine = SpeculativeEngine(bundle.model, drafter, cfg.rollout, stop_token_ids=bundle.stop_token_ids,
                               mask_token_id=drafter_mask_token_id(drafter), max_context=cfg.target.max_context,
                               too_long=cfg.target.too_long, prefill_chunk=cfg.target.prefill_chunk)
    engine.generate(prompts[:2], ids[:2])  # warm-up
    return engine, prompts, ids


#: The last commit before continuous batching: the rollout code the throughput issue measured.
BEFORE_REV = "0afb736d3eeae6445b4ea44179072a9f6a64b0ef"


def rollout_at_revision(rev: str, prompts: list, ids: list, drafter: str, batch: int, threads: int) -> dict:
    """The same rollout with the package at git revision ``rev``, in a subprocess (``rollout_at_revision.py``).

    The revision's tree is extracted with ``git archive`` into a temporary directory that leads
    ``PYTHONPATH`` (removed afterwards); its own ``configs/tiny/opd.yaml`` gives the rollout
    settings. Returns that script's JSON (seconds, completion_tokens, tau, records as lists).

    Raises:
        SystemExit: the revision could not be extracted, its run failed (the tail of its output
            is shown), or some ``specforge_opd`` module was imported from outside the revision's copy
            (a module missing at the revision falls through to the editable install of today's tree).
    """
    tmp = Path(tempfile.mkdtemp(prefix="specforge_opd-" + re.sub(r"[^\w.-]", "_", rev) + "-"))
    try:
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
        if arch.returncode:
            raise SystemExit(f"--before-rev {rev}: git archive failed: {arch.stderr.decode().strip()}")
        if subprocess.run(["tar", "-x", "-C", str(tmp)], input=arch.stdout).returncode:
            raise SystemExit(f"--before-rev {rev}: could not extract its tree into {tmp}")
        (tmp / "prompts.json").write_text(json.dumps({"ids": ids, "prompts": prompts}))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks/rollout_at_revision.py"), "--config",
                              str(tmp / "configs/tiny/opd.yaml"), "--drafter", drafter, "--batch", str(batch),
                              "--prompts", str(tmp / "prompts.json"), "--out", str(tmp / "out.json"),
                              "--threads", str(threads)], env=env, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"--before-rev {rev}: the rollout failed:\n{(run.stdout + run.stderr)[-2000:]}")
        out = json.loads((tmp / "out.json").read_text())
        outside = {m: f for m, f in out["modules"].items() if not Path(f).is_relative_to(tmp.resolve())}
        if outside:
            raise SystemExit(f"--before-rev {rev}: modules imported from outside the revision's copy under {tmp}: {outside}")
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollout-prompts", type=int, default=48)
    ap.add_argument("--rollout-batch", type=int, default=16)
    ap.add_argument("--before-rev", default=BEFORE_REV, help="git revision whose rollout code is the 'before'")
    ap.add_argument("--gen-prompts", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--capture-samples", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/bench_throughput.json"))
    args = ap.parse_args()
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{args.before_rev}^{{commit}}"],
                      capture_output=True).returncode:
        ap.error(f"--before-rev {args.before_rev}: not a commit of this repository")
    torch.set_num_threads(args.threads)

    from bench_decode import bandwidth, chain_ceiling, kv_read_bytes
    from bench_rollout import matmul_gflops, rollout_flops, same_records
    from rollout_at_revision import record_lists

    from specforge_opd.config import load_config
    from specforge_opd.eval.flops import capture_target_flops
    from specforge_opd.models.adapter import extract_context_feature
    from specforge_opd.models.drafter import load_drafter
    from specforge_opd.models.target import load_target
    from specforge_opd.precision import machine_info
    from specforge_opd.rollout.decode import TargetRunner, capture
    from specforge_opd.rollout.engine import autoregressive_generate, length_batches
    from specforge_opd.rollout.records import tau_of
    from specforge_opd.stages.sft_features import CAPTURE_BATCH

    res: dict = {"machine": machine_info(), "command": sys.argv, "alone": "run with nothing else heavy on the machine"}
    gflops = matmul_gflops()
    res["matmul_gflops"] = gflops

    # -- rollout
    cfg = load_config(ROOT / "configs/tiny/opd.yaml", [])
    bundle = load_target(cfg.target)
    tok, model = bundle.tokenizer, bundle.model
    drafter_name = "published:smollm2-135m-instruct-dflash-b8"
    drafter = load_drafter(drafter_name, target_config=model.config).eval()
    engine, prompts, ids = rollout_setup(cfg, bundle, drafter, args.rollout_prompts)
    old = rollout_at_revision(args.before_rev, prompts, ids, drafter_name, 8, args.threads)
    t = time.perf_counter()
    by_id = {}
    for idx in length_batches([len(p) for p in prompts], 8):
        for r in engine.generate([prompts[i] for i in idx], [ids[i] for i in idx]):
            by_id[r.sample_id] = r
    before_s = time.perf_counter() - t
    before = [by_id[s] for s in ids]
    t = time.perf_counter()
    after = engine.generate(prompts, ids, batch_size=args.rollout_batch)
    after_s = time.perf_counter() - t
    toks = sum(r.completion_tokens for r in after)
    bound = gflops * 1e9 / (rollout_flops(model.config, drafter.config, after) / toks)
    res["rollout"] = {"prompts": len(prompts), "max_new_tokens": cfg.rollout.max_new_tokens, "teacher": cfg.rollout.teacher,
                      "before_revision": {"revision": args.before_rev, "batch": 8, "seconds": old["seconds"],
                                          "tok_s": old["completion_tokens"] / old["seconds"], "tau": old["tau"],
                                          "records_equal": record_lists(after) == old["records"]},
                      "before": {"batch": 8, "tok_s": toks / before_s, "seconds": before_s},
                      "after": {"batch": args.rollout_batch, "tok_s": toks / after_s, "seconds": after_s},
                      "tau": tau_of(after), "compute_bound_tok_s": bound, "records_equal": same_records(before, after)}
    print(json.dumps(res["rollout"]), flush=True)

    # -- generation: the small SFT config's pool
    gp, gid = sft_pool_prompts(tok, args.gen_prompts)
    B, N = args.gen_batch, args.gen_tokens
    stops = bundle.stop_token_ids
    t = time.perf_counter()
    outs_before = [None] * len(gp)
    for idx in length_batches([len(p) for p in gp], B):
        for i, o in zip(idx, autoregressive_generate(model, [gp[i] for i in idx], N, stops, sample_ids=[gid[i] for i in idx])):
            outs_before[i] = o
    gen_before_s = time.perf_counter() - t
    st: dict = {}
    t = time.perf_counter()
    outs_after = autoregressive_generate(model, gp, N, stops, sample_ids=gid, batch_size=B, stats=st)
    gen_after_s = time.perf_counter() - t
    gen_toks = sum(len(o) for o in outs_after)
    dec: dict = {}
    autoregressive_generate(model, gp[:B], N, [], stats=dec)  # a full batch, no stop tokens: decode only
    decode_tok_s = dec["decode_tokens"] / dec["t_decode"]
    t_chain = chain_ceiling(model.config, torch.float32, B)
    chain = B / t_chain
    # the decode-only run's cache: its rows left-padded to the longest prompt, grown by N slots
    kv_bytes = kv_read_bytes(model.config, torch.float32, B, max(len(p) for p in gp[:B]) + N / 2)
    bw = bandwidth(int(kv_bytes))
    chain_kv = B / (t_chain + kv_bytes / bw)
    res["generation"] = {"prompts": len(gp), "batch": B, "max_new_tokens": N, "tokens": gen_toks,
                         "before_tok_s": gen_toks / gen_before_s, "after_tok_s": gen_toks / gen_after_s,
                         "admissions": st["admissions"], "decode_only_tok_s": decode_tok_s, "chain_ceiling_tok_s": chain,
                         "kv_read_bytes_per_step": kv_bytes, "bandwidth_GBps": bw / 1e9, "chain_kv_ceiling_tok_s": chain_kv,
                         "decode_of_chain_kv": decode_tok_s / chain_kv,
                         "outputs_equal": outs_before == outs_after}
    print(json.dumps(res["generation"]), flush=True)

    # -- capture: prompt + response sequences of the tiny SFT drafter's layers
    layer_ids = list(load_config(ROOT / "configs/tiny/sft.yaml", []).draft.target_layer_ids)
    seqs = [p + o for p, o in zip(gp, outs_after)][: args.capture_samples]
    t = time.perf_counter()
    ref = []
    with torch.inference_mode():
        for s in seqs:
            out = model(torch.tensor([s]), output_hidden_states=True, use_cache=False, logits_to_keep=1)
            ref.append(extract_context_feature(out.hidden_states, layer_ids)[0])
    cap_before_s = time.perf_counter() - t
    runner = TargetRunner.of(model)
    t = time.perf_counter()
    got = [None] * len(seqs)
    for idx in length_batches([len(s) for s in seqs], CAPTURE_BATCH):
        for i, (f, _) in zip(idx, capture(runner, [seqs[i] for i in idx], layer_ids)):
            got[i] = f
    cap_after_s = time.perf_counter() - t
    worst = max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref))
    # both paths run every layer of the body over every token (no logits): the roofline of the
    # capture is that work at the matmul rate, so no batching can beat cap_bound / before's rate
    cap_flops = sum(capture_target_flops(model.config, seq_len=len(s)) for s in seqs)
    cap_bound = len(seqs) / (cap_flops / (gflops * 1e9))
    res["capture"] = {"samples": len(seqs), "batch": CAPTURE_BATCH, "layers": layer_ids,
                      "before_samples_per_s": len(seqs) / cap_before_s, "after_samples_per_s": len(seqs) / cap_after_s,
                      "compute_bound_samples_per_s": cap_bound,
                      "before_of_compute_bound": len(seqs) / cap_before_s / cap_bound,
                      "after_of_compute_bound": len(seqs) / cap_after_s / cap_bound,
                      "max_relative_difference": worst}
    print(json.dumps(res["capture"]), flush=True)

    res.update(
        rollout_speedup=res["rollout"]["after"]["tok_s"] / res["rollout"]["before_revision"]["tok_s"],
        rollout_speedup_same_code=res["rollout"]["after"]["tok_s"] / res["rollout"]["before"]["tok_s"],
        rollout_of_compute_bound=res["rollout"]["after"]["tok_s"] / bound,
        generation_of_decode=res["generation"]["after_tok_s"] / decode_tok_s,
        capture_speedup=res["capture"]["after_samples_per_s"] / res["capture"]["before_samples_per_s"],
        decode_of_chain=decode_tok_s / chain,
    )
    print(json.dumps({k: res[k] for k in ("rollout_speedup", "rollout_speedup_same_code", "rollout_of_compute_bound", "generation_of_decode",
                                          "capture_speedup", "decode_of_chain")}, indent=1))
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
