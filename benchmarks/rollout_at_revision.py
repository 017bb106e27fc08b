"""Time the embedded OPD rollout with the package as it was at another git revision.

``bench_throughput.py`` runs this in a subprocess whose ``PYTHONPATH`` starts with an
extracted copy of that revision (``git archive``), so "before" is the code that ran when
the throughput issue was measured, not today's engine driven the old way. It uses only
calls that are the same at 0afb736 (the default revision) and today: ``load_config`` and the
config's ``target.max_context``/``too_long``/``prefill_chunk`` and ``rollout`` section,
``load_target``, ``load_drafter``, ``drafter_mask_token_id``, the ``SpeculativeEngine``
constructor's keywords and ``generate``, ``length_batches``, ``tau_of`` and the
``RolloutRecord`` fields ``sample_id``, ``input_ids``, ``anchors``, ``drafts``, ``accepted``.

Input (``--prompts``): JSON ``{"ids": [str], "prompts": [[int]]}``, the prompts already
rendered and tokenized by the caller, so both sides roll out the same token ids.
Output (``--out``): JSON with ``modules`` (the file of every imported ``specforge_opd``
module, to check that all of them are the revision's copy), ``seconds`` (the batches' generate calls, after a warm-up of two
prompts), ``completion_tokens``, ``tau`` and ``records`` (per prompt: ``sample_id`` and the
lists ``input_ids``, ``anchors``, ``drafts``, ``accepted``, for an equality check).

    PYTHONPATH=/tmp/rev .venv/bin/python benchmarks/rollout_at_revision.py --config /tmp/rev/configs/tiny/opd.yaml \\
        --drafter published:smollm2-135m-instruct-dflash-b8 --batch 8 --prompts p.json --out o.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


#: The record fields compared across revisions (tokens, block starts, drafts, acceptances).
RECORD_FIELDS = ("input_ids", "anchors", "drafts", "accepted")


def record_lists(records) -> list[dict]:
    """``RolloutRecord``s as JSON-ready dicts: ``sample_id`` and each of ``RECORD_FIELDS`` as a nested list.

    The one form both sides of the revision comparison use: this script writes it, and
    ``bench_throughput.py`` compares today's records in it with ``==``.
    """
    return [{"sample_id": r.sample_id, **{k: getattr(r, k).tolist() for k in RECORD_FIELDS}} for r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the revision's OPD config (its rollout settings)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--batch", type=int, default=8, help="prompts per length-bucketed batch")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import drafter_mask_token_id, load_drafter
    from specforge_opd.models.target import load_target
    from specforge_opd.rollout.engine import SpeculativeEngine, length_batches
    from specforge_opd.rollout.records import tau_of

    given = json.loads(Path(args.prompts).read_text())
    ids, prompts = [str(s) for s in given["ids"]], [[int(t) for t in p] for p in given["prompts"]]
    cfg = load_config(args.config, [])
    bundle = load_target(cfg.target)
    drafter = load_drafter(args.drafter, target_config=bundle.model.config).eval()
    engine = SpeculativeEngine(bundle.model, drafter, cfg.rollout, stop_token_ids=bundle.stop_token_ids,
                               mask_token_id=drafter_mask_token_id(drafter), max_context=cfg.target.max_context,
                               too_long=cfg.target.too_long, prefill_chunk=cfg.target.prefill_chunk)
    engine.generate(prompts[:2], ids[:2])  # warm-up
    by_id = {}
    t = time.perf_counter()
    for idx in length_batches([len(p) for p in prompts], args.batch):
        for r in engine.generate([prompts[i] for i in idx], [ids[i] for i in idx]):
            by_id[r.sample_id] = r
    seconds = time.perf_counter() - t
    records = [by_id[s] for s in ids]
    out = {
        "modules": {name: str(Path(m.__file__).resolve()) for name, m in sys.modules.items()
                    if (name == "specforge_opd" or name.startswith("specforge_opd.")) and getattr(m, "__file__", None)},
        "batch": args.batch,
        "seconds": seconds,
        "completion_tokens": sum(r.completion_tokens for r in records),
        "tau": tau_of(records),
        "records": record_lists(records),
    }
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
