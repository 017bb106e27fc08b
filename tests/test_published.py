"""The embedded target's published drafter loads, fits the target, and drafts as its record says."""

from __future__ import annotations

import pytest

from specforge_opd.models import published
from specforge_opd.stages import publish


@pytest.mark.parametrize("name", published.available())
def test_published_drafter_ships_with_its_training_record(name):
    """Every field the record promises is there: recipe, commit, positions, FLOPs, the validation curve."""
    assert published.EMBEDDED_DRAFTER in published.available()
    rec = published.read_record(name)
    assert rec["config"].strip() and rec["config_file"].endswith(".yaml") and rec["name"] == name
    assert rec["commit"] and rec["target_dtype"] == "float32"
    assert rec["trained_positions"] > 0 and rec["flops"]["drafter_train"] > 0
    curve = rec["validation"]["curve"]
    assert len(curve) >= 2 and [p["step"] for p in curve] == sorted(p["step"] for p in curve)
    best = max(curve, key=lambda p: (p["tau"], -p["step"]))
    assert rec["selected_step"] == best["step"] and rec["validation"]["selected_tau"] == best["tau"]
    # the record says why training stopped: the plateau rule (at its last point), a pause, or the end
    # of the recipe's schedule (sft.max_steps, an annealing stage)
    import yaml

    v = rec["validation"]
    reasons = [v["plateau_step"] == curve[-1]["step"], v["paused_at"] is not None,
               curve[-1]["step"] == (yaml.safe_load(rec["config"])["sft"].get("max_steps"))]
    assert sum(reasons) == 1, v
    chk = rec["check"]
    assert set(chk["drafter"]) == set(chk["ngram"]) == set(chk["datasets"])
    assert all(t >= 1.0 for t in chk["drafter"].values())


@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.parametrize("name", published.available())
def test_published_drafter_replays_to_its_recorded_tau(tmp_path, name):
    """Exact offline replay on the recorded check prompts gives the recorded tau (beside prompt lookup's)."""
    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import load_drafter
    from specforge_opd.models.target import load_target

    d = published.published_drafter(name)
    rec = published.read_record(name)
    bundle = load_target(load_config(None, ["target.dtype=float32", "target.device=cpu"]).target)
    load_drafter(d, target_config=bundle.model.config)  # fits the embedded target
    got = publish.run_check(d, tmp_path / "check", [f"eval.cache_dir={tmp_path / 'cache'}"])
    assert got["datasets"] == rec["check"]["datasets"]
    for ds in got["datasets"]:
        # exact replay at T=0; a tie between two logits may flip on another CPU, hence the small tolerance
        assert got["drafter"][ds] == pytest.approx(rec["check"]["drafter"][ds], abs=0.03), ds
        assert got["ngram"][ds] == pytest.approx(rec["check"]["ngram"][ds], abs=1e-9), ds


def test_publish_finds_the_responses_of_a_run_that_reused_them(tmp_path):
    """A run trained on another run's responses (sft.reuse_from) is published with its trained positions:
    the responses are looked up there when its own output dir has none."""
    from specforge_opd.config import load_config

    (tmp_path / "base" / "responses-abc").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    cfg = load_config(None, [f"output.dir={tmp_path / 'run'}", f"sft.reuse_from={tmp_path / 'base'}"])
    assert publish.responses_dirs(cfg) == [tmp_path / "base" / "responses-abc"]
    (tmp_path / "run" / "responses-own").mkdir()
    assert publish.responses_dirs(cfg) == [tmp_path / "run" / "responses-own"]
    assert publish.responses_dirs(load_config(None, [f"output.dir={tmp_path / 'none'}"])) == []


def _configs_starting_from_published():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1] / "configs"
    return sorted(str(p.relative_to(root.parent)) for p in root.rglob("*.yaml")
                  if str(((yaml.safe_load(p.read_text()) or {}).get("draft") or {}).get("path", "")).startswith(published.SCHEME))


@pytest.mark.parametrize("config", _configs_starting_from_published())
def test_configs_describe_the_published_drafter_they_start_from(config):
    """A config's draft section sizes the memory plan and the FLOPs ledger: it says the start drafter's shape."""
    from pathlib import Path

    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import load_draft_config
    from specforge_opd.stages.preflight import check_drafter_shape

    cfg = load_config(Path(__file__).resolve().parents[1] / config)
    check_drafter_shape(cfg, load_draft_config(cfg.resolve_path(cfg.draft.path)), where=cfg.draft.path)
    assert cfg.draft.path == published.SCHEME + published.EMBEDDED_DRAFTER  # the main job starts from the shipped one


