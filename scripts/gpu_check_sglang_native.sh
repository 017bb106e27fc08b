#!/usr/bin/env bash
# GPU check of SGLang native mode and its plugin (NOT YET RUN ON A GPU).
# Needs specforge-opd installed in SGLang's environment with the entry point
#   [project.entry-points."sglang.srt.plugins"] specforge_opd_native = "specforge_opd.sglang.native:register"
# Starts SGLang with DFLASH and the plugin, rolls out a few prompts natively, and checks that the
# per-step records reproduce SGLang's own output and spec_accept_length, then compares them with
# verify-mode / in-process rollouts of the same drafter (anchors, drafts, accepted counts).
# Usage: SGLANG_PYTHON=... TARGET=... DRAFTER=... BLOCK_SIZE=16 bash scripts/gpu_check_sglang_native.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TARGET:?}" "${DRAFTER:?}" "${BLOCK_SIZE:?}"
SGLANG_PYTHON="${SGLANG_PYTHON:-python}"
exec .venv/bin/python - <<PY
import asyncio, torch
from transformers import AutoModelForCausalLM
from specforge_opd.config import SGLangConfig
from specforge_opd.drafter import load_drafter
from specforge_opd.records import tau_of
from specforge_opd.sglang.launcher import SGLangServer, Endpoints, server_args
from specforge_opd.sglang.native import native_rollout_async
from specforge_opd.sglang.speculate import Drafter, LocalTarget, speculate_sequence
prompts = [("n%d" % i, list(range(100 + 7 * i, 140 + 7 * i))) for i in range(4)]
cfg = SGLangConfig(python="$SGLANG_PYTHON", max_total_tokens=65536, startup_timeout_s=1200)
args = lambda port: server_args(cfg, model_path="$TARGET", port=port, mode="native", draft_path="$DRAFTER", block_size=$BLOCK_SIZE, dtype="bfloat16")
with SGLangServer(cfg, args, log_path="gpu_check_sglang_native.log", env={"SGLANG_PLUGINS": "specforge_opd_native"}) as srv:
    print("SGLang version", srv.version)
    recs = asyncio.run(native_rollout_async(Endpoints.launched([srv]), prompts, sglang_cfg=cfg, block_size=$BLOCK_SIZE,
                                            max_new_tokens=64, stop_token_ids=[], teacher="token"))
print("served tau (from plugin records):", tau_of(recs))
target = AutoModelForCausalLM.from_pretrained("$TARGET", torch_dtype=torch.bfloat16).cuda().eval()
dm = load_drafter("$DRAFTER", target_config=target.config).cuda().to(torch.bfloat16)
drafter = Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings())
local = LocalTarget(target, dm.target_layer_ids, top_k=1)
ok = True
for rec, (sid, ids) in zip(recs, prompts):
    ref = asyncio.run(speculate_sequence(local, drafter, ids, sample_id=sid, max_new_tokens=64, stop_token_ids=[], teacher="token", store_features=True))
    same = torch.equal(rec.anchors, ref.anchors) and torch.equal(rec.accepted, ref.accepted)
    print(sid, "anchors/accepted equal:", same, "native tau", rec.completion_tokens / max(1, rec.num_blocks), "ours", ref.completion_tokens / max(1, ref.num_blocks))
    ok &= same
print("NATIVE MODE CHECK", "PASSED" if ok else "FAILED (bf16 ties can flip a few steps; compare tau)")
PY
