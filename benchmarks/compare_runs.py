"""Are two run directories the same output? For refactors that must not change behaviour.

    .venv/bin/python benchmarks/compare_runs.py RUN_A RUN_B   (e.g. two checkouts' runs/tiny)

Compares every file both hold: safetensors tensors exactly, ``.ckpt`` feature files (read with
``weights_only=True``) exactly, JSON / JSONL records after dropping timings, paths and other
run-specific keys, Markdown reports after dropping seconds and paths. Prints the files that
differ; PNGs, ``.pt``/``.distcp`` checkpoints and YAML are listed as skipped.
"""
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

A, B = Path(sys.argv[1]), Path(sys.argv[2])
fa = sorted(str(p.relative_to(A)) for p in A.rglob("*") if p.is_file())
fb = sorted(str(p.relative_to(B)) for p in B.rglob("*") if p.is_file())
print("same file names:", fa == fb, len(fa))
if fa != fb:
    print(sorted(set(fa) ^ set(fb))[:20])
VOLATILE = re.compile(r"(time|seconds|_s$|^t_|elapsed|finished_at|commit|path|dir|target$|export|checkpoint|tok_per_s|tokens_per_s|per_s|wall|disk|bytes|stage_seconds|report|cache|source|speed)", re.I)
def strip(o):
    if isinstance(o, dict):
        return {k: strip(v) for k, v in o.items() if not VOLATILE.search(k)}
    if isinstance(o, list):
        return [strip(v) for v in o]
    if isinstance(o, str) and ("/work/" in o):
        return "<path>"
    return o
diff = []
counts = {}
for f in sorted(set(fa) & set(fb)):
    pa, pb = A / f, B / f
    ext = pa.suffix
    counts[ext] = counts.get(ext, 0) + 1
    try:
        if ext == ".safetensors":
            ta, tb = load_file(str(pa)), load_file(str(pb))
            if sorted(ta) != sorted(tb) or any(not torch.equal(ta[k], tb[k]) for k in ta):
                diff.append(f)
        elif ext in (".ckpt",):
            ta, tb = torch.load(pa, weights_only=True), torch.load(pb, weights_only=True)
            def eq(x, y):
                if torch.is_tensor(x): return torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
                if isinstance(x, dict): return isinstance(y, dict) and sorted(x) == sorted(y) and all(eq(x[k], y[k]) for k in x)
                if isinstance(x, (list, tuple)): return len(x) == len(y) and all(eq(a, b) for a, b in zip(x, y))
                return x == y
            if not eq(ta, tb): diff.append(f)
        elif ext in (".json",):
            if strip(json.loads(pa.read_text())) != strip(json.loads(pb.read_text())): diff.append(f)
        elif ext == ".jsonl":
            la = [strip(json.loads(l)) for l in pa.read_text().splitlines() if l.strip()]
            lb = [strip(json.loads(l)) for l in pb.read_text().splitlines() if l.strip()]
            if la != lb: diff.append(f)
        elif ext in (".md",):
            if re.sub(r"/work/[\w-]+", "", re.sub(r"\d+(\.\d+)? ?s\b|commit `\w+`", "", pa.read_text())) != re.sub(r"/work/[\w-]+", "", re.sub(r"\d+(\.\d+)? ?s\b|commit `\w+`", "", pb.read_text())): diff.append(f)
        else:
            counts[ext + "(skipped)"] = counts.get(ext + "(skipped)", 0) + 1
    except Exception as e:
        diff.append(f"{f}: {e!r}"[:200])
print(counts)
print("differ:", len(diff))
for d in diff[:40]: print("  ", d)
