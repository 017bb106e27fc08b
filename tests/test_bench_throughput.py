"""bench_throughput's cross-revision pieces: the record form compared and the revision check (no model is loaded)."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / f"benchmarks/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(sid, ids, acc):
    return SimpleNamespace(sample_id=sid, input_ids=torch.tensor(ids), anchors=torch.tensor([0, 3]),
                           drafts=torch.tensor([[5, 6], [7, 8]]), accepted=torch.tensor(acc))


def test_record_lists_compare_every_field_and_the_order():
    """The revision's records (written as record_lists) equal today's only with every field and the order."""
    record_lists = _load("rollout_at_revision").record_lists
    recs = [_rec("a", [1, 2, 3], [1, 0]), _rec("b", [4, 5], [0, 0])]
    listed = [{"sample_id": r.sample_id, **{k: getattr(r, k).tolist() for k in ("input_ids", "anchors", "drafts", "accepted")}}
              for r in recs]
    assert record_lists(recs) == listed
    assert record_lists(recs[::-1]) != listed
    assert record_lists(recs[:1]) != listed
    changed = [dict(listed[0], accepted=[1, 1]), listed[1]]
    assert record_lists(recs) != changed


def test_default_before_revision_is_a_commit_here():
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: the history that holds the before revision is absent")
    b = _load("bench_throughput")
    rc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{b.BEFORE_REV}^{{commit}}"],
                        capture_output=True).returncode
    assert rc == 0, f"BEFORE_REV {b.BEFORE_REV} is not a commit of this repository (a shallow clone?)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_read_bytes_is_the_runner_cache_over_its_slots(dtype):
    """The decode floor's KV bytes equal the runner's KVCache buffers over ``mean_slots`` slots, keys and values
    of every layer (a GQA config whose head_dim is not hidden / heads, so each field counts)."""
    from specforge_opd.rollout.decode import KVCache

    kv_read_bytes = _load("bench_decode").kv_read_bytes
    cfg = SimpleNamespace(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_hidden_layers=3)
    batch, slots = 5, 11
    cache = KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, slots, dtype, "cpu")
    held = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert kv_read_bytes(cfg, dtype, batch, slots) == held
    assert kv_read_bytes(cfg, dtype, batch, slots / 2) == held / 2
