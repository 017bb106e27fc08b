"""Where an SFT run finds finished steps: its own output dir, then each ``sft.reuse_from`` directory."""

from __future__ import annotations

from specforge_opd import stepkeys
from specforge_opd.config import load_config


def _done(root, step, key):
    d = stepkeys.step_dir(root, step, key)
    d.mkdir(parents=True)
    stepkeys.mark_done(d, key, {"k": key}, {})
    return d


def test_reuse_from_takes_a_list_searched_in_order(tmp_path):
    """A second stage takes its responses from one directory (a packed step) and its features from
    another (the first stage's run); the first finished match wins, and the run's own step beats both."""
    out, packed, first = tmp_path / "out", tmp_path / "packed", tmp_path / "first"
    cfg = load_config(None, [f"output.dir={out}", f"sft.reuse_from=[{packed}, {first}]"])
    assert stepkeys.step_roots(cfg, out) == [out, packed, first]
    responses = _done(packed, "responses", "rk")
    features = _done(first, "features", "fk")
    assert stepkeys.reusable_step(cfg, out, "responses", "rk") == responses
    assert stepkeys.reusable_step(cfg, out, "features", "fk") == features
    # both hold it: the earlier directory in the list wins
    _done(first, "responses", "rk")
    assert stepkeys.reusable_step(cfg, out, "responses", "rk") == responses
    # the run's own finished step beats every reuse_from directory
    own = _done(out, "features", "fk")
    assert stepkeys.reusable_step(cfg, out, "features", "fk") == own
    # nothing finished anywhere under this key: the run's own directory, to compute it in
    assert stepkeys.reusable_step(cfg, out, "train", "tk") == stepkeys.step_dir(out, "train", "tk")


def test_reuse_from_as_one_path_is_unchanged(tmp_path):
    out, base = tmp_path / "out", tmp_path / "base"
    cfg = load_config(None, [f"output.dir={out}", f"sft.reuse_from={base}"])
    assert cfg.sft.reuse_from == str(base)
    assert stepkeys.step_roots(cfg, out) == [out, base]
    done = _done(base, "features", "fk")
    assert stepkeys.reusable_step(cfg, out, "features", "fk") == done
    assert stepkeys.step_roots(load_config(None, [f"output.dir={out}"]), out) == [out]
