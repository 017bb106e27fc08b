#!/usr/bin/env bash
# Draft-OPD post-training: scripts/train_opd.sh CONFIG [section.field=value ...] [--dry-run]
# Multi-process: NPROC=8 scripts/train_opd.sh ... runs under torchrun (FSDP2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -x "$ROOT/.venv/bin/specforge-opd" ] || bash "$ROOT/scripts/setup_env.sh"
CONFIG="${1:?usage: scripts/train_opd.sh CONFIG [section.field=value ...]}"; shift
if [ "${NPROC:-1}" -gt 1 ]; then
  exec "$ROOT/.venv/bin/python" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    -m specforge_opd.cli opd -c "$CONFIG" "$@"
fi
exec "$ROOT/.venv/bin/specforge-opd" opd -c "$CONFIG" "$@"
