"""benchmarks/bench_drafter_scaling.py: a point continued past its budget keeps its fixed-budget row."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_drafter_scaling", ROOT / "benchmarks/bench_drafter_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_long_run_keeps_the_budget_point_and_adds_its_own_row(tmp_path):
    bench = _bench()
    curve = [{"step": s, "tau": t, "export": f"curve/step_{s:07d}"}
             for s, t in [(250, 1.05), (500, 1.10), (750, 1.12), (1000, 1.11), (1250, 1.20), (1500, 1.19)]]
    short = bench.budget_and_long("depth2", {"curve": curve[:4], "select": "best_val", "selected_step": 750}, 1000,
                                  tmp_path / "final")
    assert [r["name"] for r in short] == ["depth2"]
    assert short[0]["path"] == "curve/step_0000750" and short[0]["selected_step"] == 750
    rows = bench.budget_and_long("depth2", {"curve": curve, "select": "best_val", "selected_step": 1250}, 1000,
                                 tmp_path / "final")
    assert [r["name"] for r in rows] == ["depth2", "depth2-long"]
    # the budget row is what the paused run exported, not the long run's better drafter
    assert rows[0] == short[0]
    assert rows[1]["path"] == str(tmp_path / "final") and rows[1]["steps"] == 1500
    assert rows[1]["selected_step"] == 1250 and rows[1]["best_val_tau"] == 1.20
    # select=last: the last point up to the budget, and the run's own recorded choice for the long row
    last = bench.budget_and_long("depth2", {"curve": curve, "select": "last", "selected_step": 1500}, 1000,
                                 tmp_path / "final")
    assert (last[0]["selected_step"], last[0]["path"]) == (1000, "curve/step_0001000")
    assert (last[1]["selected_step"], last[1]["best_val_tau"]) == (1500, 1.19)
    with pytest.raises(ValueError, match="no validation point at or before step 100"):
        bench.budget_and_long("depth2", {"curve": curve, "select": "best_val", "selected_step": 1250}, 100, tmp_path)


def test_table_names_the_shipped_and_the_previous_drafter():
    """The top level is the shipped drafter's; a result written before it shipped still renders as b8's."""
    bench = _bench()
    row = lambda t: {"tau": {"mtbench": t}, "mean_tau": t, "ci95": [t - 0.01, t + 0.01]}  # noqa: E731
    old = {"eval": {"sets": {"mtbench": 80}, "max_new_tokens": 96}, "published_mean_tau": 1.25, "published": row(1.25),
           "prompt_lookup_mean_tau": 1.6, "prompt_lookup": row(1.6), "points": []}
    assert "| published (b8) |" in bench.render(old) and "previous" not in bench.render(old)
    new = {**old, "published_name": bench.PUBLISHED, "published": row(1.27), "published_mean_tau": 1.27,
           "previous_name": bench.PREVIOUS, "previous": row(1.25), "previous_mean_tau": 1.25}
    lines = bench.render(new).splitlines()
    assert any(l.startswith("| published (b8-mixv2-l3-long) |") and "1.270" in l for l in lines)
    assert any(l.startswith("| previous (b8-mixv2-l3) |") and "1.250" in l for l in lines)
    from specforge_opd.models.published import available

    shipped = [n.split(":", 1)[-1] for n in (bench.PUBLISHED, bench.PREVIOUS)]
    assert set(shipped) <= set(available())


def test_a_run_of_its_own_config_merges_into_the_table_by_name():
    """--phase run replaces a point of the same name in place, appends a new one and re-picks the best."""
    bench = _bench()
    row = lambda n, t, **kw: {"name": n, "eval": {"tau": {"mtbench": t}, "mean_tau": t, "ci95": [t, t]}, **kw}  # noqa: E731
    table = {"points": [row("data1x", 1.10), row("mix-l3", 1.12), row("depth3", 1.15)], "best_point": "depth3"}
    merged = bench.merge_points(table, [row("mix-l3", 1.20, config="c.yaml"), row("mix-l3-long", 1.30, config="c.yaml")])
    assert [p["name"] for p in merged["points"]] == ["data1x", "mix-l3", "depth3", "mix-l3-long"]
    assert merged["points"][1]["eval"]["mean_tau"] == 1.20 and merged["best_point"] == "mix-l3-long"
    assert table["points"][1]["eval"]["mean_tau"] == 1.12  # the input is not modified


def test_a_run_spec_without_a_config_is_refused():
    bench = _bench()
    with pytest.raises(SystemExit, match="expected NAME=CONFIG"):
        bench.own_run_point("mix-l3", None)


def test_extrapolation_fits_log_tokens_and_layers_and_predicts_from_the_shipped_drafter():
    """Tau linear in log10 tokens (+0.05 per 10x) and log10 layers: the fits recover the slopes, and the
    predictions start from the shipped drafter's tau."""
    import math

    bench = _bench()
    pt = lambda name, tokens, layers, tau, **kw: {"name": name, "response_tokens": tokens, "layers": layers,  # noqa: E731
                                                  "eval": {"mean_tau": tau}, **kw}
    points = [pt("data1x", 1e5, 1, 1.10), pt("data2x", 2e5, 1, 1.10 + 0.05 * math.log10(2)),
              pt("data4x", 4e5, 1, 1.10 + 0.05 * math.log10(4)),
              pt("depth3", 4e5, 3, 1.10 + 0.05 * math.log10(4) + 0.02 * math.log10(3)),
              pt("depth3-long", 4e5, 3, 1.3),  # a long run is no budget point
              pt(bench.LONG_DATA_PAIR[0], 2e5, 3, 1.40, config="a.yaml"), pt(bench.LONG_DATA_PAIR[1], 2e6, 3, 1.43, config="b.yaml")]
    ex = bench.extrapolate({"points": points, "published_mean_tau": 1.5}, goal=1.6)
    assert ex["data_at_budget"]["names"] == ["data1x", "data2x", "data4x"]
    assert ex["data_at_budget"]["slope"] == pytest.approx(0.05) and ex["data_at_budget"]["max_residual"] < 1e-12
    assert ex["data_long"]["slope"] == pytest.approx(0.03)
    assert ex["depth_at_budget"]["names"] == ["data4x", "depth3"]
    assert ex["depth_at_budget"]["slope"] == pytest.approx(0.02)
    assert ex["predict"]["data_at_budget"]["at_10x_tokens"] == pytest.approx(1.55)
    # 0.1 tau at 0.05 per 10x: 100x the tokens
    assert ex["predict"]["data_at_budget"]["tokens_multiple_for_goal"] == pytest.approx(100.0)
    assert ex["predict"]["depth_at_budget"]["at_10x_layers"] == pytest.approx(1.52)
    assert "| data_long |" in bench.render_extrapolation(ex)
    # without the long pair or a second depth, those fits are left out, not made up
    short = bench.extrapolate({"points": points[:3], "published_mean_tau": 1.5})
    assert set(short) == {"data_at_budget", "predict"}