def test_publish_needs_a_name(capsys):
    """Publishing over a shipped name would replace the drafter users' configs resolve: no default name."""
    with pytest.raises(SystemExit) as e:
        publish.cli(["publish", "--export", "x", "--config", "y"])
    assert e.value.code == 2 and "--name" in capsys.readouterr().err


def test_the_registry_lists_and_names_the_command_that_publishes(capsys):
    """``python -m specforge_opd.models.published`` still lists; its old ``publish`` says where publishing went."""
    assert published.cli(["list"]) == 0
    listed = capsys.readouterr().out
    assert f"{published.SCHEME}{published.EMBEDDED_DRAFTER}: step " in listed
    assert publish.cli(["list"]) == 0 and capsys.readouterr().out == listed
    assert published.cli(["publish", "--export", "x y", "--config", "c.yaml"]) == 2
    assert capsys.readouterr().err == ("publish moved: run python -m specforge_opd.stages.publish publish "
                                       "--export 'x y' --config c.yaml\n")


def test_a_second_stage_records_the_first_stage_it_started_from(tmp_path):
    """A drafter trained in two stages (a warm start from a local export) ships with both: the earlier
    config's text, and the start's step and validation curve, which its own record no longer holds."""
    import json

    from specforge_opd.config import load_config
    from specforge_opd.models.drafter import METADATA_FILE

    first = tmp_path / "stage1" / "final"
    first.mkdir(parents=True)
    curve = [{"step": 250, "tau": 1.5, "drafter_flops": 1.0, "export": "x"}, {"step": 500, "tau": 1.6}]
    (first / METADATA_FILE).write_text(json.dumps({
        "stage": "sft", "step": 500, "init_drafter": "published:start",
        "validation": {"selected_tau": 1.6, "selected_step": 500, "curve": curve}}))
    stage1_cfg = tmp_path / "stage1.yaml"
    stage1_cfg.write_text("name: stage1\n")
    cfg = load_config(None, [f"sft.init_drafter={first}"])
    got = publish.earlier_stages(cfg, [stage1_cfg])
    assert got == [{"config_file": str(stage1_cfg), "config": "name: stage1\n"},
                   {"init_drafter": str(first), "step": 500, "selected_tau": 1.6,
                    "curve": [{"step": 250, "tau": 1.5}, {"step": 500, "tau": 1.6}], "init_drafter_of_it": "published:start"}]
    # a published start has its own training record: only the earlier configs, if any, are kept
    assert publish.earlier_stages(load_config(None, ["sft.init_drafter=published:start"])) == []


def test_a_retired_drafter_is_refused_with_its_successor_and_recipe():
    """A name users' configs may still hold fails with the drafter to use instead and the recipe that
    retrains the old one, not a bare 'no such drafter'."""
    from specforge_opd.config import load_config
    from specforge_opd.errors import UserError

    for old, (successor, recipe) in published.RETIRED.items():
        assert old not in published.available() and successor in published.available()
        assert (published.PUBLISHED_DIR.parents[2] / recipe).is_file()
        with pytest.raises(ValueError, match=f"{old} no longer ships: use published:{successor}, or retrain it with "
                                             f"scripts/train_sft.sh {recipe}"):
            published.published_drafter(old)
        with pytest.raises(UserError, match="no longer ships"):
            load_config(None, [f"draft.path=published:{old}"]).resolve_path(f"published:{old}")


def test_the_best_drafter_is_the_recorded_tables_best_shipped_row():
    """``BEST_DRAFTER`` is the published row of ``drafter_scaling.json``, and no shipped drafter that table
    measured beats it: the name users are pointed to is the one with the highest held-out mean tau."""
    import json
    from pathlib import Path

    table = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/drafter_scaling.json").read_text())
    assert published.BEST_DRAFTER in published.available()
    assert table["published_name"] == published.SCHEME + published.BEST_DRAFTER
    assert table["published_mean_tau"] >= table["previous_mean_tau"]
