"""SFT train-step positions per second: SpecForge's own ``train`` loop, with SpecForge's objective and with
``sft.lm_head_recompute=false``, against the lm_head-only ceiling.

Each configuration runs the real SFT train step (``python -m specforge.cli train``,
built by ``sft_train.specforge_run_config``, optimizer and all) for ``--steps`` optimizer
steps, at each drafter depth (``--layers``, ``target_layer_ids`` unchanged) and each
objective (``--objectives``: ``specforge``, SpecForge's checkpointed lm_head chunks that
recompute the logits in the backward; ``stored``, ``sft.lm_head_recompute=false``, the same
loss and gradients with each chunk's gradient kept from the forward; its rows carry
``speedup_vs_specforge`` at the same dtype, anchors and depth), on synthetic offline
samples of the embedded target's shapes (speed depends on shapes only), and reads SpecForge's logged ``perf/optimizer_step_time_s``
(the first log window, warm-up, is dropped). A position is one drafter slot:
``num_anchors x block_size`` per step, counted alike for both objectives (``stored``
skips the zero-weight anchor slots, part of its gain). The ceiling, measured in the same run, is
the frozen lm_head alone: logits for the same positions, cross-entropy, and the
backward into the hidden states (the weight is frozen), in the same dtype with
the loss in fp32. It is what one step would cost if the drafter were free.

Run alone on a quiet machine (nothing else heavy beside it):

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_sft.py [--anchors 128 --layers 1,2,3 --dtypes fp32,bf16 --steps 40]

Writes ``benchmarks/results/bench_sft.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specforge_opd.config import load_config
from specforge_opd.models.draft_config import draft_config_dict, make_draft_config, resolve_mask_token_id
from specforge_opd.models.target import target_dir
from specforge_opd.precision import machine_info, resolve_sft
from specforge_opd.stages.sft_features import feature_path
from specforge_opd.stages.sft_train import specforge_run_config, specforge_train_module

ROOT = Path(__file__).resolve().parent.parent


def write_samples(d: Path, n: int, seq: int, response: int, width: int, vocab: int, dtype: torch.dtype) -> None:
    """``n`` offline DFlash samples in SpecForge's layout (``feature_path``): random ids and features."""
    g = torch.Generator().manual_seed(0)
    files = []
    for i in range(n):
        mask = torch.zeros(seq, dtype=torch.long)
        mask[seq - response:] = 1
        s = {"input_ids": torch.randint(0, vocab - 1, (seq,), generator=g), "loss_mask": mask,
             "hidden_states": torch.randn(1, seq, width, generator=g).to(dtype)}
        p = feature_path(d, i)
        p.parent.mkdir(parents=True, exist_ok=True)
        torch.save(s, p)
        files.append(str(p.relative_to(d)))
    (d / "manifest.json").write_text(json.dumps({"samples": n, "files": files}))


