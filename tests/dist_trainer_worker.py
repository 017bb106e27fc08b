"""Worker for tests/test_trainer_dist.py: run under torchrun (gloo) or as a plain process.

Usage: python dist_trainer_worker.py OUT_DIR BATCH_SIZE ACCUMULATION [BATCH_SIZE ACCUMULATION ...]
Saves the full gradients of every step of every configuration to OUT_DIR/grads-<bs>x<acc>.safetensors (rank 0).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from specforge_opd.config import load_config  # noqa: E402
from specforge_opd.models.drafter import drafter_layer_ids  # noqa: E402
from specforge_opd.train.trainer import distill  # noqa: E402

from conftest import make_tiny_drafter, make_tiny_target  # noqa: E402
from fault_hooks import FaultHooks  # noqa: E402
from opd_helpers import make_records  # noqa: E402

NUM_RECORDS = 5  # with a global batch of 4 the second step is short: rank padding is exercised


def main() -> None:
    out = Path(sys.argv[1])
    pairs = [(int(a), int(b)) for a, b in zip(sys.argv[2::2], sys.argv[3::2])]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    target = make_tiny_target()
    drafter = make_tiny_drafter(target, block_size=4, layers=2)
    records = make_records(target, drafter_layer_ids(drafter), NUM_RECORDS, block_size=4, response_len=10, form="topk", topk=8)
    for bs, acc in pairs:
        grads = {}

        def grab(step, model):
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[f"step{step}.{name}"] = g.detach().clone().contiguous()

        # MAX_BLOCKS: replay in groups of that many blocks (ranks then differ in group counts)
        groups = os.environ.get("MAX_BLOCKS")
        tag = f"{world}-{bs}x{acc}" + (f"-g{groups}" if groups else "")
        run = out / f"run-{tag}"
        cfg = load_config(None, [f"training.batch_size={bs}", f"training.accumulation_steps={acc}", "training.shuffle=false",
                                 "training.chunk_slots=7", "output.tensorboard=false", f"output.dir={run}"]
                          + ([f"training.max_blocks_per_forward={groups}"] if groups else []))
        distill(cfg, drafter_init=drafter, out_dir=run, target=target, records=records, progress=False,
                hooks=FaultHooks(gradients=grab))
        if rank == 0:
            from safetensors.torch import save_file

            save_file(grads, str(out / f"grads-{tag}.safetensors"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
