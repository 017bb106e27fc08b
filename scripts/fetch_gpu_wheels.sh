#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine that has no network.
#
#   scripts/fetch_gpu_wheels.sh [DEST]     # default DEST: gpu_wheels/ (committed; about 5.5 MB)
#
# pydantic and its compiled core for CPython 3.12 (the GPU machine) and 3.11 (this project's
# CPU venv, for scripts/gpu_check.sh --cpu), their two small pure-Python dependencies, and
# SpecForge with no dependencies (its own pins would pull another torch and SGLang). Versions
# are those of requirements.lock. torch, transformers, triton, safetensors, pyyaml, tqdm and
# huggingface-hub are on the GPU machine already (transformers needs all but triton).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$HERE/gpu_wheels}"
PIP="${PIP:-$HERE/.venv/bin/pip}"
mkdir -p "$DEST"
PURE=(pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 specforge==0.2.0)
for py in 3.12 3.11; do
  "$PIP" download --dest "$DEST" --python-version "$py" --implementation cp --only-binary=:all: --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 pydantic_core==2.50.5
done
"$PIP" download --dest "$DEST" --python-version 3.12 --only-binary=:all: --no-deps "${PURE[@]}"
ls -l "$DEST"
du -sh "$DEST"
