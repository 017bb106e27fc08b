#!/usr/bin/env bash
# GPU check of SGLang native mode and its plugin (NOT YET RUN ON A GPU).
# Needs SGLang 0.5.23 in its own environment and this package installed there WITHOUT dependencies
# (SGLang pins transformers/torch versions our setup.py does not allow; the plugin needs only torch,
# pydantic and yaml, which SGLang has):
#   $SGLANG_PYTHON -m pip install --no-deps -e .
# That registers the entry point  sglang.srt.plugins: specforge_opd_native = specforge_opd.sglang.native:register
# Starts SGLang with DFLASH and the plugin, rolls out a few prompts natively (long enough to cross
# SGLANG_FORCE_STREAM_INTERVAL, which this check leaves at SGLang's default 50 so that the plugin's
# request-level marking, not the launcher's out-of-reach interval, is what keeps every step; and one
# with max_new_tokens 1: zero verify steps), and checks:
#   - the log has no "Failed to apply hooks" line of ours (the launcher refuses to start otherwise);
#     the "Applied N hook(s)" INFO lines are printed when present (SGLang may configure logging only
#     after plugins load, so their absence alone proves nothing);
#   - every response carries one plugin entry per verify step (spec_verify_ct), at the top level of meta_info;
#   - the per-step records reproduce SGLang's own output and spec_accept_length;
#   - every record against an in-process rollout of the same drafter with the SAME stop set (the target's:
#     tokenizer, config.json and generation_config.json eos ids, which SGLang stops on whatever the request
#     says): completion length, finished, block count, anchors and accepted counts (bf16 ties may flip a few).
# Usage: SGLANG_PYTHON=... TARGET=... DRAFTER=... BLOCK_SIZE=16 bash scripts/gpu_check_sglang_native.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TARGET:?}" "${DRAFTER:?}" "${BLOCK_SIZE:?}"
SGLANG_PYTHON="${SGLANG_PYTHON:-python}"
exec .venv/bin/python - <<PY
import asyncio, re, torch
from transformers import AutoModelForCausalLM
from specforge_opd.config import SGLangConfig
from specforge_opd.models.drafter import load_drafter
from specforge_opd.models.target import stop_token_ids
from specforge_opd.sglang.parity import record_parity
from transformers import AutoTokenizer, GenerationConfig, AutoConfig
from specforge_opd.rollout.records import tau_of
from specforge_opd.sglang.launcher import SGLangServer, Endpoints, mode_env, server_args
from specforge_opd.sglang.native import HOOK_TARGETS, native_rollout_async
from specforge_opd.sglang.speculate import Drafter, LocalTarget, speculate_sequence
prompts = [("n%d" % i, list(range(100 + 7 * i, 140 + 7 * i))) for i in range(4)]
cfg = SGLangConfig(python="$SGLANG_PYTHON", max_total_tokens=65536, startup_timeout_s=1200)
try:
    gen_cfg = GenerationConfig.from_pretrained("$TARGET")
except OSError:
    gen_cfg = None
stops = stop_token_ids(AutoTokenizer.from_pretrained("$TARGET"), AutoConfig.from_pretrained("$TARGET"), [], gen_cfg)
print("stop set (both sides):", stops)
args = lambda port: server_args(cfg, model_path="$TARGET", port=port, mode="native", draft_path="$DRAFTER", block_size=$BLOCK_SIZE, dtype="bfloat16")
log = "gpu_check_sglang_native.log"
env = {**mode_env("native"), "SGLANG_PLUGINS": "specforge_opd_native", "SGLANG_FORCE_STREAM_INTERVAL": "50"}
with SGLangServer(cfg, args, log_path=log, env=env, require_plugin=True) as srv:
    print("SGLang version", srv.version, "pool tokens", srv.pool_tokens)
    text = open(log).read()
    for t in HOOK_TARGETS.values():
        print("hook:", t, "'Applied' line in the log:", bool(re.search(r"Applied \\d+ hook\\(s\\) to " + re.escape(t), text)))
    ep = Endpoints.launched([srv])
    recs = asyncio.run(native_rollout_async(ep, prompts, sglang_cfg=cfg, block_size=$BLOCK_SIZE,
                                            max_new_tokens=200, stop_token_ids=stops, teacher="token"))
    zero = asyncio.run(native_rollout_async(ep, prompts[:1], sglang_cfg=cfg, block_size=$BLOCK_SIZE,
                                            max_new_tokens=1, stop_token_ids=stops, teacher="token"))
print("zero-step request: blocks", zero[0].num_blocks, "(expect 0)")
print("served tau (from plugin records):", tau_of(recs))
target = AutoModelForCausalLM.from_pretrained("$TARGET", torch_dtype=torch.bfloat16).cuda().eval()
dm = load_drafter("$DRAFTER", target_config=target.config).cuda().to(torch.bfloat16)
drafter = Drafter(dm, target.get_input_embeddings(), target.get_output_embeddings())
local = LocalTarget(target, dm.target_layer_ids, top_k=1)
ok = zero[0].num_blocks == 0
for rec, (sid, ids) in zip(recs, prompts):
    ref = asyncio.run(speculate_sequence(local, drafter, ids, sample_id=sid, max_new_tokens=200, stop_token_ids=stops, teacher="token", store_features=True))
    diffs = record_parity(rec, ref)
    n = min(rec.num_blocks, ref.num_blocks)
    lp = (rec.teacher_draft_logprob[:n] - ref.teacher_draft_logprob[:n]).abs().max().item() if n else 0.0
    print(sid, "differences:", diffs or "none", "max teacher log-prob diff:", lp,
          "native tau", rec.completion_tokens / max(1, rec.num_blocks), "ours", ref.completion_tokens / max(1, ref.num_blocks))
    ok &= not diffs
print("NATIVE MODE CHECK", "PASSED" if ok else "FAILED (bf16 ties can flip a few steps; compare tau)")
PY
