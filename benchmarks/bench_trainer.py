"""Replayed drafter positions per second: the OPD trainer step vs SpecForge's DFlash SFT objective.

Same drafter, same sequence, same number of blocks, same machine, one run.
SpecForge: ``OnlineDFlashModel`` forward + backward (random anchors, CE to the
ground-truth tokens). OPD: ``trainer.sequence_loss`` (replay of recorded
anchors + chunked lm_head + KL against the recorded teacher) + backward, per
teacher form. A position is one drafter slot (M blocks x block_size).

Dims default to the embedded target (SmolLM2-135M: hidden 576, 9 heads / 3 KV,
MLP 1536, vocab 49152, 30 layers); weights are random (speed only).

    .venv/bin/python benchmarks/bench_trainer.py [--seq 512 --blocks 96 --block-size 16 --reps 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig

from specforge_opd.models.adapter import OnlineDFlashModel
from specforge_opd.models.drafter import build_drafter, derive_draft_config, drafter_layer_ids
from specforge_opd.rollout.records import RolloutRecord
from specforge_opd.train.losses import plan_slots, slot_coefficients
from specforge_opd.train.trainer import sequence_loss


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--chunk-slots", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    tcfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=False)
    dcfg = derive_draft_config(tcfg, num_hidden_layers=args.draft_layers, block_size=args.block_size, mask_token_id=args.vocab - 1)
    drafter = build_drafter(dcfg, "sdpa", seed=1).train()
    embed = torch.nn.Embedding(args.vocab, args.hidden).requires_grad_(False)
    lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False).requires_grad_(False)
    n_feat = len(drafter_layer_ids(drafter)) * args.hidden
    T, M, bs = args.seq, args.blocks, args.block_size
    ids = torch.randint(0, args.vocab - 1, (T,))
    feats = torch.randn(T - 1, n_feat)
    prompt = T - M * 3 - bs
    anchors = torch.arange(M) * 3 + prompt  # tau ~ 3: r_m = 2
    accepted = torch.full((M,), 2)
    drafts = torch.randint(0, args.vocab - 1, (M, bs - 1))

    # SpecForge SFT objective on the same drafter, sequence and number of blocks.
    sf = OnlineDFlashModel(drafter, lm_head, embed, mask_token_id=args.vocab - 1, block_size=bs, attention_backend="sdpa",
                           num_anchors=M, objective_chunk_blocks=max(1, args.chunk_slots // bs))
    loss_mask = torch.zeros(1, T)
    loss_mask[0, prompt:] = 1

    def specforge_step():
        loss, _, _ = sf(ids.view(1, -1), feats[:T].new_zeros(1, T, n_feat) + torch.cat([feats, feats[-1:]]).unsqueeze(0), loss_mask)
        loss.backward()
        drafter.zero_grad(set_to_none=True)

    from specforge_opd.precision import machine_info

    results = {"machine": machine_info(), "dims": {"hidden": args.hidden, "vocab": args.vocab, "draft_layers": args.draft_layers, "seq": T, "blocks": M, "block_size": bs,
                        "threads": torch.get_num_threads()}}
    sf_s = _time(specforge_step, args.reps)
    results["specforge_sft_positions_per_s"] = M * bs / sf_s

    def make_record(form: str) -> RolloutRecord:
        teacher = {}
        if form == "full":
            teacher["teacher_hidden"] = torch.randn(M, bs - 1, args.hidden)
        else:
            teacher["teacher_draft_logprob"] = -torch.rand(M, bs - 1) * 3
            if form == "topk":
                teacher["teacher_topk_ids"] = torch.randint(0, args.vocab, (M, bs - 1, args.topk))
                teacher["teacher_topk_logprobs"] = torch.log_softmax(torch.randn(M, bs - 1, args.topk), -1) - 0.1
        return RolloutRecord(sample_id="b", input_ids=ids, prompt_len=prompt, anchors=anchors, drafts=drafts, accepted=accepted, features=feats,
                             **teacher)

    for form in ("token", "topk", "full"):
        rec = make_record(form)
        plan = plan_slots(rec.accepted, bs)
        coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())

        def opd_step():
            loss, _, _ = sequence_loss(drafter, embed, lm_head.weight, rec, plan, coef, mask_token_id=args.vocab - 1, chunk_slots=args.chunk_slots)
            loss.backward()
            drafter.zero_grad(set_to_none=True)

        s = _time(opd_step, args.reps)
        results[f"opd_{form}_positions_per_s"] = M * bs / s
        results[f"opd_{form}_ratio_vs_specforge"] = (M * bs / s) / results["specforge_sft_positions_per_s"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
