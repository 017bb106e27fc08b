#!/usr/bin/env bash
# The main job on the embedded default (what `make demo` runs after set-up):
# a short SFT that shows the pipeline -> OPD from the published plateau drafter
# (published:smollm2-135m-instruct-dflash-b8-mixv2-l3-long, trained by configs/small/sft_mix_v2_l3*.yaml, three stages) ->
# the matched-FLOPs SFT baseline -> evaluation table on held-out sets.
#   scripts/demo.sh [--own-sft] [section.field=value ...]
# --own-sft: OPD (and the table's SFT row) start from this run's short SFT instead.
# Every stage resumes: rerunning after a kill continues where it stopped.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=.venv/bin/python
START=()
if [ "${1:-}" = "--own-sft" ]; then
  shift
  # the short SFT's 1-layer drafter, at the OPD rate measured for it (configs/tiny/opd.yaml)
  START=("draft.path=runs/tiny/sft/final" "draft.num_hidden_layers=1" "training.learning_rate=1.5e-3")
fi
stage() { printf '\n=== %s (%s) ===\n' "$1" "$(date +%H:%M:%S)"; }
t0=$(date +%s)
stage "assets"
.venv/bin/specforge-opd prepare-assets
t1=$(date +%s)
stage "SFT: scripts/train_sft.sh configs/tiny/sft.yaml"
bash scripts/train_sft.sh configs/tiny/sft.yaml "$@"
t2=$(date +%s)
stage "OPD: scripts/train_opd.sh configs/tiny/opd.yaml ${START[*]}"
bash scripts/train_opd.sh configs/tiny/opd.yaml "$@" "${START[@]}"
t3=$(date +%s)
stage "matched-FLOPs SFT baseline + evaluation"
# stage times of a resumed run count only this run's work
$PY -m specforge_opd.stages.compare --sft-config configs/tiny/sft.yaml --opd-config configs/tiny/opd.yaml \
  --baseline-lr opd --summary runs/tiny/summary.json --stage-seconds assets=$((t1 - t0)) sft=$((t2 - t1)) opd=$((t3 - t2)) -- "$@" "${START[@]}"
echo
echo "demo finished in $(( $(date +%s) - t0 ))s; OPD report: runs/tiny/opd/report.md; summary: runs/tiny/summary.json"
