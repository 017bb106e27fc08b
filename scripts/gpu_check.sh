#!/usr/bin/env bash
# The first thing to run on a GPU machine (one H200: at most about 8 minutes in all).
#
#   scripts/gpu_check.sh [--cpu]        # results: $OUT/gpu_check.json (OUT defaults to ./gpu_check_out)
#
# On a lent GPU machine: run it as the whole command (it reads $OUT), with a timeout of about
# 480 s; the section logs and files come back under $OUT even when a section times out.
#
# The GPU machine gets the working tree only: Python 3.12, torch, transformers and triton,
# no pydantic, no SpecForge, no network. The wheels in gpu_wheels/ (scripts/fetch_gpu_wheels.sh
# fills it; pydantic + pydantic-core for cp312 and cp311, SpecForge with no dependencies) are
# unpacked into a temporary site directory that goes first on PYTHONPATH; nothing is installed
# into the machine's Python. The check builds random models: where the copy of the tree is size-
# limited, the published drafters' model.safetensors (46 MB of the tree's 75) can stay behind.
#
# Sections, each in its own process under its own timeout (benchmarks/gpu_check.py):
# env, equality (tiny model, CPU against GPU), trainer (Qwen3-8B drafter shapes), rollout.
# The merged JSON is rewritten after every section, so a timeout keeps what ran.
#
# --cpu: the dry form, the same wheel install and the same sections at tiny shapes on the CPU
# (tests/test_gpu_check.py runs it), so that a first GPU run fails only on GPU facts.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CPU=0
for a in "$@"; do
  case "$a" in
    --cpu) CPU=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $a (use --cpu or nothing)" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ "$CPU" = 1 ] && [ -x "$HERE/.venv/bin/python" ]; then PYTHON="$HERE/.venv/bin/python"; else PYTHON=python3; fi
fi
OUT="${OUT:-$HERE/gpu_check_out}"
WHEELS="${GPU_CHECK_WHEELS:-$HERE/gpu_wheels}"
mkdir -p "$OUT"
# Section files live under $OUT (rewritten during a section, so even a killed run leaves them);
# the site directory is temporary.
PARTS="$OUT/parts"
rm -rf "$PARTS" && mkdir -p "$PARTS"
TMP_SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
SITE="$TMP_SITE/site"
trap 'rm -rf "$TMP_SITE"' EXIT
START=$(date +%s)
META="{\"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"command\": \"scripts/gpu_check.sh $*\", \"cpu\": $([ $CPU = 1 ] && echo true || echo false), \"commit\": \"$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)\"}"

# Per-section timeouts (seconds): 460 in all with the install. The first H200 run (2026-12-04) timed
# out at 20/60/140 s: the env section's cold imports took over 20 s, and the flex_attention
# compiles of the equality and trainer sections (first call per shape) over 30 s and 110 s.
if [ "$CPU" = 1 ]; then
  T_INSTALL=60; T_ENV=60; T_EQUALITY=120; T_TRAINER=180; T_ROLLOUT=120
else
  T_INSTALL=10; T_ENV=60; T_EQUALITY=100; T_TRAINER=200; T_ROLLOUT=90
fi

merge() {
  "$PYTHON" "$HERE/benchmarks/gpu_check.py" merge --parts "$PARTS" --out "$OUT/gpu_check.json" --meta "$META" \
    || echo "gpu_check.sh: merge failed" >&2
}

# 1. carried wheels -> temporary site directory (a wheel is a zip: unpacking it is installing it)
t0=$(date +%s)
timeout "$T_INSTALL" "$PYTHON" - "$WHEELS" "$SITE" <<'EOF'
import sys, zipfile, glob, os
wheels, site = sys.argv[1], sys.argv[2]
tag = "cp%d%d" % sys.version_info[:2]
os.makedirs(site, exist_ok=True)
picked = []
for w in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    name = os.path.basename(w)
    parts = name[:-4].split("-")
    py = parts[-3]
    if py.startswith("cp") and py != tag:
        continue  # a compiled wheel for another interpreter
    with zipfile.ZipFile(w) as z:
        z.extractall(site)
    picked.append(name)
need = {"pydantic", "pydantic_core", "specforge", "annotated_types", "typing_inspection"}
have = {p.split("-")[0].lower() for p in picked}
missing = need - have
if missing:
    sys.exit(f"gpu_check: no wheel for {sorted(missing)} ({tag}) in {wheels}: run scripts/fetch_gpu_wheels.sh where there is network")
print("installed", " ".join(picked))
EOF
rc=$?
printf 'install\t%s\t%s\n' "$rc" "$(( $(date +%s) - t0 ))" >> "$PARTS/status.tsv"
echo "{\"section\": \"install\", \"site\": \"$SITE\", \"wheels\": \"$WHEELS\"}" > "$PARTS/section_install.json"
merge
if [ "$rc" != 0 ]; then echo "gpu_check.sh: wheel install failed (rc $rc)" >&2; exit 1; fi

export PYTHONPATH="$SITE:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_SITE="$SITE" PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
FLAGS=()
[ "$CPU" = 1 ] && FLAGS+=(--cpu)

run_section() {  # name timeout
  local name="$1" limit="$2" t0 rc
  t0=$(date +%s)
  echo "== $name (timeout ${limit}s)" >&2
  timeout -k 5 "$limit" "$PYTHON" "$HERE/benchmarks/gpu_check.py" "$name" --out "$PARTS/section_$name.json" "${FLAGS[@]}" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$PARTS/status.tsv"
  merge
  tail -n 3 "$OUT/$name.log" >&2
  return 0
}

run_section env "$T_ENV"
run_section equality "$T_EQUALITY"
run_section trainer "$T_TRAINER"
run_section rollout "$T_ROLLOUT"
echo "gpu_check.sh: $(( $(date +%s) - START )) s; $OUT/gpu_check.json" >&2
"$PYTHON" - "$OUT/gpu_check.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
bad = [k for k, v in d["sections"].items() if v.get("status") != "ok"]
print("sections:", {k: v.get("status") for k, v in d["sections"].items()})
sys.exit(1 if bad else 0)
EOF
