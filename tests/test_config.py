"""Typed config: unknown keys, wrong types, overrides and flag precedence."""

import re
import subprocess
import sys

import pytest

from specforge_opd.config import ConfigError, load_config


def test_typo_names_key_and_suggestion(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  learning_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, ["training.learning_rat=1"])
    assert "learning_rat" in str(e.value) and "training.learning_rate" in str(e.value)


def test_wrong_type_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="training.learning_rate"):
        load_config(None, ["training.learning_rate=abc"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(bad)


def test_precedence_yaml_overrides_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("output:\n  dir: a\ntraining:\n  learning_rate: 1.0e-4\n")
    cfg = load_config(f, ["output.dir=b", "training.learning_rate=2e-4"], {"output.dir": "c"})
    assert cfg.output.dir == "c" and cfg.training.learning_rate == pytest.approx(2e-4)


def test_cli_config_typo_exits_nonzero():
    r = subprocess.run(
        [sys.executable, "-m", "specforge_opd.cli", "config", "training.learning_rat=1"],
        capture_output=True, text=True,
    )
    assert r.returncode != 0
    assert "learning_rat" in r.stderr and "learning_rate" in r.stderr


def test_validation_error_names_the_overrides_once():
    from specforge_opd.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.seed=1", "output.dir=x", "data.num_prompts=0"])
    assert str(e.value).count("+ overrides") == 1 and "data.num_prompts" in str(e.value)


def test_every_shipped_config_loads():
    """Every YAML under configs/ validates against the schema (a new recipe that only a long run reads
    would otherwise fail hours later)."""
    from pathlib import Path

    from specforge_opd.config import load_config

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        load_config(f)


@pytest.mark.parametrize("typo, want", [
    ("training.lr", "training.learning_rate"),  # initials; once answered with the section `training`
    ("training.lear", "training.learning_rate"),  # a short prefix; once answered with training.seed
    ("training.learning_rat", "training.learning_rate"),
    ("rollout.batchsize", "rollout.batch_size"),
    ("opd.lr", "training.learning_rate"),  # a field of another section; once answered with `opd`
    ("sft.lr", "training.learning_rate"),
    ("opd.batch", "training.batch_size"),  # a name several sections share: each section's offered
])
def test_a_short_typo_under_a_section_suggests_that_sections_field(typo, want):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{typo}=1"])
    hint = str(e.value).split("did you mean", 1)[-1]
    assert f"`{want}`" in hint
    assert not re.search(r"`(training|opd|sft|rollout)`", hint)
