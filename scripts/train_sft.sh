#!/usr/bin/env bash
# DFlash SFT stage on SpecForge: scripts/train_sft.sh CONFIG [section.field=value ...] [--dry-run] [--out DIR]
# Steps: responses -> features -> specforge train -> export (<output.dir>/final); each is
# skipped when its output exists for the same inputs, and a killed run resumes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x "$ROOT/.venv/bin/specforge-opd" ]; then
  make -s setup >/dev/null
fi
CONFIG="${1:?usage: scripts/train_sft.sh CONFIG [section.field=value ...] [--dry-run]}"; shift
exec "$ROOT/.venv/bin/specforge-opd" sft -c "$CONFIG" "$@"
