#!/usr/bin/env bash
# GPU check of SGLang verify mode (NOT YET RUN ON A GPU).
# Starts a real SGLang 0.5.23 server for the target with aux hidden states (--speculative-algorithm DFLASH
# names the capture convention; no draft is loaded), runs a few verify-mode rollouts through it and the
# same rollouts in-process (rollout.SpeculativeEngine), and compares tokens, anchors, accepted counts,
# features (atol 2e-2 in bf16) and teacher log-probs.
# It also confirms the two facts a CPU cannot: the layer ids go to --return-aux-hidden-state-layer-ids
# unchanged (SGLang's models add the +1; contract.server_layer_ids), and the layout of meta_info.hidden_states.
# Usage: SGLANG_PYTHON=/path/to/sglang/python TARGET=Qwen/Qwen3-4B DRAFTER=runs/x/final \
#        bash scripts/gpu_check_sglang_verify.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TARGET:?set TARGET to an HF model dir}" "${DRAFTER:?set DRAFTER to a DFlash drafter dir}"
SGLANG_PYTHON="${SGLANG_PYTHON:-python}"
exec .venv/bin/python - <<PY
import asyncio, torch
from transformers import AutoModelForCausalLM
from specforge_opd.config import SGLangConfig, RolloutConfig
from specforge_opd.models.drafter import load_drafter
from specforge_opd.rollout.engine import SpeculativeEngine
from specforge_opd.sglang.launcher import SGLangServer, Endpoints, server_args
from specforge_opd.sglang.speculate import Drafter
from specforge_opd.sglang.verify_client import verify_rollout_async
target = AutoModelForCausalLM.from_pretrained("$TARGET", torch_dtype=torch.bfloat16).cuda().eval()
dm = load_drafter("$DRAFTER", target_config=target.config).cuda().to(torch.bfloat16)
layers = dm.config.dflash_config["target_layer_ids"]; mask = dm.config.dflash_config["mask_token_id"]
prompts = [("g%d" % i, list(range(100 + 7 * i, 140 + 7 * i))) for i in range(4)]
cfg = SGLangConfig(python="$SGLANG_PYTHON", max_total_tokens=65536, startup_timeout_s=1200, mem_fraction_static=0.6)
args = lambda port: server_args(cfg, model_path="$TARGET", port=port, mode="verify", target_layer_ids=layers, dtype="bfloat16",
                                num_target_layers=target.config.num_hidden_layers)
with SGLangServer(cfg, args, log_path="gpu_check_sglang_verify.log") as srv:
    print("SGLang version", srv.version)
    ep = Endpoints.launched([srv])
    drafter = Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings())
    recs = asyncio.run(verify_rollout_async(ep, drafter, prompts, sglang_cfg=cfg, max_new_tokens=64, stop_token_ids=[],
                                            teacher="topk", teacher_topk=8, feature_dim=len(layers) * target.config.hidden_size,
                                            layer_ids=layers))
eng = SpeculativeEngine(target, dm, RolloutConfig(max_new_tokens=64, teacher="topk", teacher_topk=8), stop_token_ids=[], mask_token_id=mask)
ref = eng.generate([p for _, p in prompts], sample_ids=[s for s, _ in prompts])
ok = True
for h, e in zip(recs, ref):
    same = torch.equal(h.input_ids, e.input_ids.cpu()) and torch.equal(h.accepted, e.accepted.cpu())
    fdiff = (h.features - e.features.float().cpu()).abs().max().item()
    print(h.sample_id, "tokens/accepted equal:", same, "max feature diff:", fdiff, "tau:", h.completion_tokens / max(1, h.num_blocks))
    ok &= same and fdiff < 2e-2
print("VERIFY MODE CHECK", "PASSED" if ok else "FAILED (see DESIGN.md numerical ties before concluding)")
PY