def specforge_step_s(cfg, work: Path, features: Path, n: int, steps: int, log_interval: int,
                     lm_head_recompute: bool = True) -> float:
    """Mean optimizer step time (s) that SpecForge logs after its first log window (``lm_head_recompute``
    False: through ``models.specforge_train``, as the SFT stage runs ``sft.lm_head_recompute=false``)."""
    from transformers import AutoConfig

    tpath = target_dir(cfg)
    tconf = AutoConfig.from_pretrained(tpath)
    mask = resolve_mask_token_id(cfg, tconf)
    dcfg = make_draft_config(cfg, tconf, mask)
    work.mkdir(parents=True, exist_ok=True)
    dfile = work / "draft_config.json"
    dfile.write_text(json.dumps(draft_config_dict(dcfg)))
    run = specforge_run_config(cfg, target_path=tpath, draft_config_file=dfile, features=features,
                                   out_dir=work / "ckpt", num_samples=n, mask_token_id=mask, gpus=0)
    run["training"].update(log_interval=log_interval, save_interval=10 * steps)
    import yaml

    (work / "run.yaml").write_text(yaml.safe_dump(run))
    out = subprocess.run([sys.executable, "-m", specforge_train_module(lm_head_recompute), "train", "-c",
                          str(work / "run.yaml")], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"SpecForge train failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    times = [float(m) for m in re.findall(r"'perf/optimizer_step_time_s': ([0-9.eE+-]+)", out.stdout + out.stderr)]
    if len(times) < 2:
        raise RuntimeError("SpecForge logged fewer than two step-time windows; raise --steps:\n" + out.stdout[-1500:] + out.stderr[-1500:])
    return sum(times[1:]) / len(times[1:])


def lm_head_ceiling_s(weight: torch.Tensor, positions: int, dtype: torch.dtype, reps: int = 5) -> float:
    """Seconds for logits + fp32 cross-entropy + backward into the hidden states over ``positions`` rows."""
    w = weight.to(dtype)
    h = torch.randn(positions, w.shape[1], dtype=dtype, requires_grad=True)
    labels = torch.randint(0, w.shape[0], (positions,))

    def step():
        loss = torch.nn.functional.cross_entropy((h @ w.t()).float(), labels)
        loss.backward()
        h.grad = None

    step()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/tiny/sft.yaml"))
    ap.add_argument("--anchors", default="128")
    ap.add_argument("--layers", default="1,2,3", help="drafter depths (draft.num_hidden_layers)")
    ap.add_argument("--objectives", default="specforge,stored",
                    help="specforge: SpecForge's objective; stored: sft.lm_head_recompute=false")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--seq", type=int, default=352, help="tokens per sample (prompt + response)")
    ap.add_argument("--response", type=int, default=128, help="supervised tokens per sample")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_sft.json"))
    args = ap.parse_args()
    base = load_config(args.config, [])
    from specforge_opd.models.target import apply_threads

    apply_threads(base.target.threads)
    from safetensors import safe_open

    tpath = Path(target_dir(base))
    with safe_open(str(tpath / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.embed_tokens.weight")  # tied: the lm_head
    vocab, hidden = weight.shape
    width = len(base.draft.target_layer_ids) * hidden
    rows = []
    for dt in args.dtypes.split(","):
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_samples(work / "features", args.samples, args.seq, args.response, width, vocab, torch_dtype)
            for a in (int(x) for x in args.anchors.split(",")):
                positions = min(a, args.response - 1) * base.draft.block_size
                ceil = lm_head_ceiling_s(weight, positions, torch_dtype)
                for layers in (int(x) for x in args.layers.split(",")):
                    base_s = None
                    for objective in args.objectives.split(","):
                        if objective not in ("specforge", "stored"):
                            raise SystemExit(f"--objectives: {objective!r} is not specforge or stored")
                        cfg = load_config(args.config, [f"training.mixed_precision={dt}", f"training.num_anchors={a}",
                                                        f"draft.num_hidden_layers={layers}",
                                                        f"sft.lm_head_recompute={objective == 'specforge'}",
                                                        f"sft.max_steps={args.steps}", "training.lr_scheduler=constant",
                                                        "training.warmup_ratio=0"])
                        step = specforge_step_s(cfg, work / f"a{a}-l{layers}-{objective}", work / "features",
                                                args.samples, args.steps, args.log_interval,
                                                lm_head_recompute=objective == "specforge")
                        row = {"dtype": dt, "precision": resolve_sft(dt, base.target.dtype, "cpu").record(),
                               "num_anchors": a, "layers": layers, "objective": objective,
                               "positions_per_step": positions, "positions_per_s": positions / step,
                               "lm_head_ceiling_positions_per_s": positions / ceil, "fraction_of_ceiling": ceil / step}
                        if objective == "specforge":
                            base_s = step
                        elif base_s is not None:
                            row["speedup_vs_specforge"] = base_s / step
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    result = {"machine": machine_info(), "threads": torch.get_num_threads(), "steps": args.steps, "seq": args.seq, "response": args.response,
              "vocab": vocab, "hidden": hidden, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
