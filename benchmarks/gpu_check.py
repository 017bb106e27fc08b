"""The GPU check's sections (run by ``scripts/gpu_check.sh``; one section per process, each under its own timeout).

    python benchmarks/gpu_check.py SECTION --out FILE [--cpu]

Sections (``--cpu``: the same code at tiny shapes on the CPU, the dry form tested here):

- ``env``: versions, the device, and where pydantic/SpecForge were imported from (the
  carried wheels, installed into a temporary site directory by the shell script).
- ``equality``: a tiny random target and drafter; the OPD loss of one rolled-out sequence
  on the CPU (fp32) against the device (fp32, and bf16 autocast within bf16 tolerance);
  greedy speculative output against greedy decoding on the device, and against the CPU.
- ``trainer``: the OPD replay step (forward + backward, groups of
  ``--max-blocks`` blocks, flex_attention on the GPU) at Qwen3-8B DFlash drafter shapes
  (random target of Qwen3-8B width and vocabulary with few layers, 5 drafter layers,
  block 16, 4096-token sequences, bf16 autocast): positions/s and peak memory per teacher
  form, SpecForge's own DFlash SFT step (``OnlineDFlashModel``, 512 anchors) on the same
  inputs as the reference, and the ``feature_source: target`` recompute.
- ``rollout``: the speculative engine's verify and decode step times at batch 1/8/32 on a
  random target of Qwen3-8B width (few layers), ideal against measured speedup.

Every section rewrites FILE after each measurement, so a timeout keeps what ran.
``merge`` folds the section files into one JSON (``scripts/gpu_check.sh`` calls it after
each section).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class Section:
    """A section's JSON, written to disk after every ``put``."""

    def __init__(self, path: str, name: str):
        self.path, self.data = Path(path), {"section": name, "status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.t0 = time.perf_counter()
        self.flush()

    def put(self, key, value) -> None:
        self.data[key] = value
        self.data["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def _device(cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (run scripts/gpu_check.sh --cpu for the dry form)")
    return torch.device("cuda", 0)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device):
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def _log(msg: str) -> None:
    """A progress line in the section's log (flushed: a section killed by its timeout shows where it was)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _timed(fn, device, reps: int, first: dict = None) -> float:
    """Seconds per call after one warm-up call (compiles, allocator); the warm-up's seconds go to ``first["first_call_s"]``."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    if first is not None:
        first["first_call_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


# ---------------------------------------------------------------------------


def section_env(args, out: Section) -> None:
    import pydantic
    import specforge
    import transformers

    import specforge_opd.train.trainer  # noqa: F401  (the project imports end to end)

    site = os.environ.get("GPU_CHECK_SITE")
    info = {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "pydantic": pydantic.__version__, "pydantic_from": pydantic.__file__, "specforge_from": specforge.__file__,
        "cuda_available": torch.cuda.is_available(),
    }
    from specforge_opd.precision import machine_info

    info["machine"] = machine_info()
    if site:
        info["wheels_from_site_dir"] = all(str(Path(info[k]).resolve()).startswith(str(Path(site).resolve())) for k in ("pydantic_from", "specforge_from"))
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    out.put("env", info)
    if site and not info["wheels_from_site_dir"]:
        raise SystemExit(f"pydantic/specforge were not imported from the carried wheels in {site}")


def _dynamo_stats():
    """torch.compile's counters so far (graphs compiled, recompiles, graph breaks), or None where unavailable."""
    try:
        from torch._dynamo.utils import counters

        return {k: {str(kk): vv for kk, vv in v.items()} for k, v in counters.items() if k in ("stats", "recompiles", "graph_break", "frames")}
    except Exception:  # a private API: its absence must not fail the check
        return None


def _tiny_models(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specforge_opd.models.drafter import build_drafter, derive_draft_config

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, bos_token_id=0, pad_token_id=2,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    target = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    dcfg = derive_draft_config(target.config, num_hidden_layers=2, block_size=4, mask_token_id=96)
    drafter = build_drafter(dcfg, "sdpa", seed=seed + 1).eval()
    return target, drafter


def section_equality(args, out: Section) -> None:
    import copy

    from specforge_opd.config import RolloutConfig
    from specforge_opd.rollout.engine import SpeculativeEngine, autoregressive_generate
    from specforge_opd.train.losses import plan_slots, slot_coefficients
    from specforge_opd.train.trainer import sequence_loss

    device = _device(args.cpu)
    target, drafter = _tiny_models()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 9, 7, 12)]
    rc = RolloutConfig(max_new_tokens=24, teacher="full")

    def spec_and_greedy(t, d):
        eng = SpeculativeEngine(t, d, rc, stop_token_ids=[], mask_token_id=96)
        recs = eng.generate(prompts)
        greedy = autoregressive_generate(t, prompts, rc.max_new_tokens, [])
        return recs, greedy

    _log("greedy: CPU then device")
    cpu_recs, cpu_greedy = spec_and_greedy(target, drafter)
    dev_target, dev_drafter = copy.deepcopy(target).to(device), copy.deepcopy(drafter).to(device)
    dev_recs, dev_greedy = spec_and_greedy(dev_target, dev_drafter)
    spec = [r.input_ids[r.prompt_len:].tolist() for r in dev_recs]
    out.put("greedy", {
        "speculative_equals_greedy_on_device": spec == dev_greedy,
        "device_greedy_equals_cpu_greedy": dev_greedy == cpu_greedy,
        "device_speculative_equals_cpu": spec == [r.input_ids[r.prompt_len:].tolist() for r in cpu_recs],
        "tau_device": sum(r.completion_tokens for r in dev_recs) / max(1, sum(r.num_blocks for r in dev_recs)),
    })

    def loss_on(t, d, rec, autocast: bool):
        plan = plan_slots(rec.accepted, rec.block_size)
        coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
        d = d.train()
        d.zero_grad(set_to_none=True)
        dev = next(t.parameters()).device
        ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else torch.autocast(dev.type, enabled=False)
        with ctx:
            loss, _, _ = sequence_loss(d, t.model.embed_tokens, t.lm_head.weight, rec, plan, coef, mask_token_id=96, max_blocks_per_forward=2)
        loss.backward()
        gn = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in d.parameters() if p.grad is not None))
        return float(loss), float(gn)

    rows = []
    for rec in cpu_recs:
        ref, ref_g = loss_on(target, drafter, rec, False)
        f32, f32_g = loss_on(dev_target, dev_drafter, rec, False)
        b16, b16_g = loss_on(dev_target, dev_drafter, rec, True)
        rows.append({"cpu_fp32": ref, "device_fp32": f32, "device_bf16": b16, "rel_fp32": abs(f32 - ref) / abs(ref),
                     "rel_bf16": abs(b16 - ref) / abs(ref), "grad_norm_cpu": ref_g, "grad_norm_device": f32_g})
    ok = all(r["rel_fp32"] < 1e-4 and r["rel_bf16"] < 3e-2 for r in rows)
    out.put("loss", {"rows": rows, "within_tolerance": ok, "tolerance": {"fp32": 1e-4, "bf16": 3e-2}})

    # flex_attention replay in groups of 2 blocks (the GPU backend; it has no CPU backward, so the
    # test suite never ran its gradient) against one sdpa forward over all blocks, fp32. On the
    # CPU both are sdpa.
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    flex = copy.deepcopy(dev_drafter)
    flex.config._attn_implementation = backend

    def grads_of(d, rec, attn, groups):
        plan = plan_slots(rec.accepted, rec.block_size)
        coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
        d = d.train()
        d.zero_grad(set_to_none=True)
        loss, _, _ = sequence_loss(d, dev_target.model.embed_tokens, dev_target.lm_head.weight, rec, plan, coef, mask_token_id=96,
                                   attention_backend=attn, max_blocks_per_forward=groups)
        loss.backward()
        return float(loss), {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}

    _log(f"flex_vs_sdpa ({backend}): first calls compile")
    worst, losses = 0.0, []
    for rec in cpu_recs:
        la, ga = grads_of(dev_drafter, rec, "sdpa", None)  # one forward over all blocks
        lb, gb = grads_of(flex, rec, backend, 2)  # groups of 2 blocks
        losses.append([la, lb])
        for k in ga:
            worst = max(worst, float((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp_min(1e-12)))
    out.put("flex_vs_sdpa", {"backend": backend, "losses": losses, "max_grad_rel_diff": worst, "equal": worst < 1e-3})


def _qwen3_target(layers: int, hidden: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=40960,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
    model = model.to(dtype).eval().requires_grad_(False)
    # Random weights at init scale give near-uniform logits; what is timed does not depend on them.
    return model


def _shapes(args):
    if args.cpu:
        return dict(layers=4, hidden=64, inter=128, heads=4, kv=2, head_dim=16, vocab=512, seq=160, block=4, draft_layers=2,
                    reps=1, backend="sdpa", dtype=torch.float32)
    return dict(layers=6, hidden=4096, inter=12288, heads=32, kv=8, head_dim=128, vocab=151936, seq=4096, block=16, draft_layers=5,
                reps=2, backend="flex_attention", dtype=torch.bfloat16)


def section_trainer(args, out: Section) -> None:
    from specforge_opd.models.adapter import OnlineDFlashModel
    from specforge_opd.models.drafter import build_drafter, derive_draft_config, drafter_layer_ids
    from specforge_opd.rollout.records import RolloutRecord
    from specforge_opd.train.losses import plan_slots, slot_coefficients
    from specforge_opd.train.replay import recompute_from_target
    from specforge_opd.train.trainer import sequence_group_losses

    device = _device(args.cpu)
    sh = _shapes(args)
    target = _qwen3_target(sh["layers"], sh["hidden"], sh["inter"], sh["heads"], sh["kv"], sh["head_dim"], sh["vocab"], sh["dtype"], device)
    V, bs, T = sh["vocab"], sh["block"], sh["seq"]
    mask_id = V - 1
    dcfg = derive_draft_config(target.config, num_hidden_layers=sh["draft_layers"], block_size=bs, mask_token_id=mask_id)
    with torch.device(device):  # initialized in place: a 1B-parameter drafter is slow to initialize on the host
        drafter = build_drafter(dcfg, sh["backend"], seed=1).train()
    layers = drafter_layer_ids(drafter)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    H = sh["hidden"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (T,), generator=g)
    prompt = T // 16
    # tau ~ 3 (r_m = 2): the paper's regime after SFT; anchors a_m = prompt + 3m
    M = (T - 2 - prompt) // 3
    anchors = prompt + 3 * torch.arange(M)
    accepted = torch.full((M,), 2)
    drafts = torch.randint(0, V - 1, (M, bs - 1), generator=g)
    feats = (torch.randn(T - 1, len(layers) * H, generator=g) * 0.5).to(device, sh["dtype"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.cpu)
    out.put("shapes", {k: (str(v) if k == "dtype" else v) for k, v in sh.items()} | {"blocks": M, "max_blocks_per_forward": args.max_blocks,
                                                                                     "drafter_params": sum(p.numel() for p in drafter.parameters())})

    def record(form: str) -> RolloutRecord:
        teacher = {}
        if form == "full":
            teacher["teacher_hidden"] = torch.randn(M, bs - 1, H, generator=g).to(device, sh["dtype"])
        else:
            teacher["teacher_draft_logprob"] = (-torch.rand(M, bs - 1, generator=g) * 3).to(device)
            if form == "topk":
                teacher["teacher_topk_ids"] = torch.randint(0, V, (M, bs - 1, 32), generator=g).to(device)
                teacher["teacher_topk_logprobs"] = (torch.log_softmax(torch.randn(M, bs - 1, 32, generator=g), -1) - 0.1).to(device)
        return RolloutRecord(sample_id="g", input_ids=ids.to(device), prompt_len=prompt, anchors=anchors.to(device), drafts=drafts.to(device),
                             accepted=accepted.to(device), features=feats, **teacher)

    results = {}
    # SpecForge's DFlash SFT step on the same sequence and features: 512 random anchors, CE.
    sf = OnlineDFlashModel(drafter, head, embed, mask_token_id=mask_id, block_size=bs, attention_backend=sh["backend"],
                           num_anchors=min(512, M), objective_chunk_blocks=64)
    loss_mask = torch.zeros(1, T, device=device)
    loss_mask[0, prompt:] = 1
    hidden_sf = torch.cat([feats, feats[-1:]]).unsqueeze(0)

    def specforge_step():
        with autocast:
            loss, _, _ = sf(ids.view(1, -1).to(device), hidden_sf, loss_mask)
        loss.backward()
        drafter.zero_grad(set_to_none=True)

    try:
        _peak_reset(device)
        _log("specforge_sft: first call (compiles)")
        first: dict = {}
        s = _timed(specforge_step, device, sh["reps"], first)
        results["specforge_sft"] = {"positions_per_s": min(512, M) * bs / s, "step_s": s, "positions": min(512, M) * bs, "peak_gib": _peak_gib(device)} | first
    except Exception as e:  # a SpecForge failure must not hide the OPD numbers
        results["specforge_sft"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    out.put("results", results)

    for form in ("token", "full", "topk"):
        rec = record(form)
        plan = plan_slots(rec.accepted.cpu(), bs)
        coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())

        group_s: list = []  # the first call's seconds per replay group (each group shape may compile)

        def opd_step():
            t_g = time.perf_counter()
            for loss, _, _ in sequence_group_losses(drafter, embed, head.weight, rec, plan, coef, mask_token_id=mask_id,
                                                    attention_backend=sh["backend"], chunk_slots=1024, max_blocks_per_forward=args.max_blocks):
                loss.backward()
                if not first:
                    _sync(device)
                    group_s.append(round(time.perf_counter() - t_g, 2))
                    _log(f"opd_{form}: first call, group {len(group_s)} done after {group_s[-1]} s")
                    results[f"opd_{form}"] = {"first_call_groups_s": group_s, "dynamo": _dynamo_stats()}
                    out.put("results", results)
                    t_g = time.perf_counter()
            drafter.zero_grad(set_to_none=True)

        def opd_step_autocast():
            with autocast:
                opd_step()

        first: dict = {}
        try:
            _peak_reset(device)
            _log(f"opd_{form}: first call (compiles)")
            s = _timed(opd_step_autocast, device, sh["reps"], first)
            row = {"positions_per_s": M * bs / s, "step_s": s, "positions": M * bs, "peak_gib": _peak_gib(device),
                   "first_call_groups_s": group_s, "dynamo": _dynamo_stats()} | first
            if "positions_per_s" in results.get("specforge_sft", {}):
                row["ratio_vs_specforge"] = row["positions_per_s"] / results["specforge_sft"]["positions_per_s"]
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        results[f"opd_{form}"] = row
        out.put("results", results)

    # feature_source=target: the frozen target's recompute of the same sequence
    bare = RolloutRecord(sample_id="g", input_ids=ids.to(device), prompt_len=prompt, anchors=anchors.to(device), drafts=drafts.to(device),
                         accepted=accepted.to(device))
    for form in ("full", "topk"):
        try:
            _peak_reset(device)
            _log(f"recompute_{form}")
            s = _timed(lambda: recompute_from_target(target, bare, layers, form=form, topk=32, max_blocks_per_forward=args.max_blocks), device, 1)
            results[f"recompute_{form}"] = {"rows_per_s": (T - 1 + M * (bs - 1)) / s, "s": s, "peak_gib": _peak_gib(device)}
        except Exception as e:
            results[f"recompute_{form}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.put("results", results)


def section_rollout(args, out: Section) -> None:
    from specforge_opd.config import RolloutConfig
    from specforge_opd.models.drafter import build_drafter, derive_draft_config
    from specforge_opd.rollout.engine import SpeculativeEngine, autoregressive_generate

    device = _device(args.cpu)
    sh = _shapes(args)
    layers = 4 if not args.cpu else sh["layers"]
    target = _qwen3_target(layers, sh["hidden"], sh["inter"], sh["heads"], sh["kv"], sh["head_dim"], sh["vocab"], sh["dtype"], device)
    V = sh["vocab"]
    dcfg = derive_draft_config(target.config, num_hidden_layers=1, block_size=sh["block"], mask_token_id=V - 1)
    drafter = build_drafter(dcfg, "sdpa", seed=0).to(device, sh["dtype"]).eval()
    new_tokens = 8 if args.cpu else 32
    rc = RolloutConfig(max_new_tokens=new_tokens, teacher="token")
    engine = SpeculativeEngine(target, drafter, rc, stop_token_ids=[], mask_token_id=V - 1)
    g = torch.Generator().manual_seed(0)
    batches = [1, 2] if args.cpu else [1, 8, 32]
    prompts = [torch.randint(0, V - 1, (64 if not args.cpu else 12,), generator=g).tolist() for _ in range(max(batches))]
    engine.generate(prompts[:1])  # warm-up
    autoregressive_generate(target, prompts[:1], 4, [])
    rows = []
    # Each batch size runs twice: pass 1 meets every new shape (kernel selection, allocator), pass 2
    # is the steady state. The step times are host clocks without a device sync per phase, so a
    # phase can absorb work queued by the one before it; the totals (tok/s) are synced.
    for B in batches:
        for pass_ in (1, 2):
            batch = prompts[:B]
            ar_stats: dict = {}
            _log(f"rollout batch {B} pass {pass_}")
            _sync(device)
            t = time.perf_counter()
            ar = autoregressive_generate(target, batch, new_tokens, [], stats=ar_stats)
            _sync(device)
            t_ar = time.perf_counter() - t
            t = time.perf_counter()
            recs = engine.generate(batch)
            _sync(device)
            t_spec = time.perf_counter() - t
            st = engine.stats
            spec_tokens = sum(r.completion_tokens for r in recs)
            ar_tokens = sum(len(o) for o in ar)
            tau = spec_tokens / st["verify_steps"]
            steps = st["batch_steps"]
            t_decode = ar_stats["t_decode"] / max(ar_stats["decode_steps"], 1)
            t_verify, t_draft = st["t_verify"] / steps, st["t_draft"] / steps
            ideal = tau * t_decode / (t_verify + t_draft)
            measured = (spec_tokens / t_spec) / (ar_tokens / t_ar)
            spec_out = [r.input_ids[r.prompt_len:].tolist() for r in recs]
            rows.append({"batch": B, "pass": pass_, "tau": tau, "t_decode_ms": 1e3 * t_decode, "t_verify_ms": 1e3 * t_verify,
                         "t_draft_ms": 1e3 * t_draft, "ar_tok_s": ar_tokens / t_ar, "spec_tok_s": spec_tokens / t_spec,
                         "ideal_speedup": ideal, "measured_speedup": measured, "measured_over_ideal": measured / ideal,
                         "greedy_outputs_equal": spec_out == ar,
                         # with random weights the logits are near-uniform: in bf16 a verify pass (bs
                         # positions) and a decode step can break a near-tie differently, so the
                         # outputs may part; the agreed prefix says where (fp32 exactness: equality)
                         "greedy_agreed_prefix_frac": _agreed_prefix(spec_out, ar)})
            out.put("rows", rows)
    if args.cpu:
        return
    # Where a batched speculative step spends its time: the profiler's top operators.
    from torch.profiler import ProfilerActivity, profile

    B = 8
    _log(f"profile batch {B}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts[:B])
        _sync(device)
    ka = prof.key_averages()

    def top(attr: str, n: int = 15) -> list:
        rows_ = sorted(ka, key=lambda e: getattr(e, attr, 0) or 0, reverse=True)[:n]
        return [{"op": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "self_device_ms": (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) / 1e3}
                for e in rows_]

    dev_attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    out.put("profile_batch8", {"steps": engine.stats["batch_steps"], "top_self_cpu": top("self_cpu_time_total"), "top_self_device": top(dev_attr)})


def _agreed_prefix(a: list, b: list) -> float:
    """Mean over rows of the fraction of the shorter output that both lists of token lists agree on from the start."""
    fracs = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        fracs.append(k / max(n, 1))
    return sum(fracs) / max(len(fracs), 1)


SECTIONS = {"env": section_env, "equality": section_equality, "trainer": section_trainer, "rollout": section_rollout}


def merge(parts_dir: Path, dest: Path, meta: dict) -> dict:
    """Fold ``section_*.json`` of ``parts_dir`` and the shell's status lines into ``dest`` (atomic)."""
    data = {"meta": meta, "sections": {}}
    for p in sorted(parts_dir.glob("section_*.json")):
        try:
            data["sections"][p.stem[len("section_"):]] = json.loads(p.read_text())
        except ValueError:
            data["sections"][p.stem[len("section_"):]] = {"status": "unreadable"}
    status = parts_dir / "status.tsv"
    if status.is_file():
        for line in status.read_text().splitlines():
            name, rc, wall = line.split("\t")
            sec = data["sections"].setdefault(name, {})
            sec["rc"], sec["shell_wall_s"] = int(rc), float(wall)
            sec["status"] = "ok" if rc == "0" else ("timeout" if rc in ("124", "137") else "error")
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, dest)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=sorted(SECTIONS) + ["merge"])
    ap.add_argument("--out", required=True, help="section JSON file (merge: the merged JSON)")
    ap.add_argument("--parts", help="merge: directory of the section files")
    ap.add_argument("--meta", default="{}", help="merge: JSON object of run facts (date, command)")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (the dry form)")
    ap.add_argument("--max-blocks", type=int, default=None,
                    help="training.max_blocks_per_forward of the trainer section (default 512; 16 with --cpu, so that it replays in groups)")
    args = ap.parse_args(argv)
    if args.section == "merge":
        merge(Path(args.parts), Path(args.out), json.loads(args.meta))
        return 0
    if args.max_blocks is None:
        args.max_blocks = 16 if args.cpu else 512
    if args.cpu:
        torch.set_num_threads(1)
    if args.section == "trainer":
        # which guard failed at each recompile goes to the section's log
        try:
            torch._logging.set_logs(recompiles=True)
        except Exception:
            pass
    out = Section(args.out, args.section)
    try:
        SECTIONS[args.section](args, out)
    except BaseException as e:
        out.put("status", "error")
        out.put("error", f"{type(e).__name__}: {e}"[:2000])
        raise
    out.put("status", "ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
