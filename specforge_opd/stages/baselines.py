"""Fair SFT baselines for OPD: continued SFT from OPD's start drafter, with the start's own recipe.

The paper's baselines continue SFT under the same data set-up and report the
checkpoint with the best evaluation performance. A baseline that changes the recipe
(learning rate and schedule, anchors, slot-loss decay, precision) measures the change
as much as SFT, so by default every baseline here continues with the recipe the start
drafter was trained with, read from its record (``start_recipe``); the SFT config's
recipe is an explicit option (``recipe="config"``).

Two data sources (``source``):

* ``opd_pool``: the target's responses to the OPD stage's own prompt pool (its ``data``
  section, ``rollout.max_new_tokens`` tokens each): the same prompts, SFT instead of OPD;
* ``fresh``: the target's responses to as many fresh conversations of the SFT pool:
  hash slices that neither the SFT config nor the OPD config trains on (``fresh_slices``).

Budget and selection: the run trains for the OPD run's drafter-training FLOPs
(``matched_steps``: rollouts and capture excluded on both sides) and takes a
validation point at as many evenly spaced steps as OPD has refreshes, on the OPD run's
validation prompts (``opd.val_prompts`` held-out prompts of the OPD pool; none of the
runs trains on them, and no pool holds an evaluation prompt). Reported: the drafter at
the matched FLOPs (the last point) and the drafter with the best validation tau.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

from specforge_opd import precision as precision_mod
from specforge_opd.config import TrainingConfig, load_config
from specforge_opd.data.prompts import held_out_prompts, training_pool
from specforge_opd.errors import UserError
from specforge_opd.eval.flops import FlopsLedger, sft_flops
from specforge_opd.models.drafter import drafter_shape, load_drafter, read_drafter_metadata, shape_overrides
from specforge_opd.models.target import target_dir
from specforge_opd.stages import sft
from specforge_opd.stages.sft_train import RECIPE_TRAINING_FIELDS

#: Validation prompts when the OPD config validates nothing (``opd.val_prompts`` 0).
DEFAULT_VAL_PROMPTS = 64
#: Validation points when the OPD export records no refresh curve.
DEFAULT_VAL_POINTS = 4
SOURCES = ("opd_pool", "fresh")
RECIPES = ("start", "config")


class BaselineError(UserError, ValueError):
    """A fair baseline cannot be built as asked; the message names the setting and the fix."""


def start_recipe(start: Path) -> dict:
    """The SFT recipe the drafter at ``start`` was trained with.

    Read from its export metadata (``recipe``: this project's SFT exports record it) or,
    for a published drafter, from the ``training_record.json`` beside the weights (its
    config text and ``training_dtype``); fields its config leaves out take the schema's
    defaults. Returns ``{"training": {field: value}, "mixed_precision": "bf16"|"fp32",
    "specforge_overrides": {...}, "source": where it was read}``.

    Raises:
        BaselineError: the drafter records no recipe.
    """
    import yaml

    start = Path(start)
    meta = read_drafter_metadata(start) if start.is_dir() else {}
    if meta.get("recipe"):
        return dict(meta["recipe"], source=str(start / "specforge_opd.json"))
    record = start / "training_record.json"
    if record.is_file():
        rec = json.loads(record.read_text())
        cfg = yaml.safe_load(rec.get("config") or "") or {}
        defaults = TrainingConfig()
        training = {k: (cfg.get("training") or {}).get(k, getattr(defaults, k)) for k in RECIPE_TRAINING_FIELDS}
        precision = rec.get("training_dtype") or (cfg.get("training") or {}).get("mixed_precision", "fp32")
        return {"training": training, "mixed_precision": precision,
                "specforge_overrides": dict((cfg.get("sft") or {}).get("specforge_overrides") or {}), "source": str(record)}
    raise BaselineError(f"{start}: the start drafter records no training recipe (no 'recipe' in its specforge_opd.json, "
                        "no training_record.json); continue with the SFT config's recipe instead (--recipe config)")


def recipe_overrides(recipe: dict, device: str) -> tuple[list[str], Optional[str]]:
    """``section.field=value`` overrides that repeat ``recipe``, and a note when this machine cannot.

    A bf16 recipe on a CPU without native bf16 (``precision.cpu_bf16_native``) trains in
    fp32 here: emulated bf16 runs about 25x slower there; the note says so, and an
    explicit ``training.mixed_precision=bf16`` override after these forces bf16.
    """
    ov = [f"training.{k}={json.dumps(v)}" for k, v in recipe["training"].items()]
    precision, note = recipe["mixed_precision"], None
    if precision == "bf16" and not precision_mod.uses_cuda(device):
        native, why = precision_mod.cpu_bf16_native()
        if not native:
            precision = "fp32"
            note = (f"the start trained in bf16, but this CPU has no native bf16 ({why}): the baseline trains in fp32 "
                    "(add training.mixed_precision=bf16 to force it)")
    ov.append(f"training.mixed_precision={precision}")
    ov.append(f"sft.specforge_overrides={json.dumps(recipe.get('specforge_overrides') or {})}")
    return ov, note


def fresh_slices(sft_cfg, opd_cfg) -> list[int]:
    """Hash slices of the SFT pool that neither config trains on.

    Raises:
        BaselineError: the configs slice the pool differently, or no slice is left.
    """
    if sft_cfg.data.num_slices != opd_cfg.data.num_slices:
        raise BaselineError(f"data.num_slices differs between the SFT ({sft_cfg.data.num_slices}) and OPD "
                            f"({opd_cfg.data.num_slices}) configs: fresh conversations need one slicing of the pool")
    used = set(sft_cfg.data.slices) | set(opd_cfg.data.slices)
    free = [s for s in range(sft_cfg.data.num_slices) if s not in used]
    if not free:
        raise BaselineError(f"every data slice of {sft_cfg.data.num_slices} is trained on (SFT {sft_cfg.data.slices}, "
                            f"OPD {opd_cfg.data.slices}): raise data.num_slices in both configs to keep a fresh one")
    return free


def opd_drafter_flops(opd_final: Path) -> float:
    """The OPD run's drafter-training FLOPs: ``drafter_budget`` of its export's ``opd_run_flops``
    (the whole run, whichever refresh validation selected), else of ``opd_flops``.

    Raises:
        ValueError: the OPD export has no FLOPs metadata.
    """
    meta = read_drafter_metadata(opd_final)
    run = meta.get("opd_run_flops") or meta.get("opd_flops")
    if run is None:
        raise ValueError(f"{opd_final}: no opd_flops metadata (not an OPD export of this project)")
    return FlopsLedger.from_dict(run).drafter_budget


def matched_steps(sft_cfg, start: Path, responses: list, opd_flops: float) -> tuple[int, float]:
    """(steps, FLOPs per SFT step): continued-SFT steps of ``sft_cfg`` on ``responses`` that spend
    ``opd_flops`` drafter-training FLOPs, for the drafter at ``start`` (its shape sets the cost)."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(_target_of(sft_cfg, start))
    dcfg = load_drafter(start, target_config=tcfg).config  # any drafter form OPD accepts
    per_step = sft_flops(sft_cfg, dcfg, tcfg, responses, steps=1, captured_here=False).drafter_train
    return max(1, math.ceil(opd_flops / per_step)), per_step


def start_shape_overrides(sft_cfg, start: Path) -> list[str]:
    """``draft.*`` overrides that give an SFT config the shape of the drafter at ``start`` (layers, block
    size, target layers, MLP width): a baseline continues that drafter, whatever its SFT YAML says."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(_target_of(sft_cfg, start))
    return shape_overrides(drafter_shape(load_drafter(start, target_config=tcfg)))


def _target_of(cfg, start: Path) -> str:
    """The target's HF directory: the one the starting drafter records, else the config's."""
    t = read_drafter_metadata(start).get("target")
    return t if t and Path(t).is_dir() else target_dir(cfg)


def load_pair(sft_config: str, opd_config: str, overrides: Optional[list[str]] = None):
    """(SFT config, OPD config, start drafter path): both YAMLs with ``overrides``, and the OPD config's
    ``draft.path``, where every baseline starts.

    Raises:
        BaselineError: the OPD config has no ``draft.path``.
    """
    sft_cfg = load_config(sft_config, overrides)
    opd_cfg = load_config(opd_config, overrides)
    if opd_cfg.draft.path is None:
        raise BaselineError(f"{opd_config}: draft.path is not set: the baseline starts where OPD started")
    return sft_cfg, opd_cfg, Path(opd_cfg.resolve_path(opd_cfg.draft.path))


def validation_prompts(opd_cfg, tokenizer) -> list:
    """The OPD run's validation prompts (``opd.val_prompts`` held-out prompts of its pool; 64 when it sets none),
    chosen as the OPD stage chooses them (``OPDValidation``: the pool filtered with the target's tokenizer)."""
    n = opd_cfg.opd.val_prompts or DEFAULT_VAL_PROMPTS
    return held_out_prompts(opd_cfg.data, n, field="opd.val_prompts", cache=opd_cfg.target.cache_dir, tokenizer=tokenizer)


def training_prompts(data_cfg, opd_cfg, tokenizer) -> list:
    """The prompts a baseline trains on, chosen as the OPD stage chooses its pool (``stages.opd._pool``:
    prompts longer than ``data.max_prompt_tokens`` dropped with the target's tokenizer before the seeded
    shuffle and the cap). The SFT stage alone builds its pool without a tokenizer, which keeps another set."""
    return list(training_pool(data_cfg, cache=opd_cfg.target.cache_dir, tokenizer=tokenizer))


def opd_refreshes(opd_final: Path) -> int:
    """How many refreshes the OPD run validated (its export's curve), else ``DEFAULT_VAL_POINTS``."""
    curve = (read_drafter_metadata(opd_final).get("validation") or {}).get("curve") or []
    return max(1, sum(1 for p in curve if p["step"] >= 1)) if curve else DEFAULT_VAL_POINTS


def run_fair_sft(sft_config: str, opd_config: str, *, source: str = "opd_pool", recipe: str = "start",
                 out: Optional[Path] = None, overrides: Optional[list[str]] = None, opd_out: Optional[Path] = None,
                 val_points: Optional[int] = None, opd_flops: Optional[float] = None) -> dict:
    """Train one fair baseline (module docstring); returns where its drafters are.

    Args:
        sft_config, opd_config: YAML paths; ``overrides`` apply to both.
        source: ``opd_pool`` or ``fresh``. recipe: ``start`` (default) or ``config``.
        out: the run's output dir (default ``<sft output.dir>/../sft_fair_<source>``).
        opd_out: the OPD run to match (default: the OPD config's ``output.dir``).
        val_points: validation points over the budget (default: the OPD run's refreshes).
        opd_flops: the OPD run's drafter-training FLOPs (its own, the start's history excluded), for an
            OPD run recorded in a result but no longer on disk; ``opd_out`` is then not read, and
            ``val_points`` defaults to ``DEFAULT_VAL_POINTS``.

    Returns:
        ``{"matched": Path, "best_val": Path, "steps": int, "curve": [...], "selected_step": int,
        "source": str, "recipe": dict, "recipe_note": str|None}``: ``matched`` is the drafter
        at the OPD run's FLOPs, ``best_val`` the best validation point up to them.

    Raises:
        BaselineError: an unknown source or recipe, no ``draft.path``, no recipe recorded,
            or no fresh slice; ValueError: the OPD export has no FLOPs metadata.
    """
    if source not in SOURCES:
        raise BaselineError(f"source={source!r}: expected one of {SOURCES}")
    if recipe not in RECIPES:
        raise BaselineError(f"recipe={recipe!r}: expected one of {RECIPES}")
    sft_cfg, opd_cfg, start = load_pair(sft_config, opd_config, overrides)
    if opd_flops is not None:
        if not opd_flops > 0:
            raise BaselineError(f"opd_flops={opd_flops!r}: expected the OPD run's drafter-training FLOPs (> 0)")
        budget, points = float(opd_flops), val_points or DEFAULT_VAL_POINTS
    else:
        opd_final = Path(opd_out or opd_cfg.resolve_path(opd_cfg.output.dir)) / "final"
        budget = opd_drafter_flops(opd_final)
        points = val_points or opd_refreshes(opd_final)
    out = Path(out or Path(sft_cfg.resolve_path(sft_cfg.output.dir)).parent / f"sft_fair_{source}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir(opd_cfg))
    val = validation_prompts(opd_cfg, tokenizer)
    rec, ov, note = None, [], None
    if recipe == "start":
        rec = start_recipe(start)
        ov, note = recipe_overrides(rec, sft_cfg.target.device)
        if note:
            print(f"[baseline] {note}", file=sys.stderr)
    # the start's shape, then its recipe; the user's own overrides come last: an explicit change of the recipe
    # wins, on purpose (a change of the shape is refused by the SFT stage: the start's weights would not fit)
    ov = start_shape_overrides(sft_cfg, start) + ov + list(overrides or []) + [
        f"output.dir={out}", f"sft.init_drafter={start}", f"sft.val_prompts={len(val)}", "sft.select=best_val",
        "sft.plateau_patience=0", "sft.pause_at_step=null", f"sft.max_new_tokens={opd_cfg.rollout.max_new_tokens}"]
    cfg = load_config(sft_config, ov)
    if source == "opd_pool":
        data = opd_cfg.data
    else:
        data = sft_cfg.data.model_copy(update={"slices": fresh_slices(sft_cfg, opd_cfg),
                                               "num_prompts": opd_cfg.data.num_prompts, "seed": opd_cfg.data.seed})
    prompts = training_prompts(data, opd_cfg, tokenizer)
    # every prompt OPD rolled out (prompt + rollout.max_new_tokens <= target.max_context) trains here too: the
    # SFT step's own limit counts the rendered prompt, the pool's the raw text
    room = opd_cfg.target.max_context - opd_cfg.rollout.max_new_tokens
    cfg = cfg.model_copy(update={"data": data.model_copy(update={"max_prompt_tokens": max(room, data.max_prompt_tokens)})})
    chosen: dict = {}

    def budget_for(responses: list) -> dict:
        steps, per_step = matched_steps(cfg, start, responses, budget)
        chosen["steps"] = steps
        interval = math.ceil(steps / points)
        print(f"[baseline] OPD spent {budget:.3e} drafter FLOPs; one SFT step costs {per_step:.3e}: continuing SFT "
              f"from {start} for {steps} steps on {source} responses ({recipe} recipe), a validation point every "
              f"{interval} steps -> {out}", file=sys.stderr)
        return {"max_steps": steps, "val_interval": interval}

    final = sft.run_sft(cfg, budget_for=budget_for, prompts=prompts, val_prompts=val)
    v = read_drafter_metadata(final)["validation"]
    curve = v["curve"]
    last = max(curve, key=lambda p: p["step"])
    return {"matched": Path(last["export"]), "best_val": final, "steps": last["step"], "curve": curve,
            "selected_step": v["selected_step"], "source": source, "recipe": rec or {"source": "the SFT config"},
            "recipe_note": note}
