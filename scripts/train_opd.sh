#!/usr/bin/env bash
# Draft-OPD post-training: scripts/train_opd.sh CONFIG [section.field=value ...] [--dry-run]
# One node, several processes: NPROC=8 scripts/train_opd.sh ... runs under torchrun (FSDP2).
# Several nodes: run the same command on every node with torchrun's rendezvous settings,
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0's address> [MASTER_PORT=29500] NPROC=8 scripts/train_opd.sh ...
# (output.dir and opd.spool_dir must be on a filesystem every node sees; docs/multinode.md).
# --dry-run prints the plan for NNODES x NPROC ranks in one process, without torchrun.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -x "$ROOT/.venv/bin/specforge-opd" ] || bash "$ROOT/scripts/setup_env.sh"
CONFIG="${1:?usage: scripts/train_opd.sh CONFIG [section.field=value ...]}"; shift
NPROC="${NPROC:-1}"
NNODES="${NNODES:-1}"
for v in NPROC NNODES; do
  if ! [[ "${!v}" =~ ^[1-9][0-9]*$ ]]; then
    echo "train_opd.sh: $v=${!v} must be a positive integer" >&2; exit 2
  fi
done
DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done
if [ "$DRY" = 1 ]; then
  # the plan is arithmetic: one process, told how many ranks it plans for
  NNODES="$NNODES" NPROC="$NPROC" exec "$ROOT/.venv/bin/specforge-opd" opd -c "$CONFIG" "$@"
fi
if [ "$NNODES" -gt 1 ]; then
  if [ -z "${MASTER_ADDR:-}" ]; then
    echo "train_opd.sh: NNODES=$NNODES needs MASTER_ADDR (the address of the node with NODE_RANK=0)" >&2; exit 2
  fi
  if ! [[ "${NODE_RANK:-}" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "train_opd.sh: NNODES=$NNODES needs NODE_RANK set to this node's rank, 0..$((NNODES - 1)) (got '${NODE_RANK:-}')" >&2; exit 2
  fi
  exec "$ROOT/.venv/bin/python" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" --nproc_per_node "$NPROC" \
    -m specforge_opd.cli opd -c "$CONFIG" "$@"
fi
if [ "$NPROC" -gt 1 ]; then
  exec "$ROOT/.venv/bin/python" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    -m specforge_opd.cli opd -c "$CONFIG" "$@"
fi
exec "$ROOT/.venv/bin/specforge-opd" opd -c "$CONFIG" "$@"
