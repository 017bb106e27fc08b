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
    assert [r["batch"] for r in s["rollout"]["rows"]] == [1, 2] and all(r["greedy_outputs_equal"] for r in s["rollout"]["rows"])
    assert d["meta"]["cpu"] is True
