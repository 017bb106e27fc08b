#!/usr/bin/env bash
# DFlash SFT stage on SpecForge: scripts/train_sft.sh CONFIG [section.field=value ...] [--dry-run] [--out DIR]
# Steps: responses -> features -> specforge train -> export (<output.dir>/final); each is
# skipped when its output exists for the same inputs, and a killed run resumes.
# GPUs: SpecForge trains on every GPU of this node. Several nodes: run the same command on every
# node with torchrun's rendezvous settings,
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0's address> [MASTER_PORT=29500] scripts/train_sft.sh ...
# node 0 runs every step and the others join its SpecForge training (output.dir on a filesystem
# every node sees; docs/multinode.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x "$ROOT/.venv/bin/specforge-opd" ]; then
  make -s setup >/dev/null
fi
CONFIG="${1:?usage: scripts/train_sft.sh CONFIG [section.field=value ...] [--dry-run]}"; shift
exec "$ROOT/.venv/bin/specforge-opd" sft -c "$CONFIG" "$@"
