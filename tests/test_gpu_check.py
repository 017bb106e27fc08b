"""scripts/gpu_check.sh --cpu: the GPU check's dry form (the carried wheels unpacked into a temporary
site directory, every section at tiny shapes), so that its first GPU run fails only on GPU facts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_agreed_prefix():
    import gpu_check

    assert gpu_check._agreed_prefix([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6, 7]]) == (0.5 + 1.0) / 2


def test_merge_marks_timeouts_and_keeps_partial_sections(tmp_path):
    import gpu_check

    (tmp_path / "section_trainer.json").write_text(json.dumps({"section": "trainer", "status": "running", "results": {"opd_token": {}}}))
    (tmp_path / "status.tsv").write_text("install\t0\t1\ntrainer\t124\t150\n")
    d = gpu_check.merge(tmp_path, tmp_path / "all.json", {"cpu": True})
    assert d["sections"]["trainer"]["status"] == "timeout" and "opd_token" in d["sections"]["trainer"]["results"]
    assert d["sections"]["install"]["status"] == "ok"
    assert json.loads((tmp_path / "all.json").read_text()) == d


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "gpu_wheels").is_dir(), reason="gpu_wheels/ missing: run scripts/fetch_gpu_wheels.sh")
def test_gpu_check_cpu_dry_form(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    s = d["sections"]
    assert {k: v["status"] for k, v in s.items()} == dict.fromkeys(["install", "env", "equality", "trainer", "rollout"], "ok")
    assert s["env"]["env"]["wheels_from_site_dir"]  # pydantic and SpecForge came from the carried wheels
    assert s["equality"]["greedy"]["speculative_equals_greedy_on_device"] and s["equality"]["loss"]["within_tolerance"]
    assert s["equality"]["flex_vs_sdpa"]["equal"]
    res = s["trainer"]["results"]
    assert s["trainer"]["shapes"]["blocks"] > s["trainer"]["shapes"]["max_blocks_per_forward"]  # replayed in groups
    for k in ("specforge_sft", "opd_token", "opd_topk", "opd_full", "recompute_full", "recompute_topk"):
        assert "error" not in res[k], res[k]
    rows = s["rollout"]["rows"]
    assert [(r["batch"], r["pass"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["greedy_outputs_equal"] and r["greedy_agreed_prefix_frac"] == 1.0 for r in rows)
    assert d["meta"]["cpu"] is True
