"""Typed experiment configuration: one YAML per experiment, ``section.field=value`` overrides.

The schema is pydantic with ``extra="forbid"`` everywhere, so a typo'd key is an
error, not a silently ignored setting. Where a field means the same as one of
SpecForge's run-config fields it carries SpecForge's name (``learning_rate``,
``warmup_ratio``, ``max_grad_norm``, ``num_epochs``, ``batch_size``,
``accumulation_steps``, ``attention_backend``, ``num_anchors``, ``block_size``).

Each section belongs to one module of the package (named in its docstring); add
fields to your own section only.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, List, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specforge_opd.errors import UserError
# the one import of a higher layer: a config path may be published:NAME (the registry imports only the stdlib)
from specforge_opd.models.published import SCHEME, resolve
from specforge_opd.teacher_form import TEACHER_FORMS, TeacherForm, bonus_teacher_missing  # noqa: F401  (re-exported)


class ConfigError(UserError, ValueError):
    """A config file, key or value is wrong; the message names it and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(Section):
    """The target model (``specforge_opd.models.target``).

    ``path`` None means the embedded default (SmolLM2-135M-Instruct converted
    from its PyPI GGUF package by ``specforge-opd prepare-assets``).
    """

    path: Optional[str] = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    #: Longest prompt + response the target accepts (tokens).
    max_context: int = Field(default=2048, gt=0)
    #: What to do with a prompt that does not fit max_context - max_new_tokens.
    too_long: Literal["error", "truncate_left", "skip"] = "skip"
    #: Chat-template rendering; rollout, SFT capture and eval share it.
    thinking: bool = False
    system_prompt: Optional[str] = None
    #: Extra stop token ids besides the tokenizer's eos.
    stop_token_ids: List[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    #: Asset cache for the embedded target and parsed prompt sources
    #: (None: $SPECFORGE_OPD_CACHE, else ~/.cache/specforge_opd).
    cache_dir: Optional[str] = None
    #: torch intra-op threads of every process this run starts (the SpecForge
    #: subprocess included), capped at the cores the process may use divided by the
    #: processes per node (torchrun's LOCAL_WORLD_SIZE). Default from
    #: benchmarks/bench_decode.py on the 2-core machine: see the README.
    threads: int = Field(default=2, ge=1)
    #: Prompts go through the target in chunks of this many tokens (bounds the
    #: prefill's mask and attention scores to [chunk, context]).
    prefill_chunk: int = Field(default=256, ge=1)


class DraftConfig(Section):
    """The DFlash drafter (``specforge_opd.models.drafter``). Unset fields are derived from the target."""

    #: Initial drafter: an HF DFlash directory, a SpecForge step directory
    #: (``training_state.pt`` or ``-latest``) or a SpecForge HF export.
    path: Optional[str] = None
    num_hidden_layers: int = Field(default=1, gt=0)
    block_size: int = Field(default=16, ge=2)
    target_layer_ids: Optional[List[Annotated[int, Field(ge=0)]]] = None
    mask_token_id: Optional[int] = Field(default=None, ge=0)
    #: Drafter MLP width; None = the target's intermediate_size.
    intermediate_size: Optional[int] = Field(default=None, gt=0)


class DataConfig(Section):
    """Prompt sources (``specforge_opd.data.prompts``)."""

    #: Training prompt sources, e.g. ["sharegpt"] or ["gsm8k", "math", "aops", "codealpaca"].
    train_sources: List[str] = Field(default_factory=lambda: ["sharegpt"])
    #: Local JSONL/Parquet files for hub-only sources: {source_name: path}.
    local_files: dict[str, str] = Field(default_factory=dict)
    #: Number of training prompts to take (None = all).
    num_prompts: Optional[int] = Field(default=None, ge=1)
    #: Per-source caps applied before mixing, e.g. {gsm8k: 2000, math: 5000}.
    source_limits: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    #: Disjoint hash slices of the prompt pool: a prompt belongs to slice
    #: int(sha1(normalized text)) % num_slices; SFT and OPD take different slices.
    num_slices: int = Field(default=1, gt=0)
    slices: List[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0], min_length=1)
    #: Evaluation sets whose prompts are removed from the training pool.
    exclude_eval: List[str] = Field(
        default_factory=lambda: ["mtbench", "humaneval", "mmath_math500", "mmath_aime24", "mmath_aime25"]
    )
    max_prompt_tokens: int = Field(default=512, gt=0)
    seed: int = 0


class RolloutConfig(Section):
    """Speculative rollouts (``specforge_opd.rollout.engine``)."""

    backend: Literal["embedded", "sglang_verify", "sglang_native"] = "embedded"
    #: Embedded backend: rows of the continuous batch (a row that ends is refilled with the
    #: next prompt); also the sequences per shard of the OPD stage's rollout phase.
    batch_size: int = Field(default=8, gt=0)
    max_new_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    teacher: TeacherForm = "full"
    teacher_topk: int = Field(default=32, gt=0)
    anchors: Literal["real", "random"] = "real"
    #: Store target context features in shards (False: the trainer recomputes them).
    store_features: bool = True
    #: Target sequences per shard file.
    sequences_per_shard: int = Field(default=16, gt=0)
    seed: int = 0


class TrainingConfig(Section):
    """Drafter training, shared by SFT (SpecForge) and OPD (``specforge_opd.train.trainer``)."""

    learning_rate: float = Field(default=3e-4, gt=0.0)
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = Field(default=0.05, ge=0.0, le=1.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    num_epochs: int = Field(default=1, gt=0)
    batch_size: int = Field(default=1, gt=0)
    accumulation_steps: int = Field(default=1, gt=0)
    attention_backend: Literal["sdpa", "flex_attention", "eager"] = "sdpa"
    #: SFT (SpecForge) only: random anchors per sequence.
    num_anchors: int = Field(default=512, gt=0)
    seed: int = 42
    # --- OPD loss (paper section 4.2, Eq. 1; DESIGN.md section 4) ---
    loss: Literal["mixed", "all_forward", "all_reverse", "naive_target_assisted"] = "mixed"
    #: Weight decay^(k-1) on rejected slot k (not SpecForge's loss_decay_gamma).
    rejected_decay: float = Field(default=0.8, gt=0.0, le=1.0)
    #: Measure the decay from slot 1 (paper) or from the first rejected slot.
    decay_from: Literal["slot1", "first_rejected"] = "slot1"
    lambda_acc: float = Field(default=1.0, ge=0.0)
    lambda_rej: float = Field(default=1.0, ge=0.0)
    #: eq1: (la*L_acc + lr*L_rej)/(la+lr); pooled: the authors' (sum_acc + sum w rej)/(N_acc + sum w).
    combine: Literal["eq1", "pooled"] = "eq1"
    #: The accepted term's slots: ``eq1`` (paper: the accepted drafts, 1..r_m) or ``verified``
    #: (the authors' code: the verified trajectory, 1..r_m+1; the bonus slot r_m+1, teacher
    #: conditioned on the accepted prefix, also keeps the reverse KL of its rejected draft).
    #: ``verified`` needs the full or topk teacher (the token form stores no bonus-token teacher).
    accepted_stream: Literal["eq1", "verified"] = "eq1"
    feature_source: Literal["shard", "target"] = "shard"
    #: Slots per lm_head/KL chunk.
    chunk_slots: int = Field(default=1024, gt=0)
    #: OPD trainer: blocks per drafter replay forward (and per verify forward of the
    #: feature_source=target recompute); a longer sequence replays in groups, each
    #: with its own backward, so activations stay bounded (SpecForge's DFlash SFT caps
    #: a forward at 512 anchors). The gradient equals one forward over all blocks.
    max_blocks_per_forward: int = Field(default=512, gt=0)
    #: Stop after this many non-finite steps in a row.
    max_nonfinite_steps: int = Field(default=3, gt=0)
    log_interval: int = Field(default=1, gt=0)
    #: OPD trainer: save a resumable checkpoint every this many optimizer steps (and at the end).
    checkpoint_interval: int = Field(default=50, gt=0)
    #: OPD trainer: keep this many newest checkpoints; older step directories are deleted
    #: once a newer one is complete (each holds the drafter and its Adam moments).
    keep_checkpoints: int = Field(default=2, gt=0)
    #: OPD trainer: "auto" = bf16 params/compute on GPUs (fp32 master weights and
    #: gradient reduction), fp32 on CPUs. SFT stage: the drafter's SpecForge
    #: ``torch_dtype`` and the stored features' dtype ("auto" = ``target.dtype`` on GPUs;
    #: on CPUs bf16 only where the CPU computes it natively, AVX512-BF16 or AMX, else fp32;
    #: "bf16" trains bf16 weights with SpecForge's fp32 master copies, on CPUs too, with a
    #: warning where bf16 is emulated). Resolved by ``specforge_opd.precision``; every run
    #: prints the choice and records it.
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    #: OPD trainer: reshuffle the records every epoch (seeded by training.seed + epoch).
    shuffle: bool = True


class SFTConfig(Section):
    """The SFT stage (``specforge_opd.stages.sft``)."""

    #: Generate responses greedily (temperature 0) or sampled.
    temperature: float = Field(default=0.0, ge=0.0)
    max_new_tokens: int = Field(default=256, gt=0)
    #: Embedded backend: rows of the continuous batch that generates responses (and of the
    #: feature capture's length-bucketed batches).
    batch_size: int = Field(default=8, gt=0)
    #: Prompts per responses chunk file (the unit of resume for generation).
    chunk_prompts: int = Field(default=32, gt=0)
    #: SpecForge ``training.save_interval`` in optimizer steps (0: about five checkpoints per run).
    save_interval: int = Field(default=0, ge=0)
    #: Validation curve (``specforge_opd.eval.validation``): prompts of the training pool after
    #: ``data.num_prompts``, never trained on, replayed offline after every segment (0: off).
    val_prompts: int = Field(default=0, ge=0)
    #: Optimizer steps per training segment between validation points (0: one epoch).
    val_interval: int = Field(default=0, ge=0)
    #: The exported checkpoint when validating: highest validation tau, or the last one.
    select: Literal["best_val", "last"] = "best_val"
    #: Export check: prompts decoded speculatively and compared with greedy target decoding.
    verify_prompts: int = Field(default=2, ge=0)
    verify_max_new_tokens: int = Field(default=32, gt=0)
    #: SpecForge run-config overrides passed through verbatim (section.field: value).
    specforge_overrides: dict[str, Any] = Field(default_factory=dict)
    #: Other SFT output dirs (one path or a list, searched in order) whose finished responses/features
    #: steps (same input hash) are reused: a second stage can take its responses from a packed step
    #: and its features from the first stage's run.
    reuse_from: Optional[str | List[str]] = None
    #: Train on the first N samples of the responses (the pool is shuffled, so a smaller N is a
    #: random subset of the same mix): the points of a data curve share one responses and
    #: features step (None: every sample).
    train_samples: Optional[int] = Field(default=None, gt=0)
    #: Warm-start drafter weights (HF DFlash dir or SpecForge checkpoint): continued SFT.
    init_drafter: Optional[str] = None
    #: Stop after this many optimizer steps; the cosine schedule spans them (None: epochs decide).
    max_steps: Optional[int] = Field(default=None, gt=0)
    #: Plateau stop (needs validation): stop once this many validation points in a row
    #: fail to beat the best earlier point by more than ``plateau_band`` (0: off).
    plateau_patience: int = Field(default=0, ge=0)
    #: Noise band of the plateau rule, in tau (the seed spread of tau at this scale).
    plateau_band: float = Field(default=0.02, ge=0.0)
    #: Pause a validated run at the first point at or after this step: the export is the
    #: best point so far, and the same command with a later or no value continues it
    #: (a session's budget; not part of the step's key).
    pause_at_step: Optional[int] = Field(default=None, gt=0)
    #: True: SpecForge's own DFlash objective, whose checkpointed lm_head chunks recompute the
    #: logits in the backward (3 vocabulary matmuls per position). False (a CPU option): the
    #: same loss and gradients (equal in fp32; bf16 softmax in fp32) with each chunk's
    #: d(loss)/d(hidden) computed in the forward and kept (2 matmuls, zero-weight slots skipped),
    #: inside SpecForge's own training loop and checkpoints. Ignored with a warning on GPUs.
    lm_head_recompute: bool = True


class OPDConfig(Section):
    """The iterated OPD stage (``specforge_opd.stages.opd``)."""

    prompts_per_step: int = Field(default=8, gt=0)
    #: Prompts rolled out per iteration (a multiple of prompts_per_step).
    prompts_per_iteration: int = Field(default=32, gt=0)
    spool_dir: Optional[str] = None
    spool_budget_bytes: int = Field(default=8 * 2**30, gt=0)
    keep_shards: bool = False
    eval_every: int = Field(default=1, ge=0)
    #: Validation curve: prompts of the pool after ``data.num_prompts`` (never rolled out),
    #: on which every refresh's drafter (and the start) is replayed offline at T=0; 0: off.
    val_prompts: int = Field(default=0, ge=0)
    #: After the last iteration, roll out the final drafter once more on iteration 1's
    #: prompts, so ``tau_per_iteration.png`` and ``report.md`` show its on-policy tau beside
    #: the start's (one more iteration's rollout; the validation curve needs none).
    final_rollout: bool = True
    #: The drafter exported as ``final`` when validating: the refresh with the highest
    #: validation tau (``best_val``, as the SFT stage selects), or the last one.
    select: Literal["best_val", "last"] = "best_val"


class EvalConfig(Section):
    """Evaluation (``specforge_opd.eval.evaluate``)."""

    datasets: List[str] = Field(default_factory=lambda: ["mtbench", "humaneval", "mmath_math500"])
    #: Prompts per dataset (None = all).
    num_prompts: Optional[int] = Field(default=16, ge=1)
    max_new_tokens: int = Field(default=128, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    seeds: List[int] = Field(default_factory=lambda: [0], min_length=1)
    batch_size: int = Field(default=1, gt=0)
    #: Add the prompt-lookup drafter's row (``specforge_opd.eval.ngram``; no training) to every
    #: offline table, at the block size of the first evaluated drafter.
    ngram: bool = True
    #: Longest suffix the prompt-lookup drafter matches (then shorter ones, down to 1).
    ngram_max: int = Field(default=3, ge=1)
    #: Measure wall-clock speedup by live decoding as well (slow on a CPU).
    speedup: bool = True
    #: Prompts per dataset used for the speedup measurement (None = all evaluated prompts).
    speedup_num_prompts: Optional[int] = Field(default=None, gt=0)
    #: auto: exact offline replay at temperature 0, live decoding at T > 0; live: always decode live.
    mode: Literal["auto", "offline", "live"] = "auto"
    #: Cache of the target's greedy trajectories and features (None = <output.dir>/trajectory_cache).
    #: Share one across evaluations of the same target to pay for the target once.
    cache_dir: Optional[str] = None


class SGLangConfig(Section):
    """SGLang server settings (``specforge_opd.sglang``)."""

    #: Command that runs SGLang's Python (SGLang usually lives in its own env).
    python: str = "python"
    urls: List[str] = Field(default_factory=list)
    #: KV pool of a launched server in tokens (``--max-total-tokens``); None (the default)
    #: lets SGLang size it from the GPU memory free at its start (``mem_fraction_static``).
    #: Native rollouts bound the tokens in flight by the pool the server reports, so
    #: queued requests never time out; a fixed pool caps the rollout's concurrency
    #: (65536 tokens hold 10 requests of 2048 + 4096 tokens, of DFLASH's 48 slots).
    max_total_tokens: Optional[int] = Field(default=None, gt=0)
    #: ``--mem-fraction-static`` of a launched server: the share of the GPU memory free
    #: at its start that its weights and KV pool may take. None: set from what is free
    #: when the server starts (after the trainer's target left the GPU), leaving
    #: ``gpu_reserve_gb`` unclaimed (``sglang.sizing.mem_fraction_for``); no GPU here: SGLang's default.
    mem_fraction_static: Optional[float] = Field(default=None, gt=0.0, lt=1.0)
    #: GiB of the GPU memory free at a launched server's start that it leaves unclaimed
    #: when ``mem_fraction_static`` is None: SGLang's own activations and CUDA graphs
    #: (it reserves about 10 GiB on GPUs over 60 GiB) plus this process's while the
    #: server runs (verify mode drafts on the GPU).
    gpu_reserve_gb: float = Field(default=12.0, ge=0.0)
    #: Move the in-process target off the GPU while a rollout goes through SGLang
    #: (the server holds its own copy); verify mode keeps the embedding and lm_head.
    offload_target: bool = True
    #: Seconds a launched server may take to answer ``/health``; None scales it with
    #: the target's weights (``sglang.sizing.startup_timeout_for``: 600 s plus 20 s per GiB):
    #: DFLASH start-up loads target and drafter, captures CUDA graphs for both and
    #: compiles kernels, and the server restarts for every new drafter.
    startup_timeout_s: Optional[float] = Field(default=None, gt=0)
    #: Per-request timeout = request_timeout_s + timeout_per_token_s * max_new_tokens.
    request_timeout_s: float = Field(default=120.0, gt=0)
    timeout_per_token_s: float = Field(default=0.05, ge=0.0)
    max_in_flight: int = Field(default=64, gt=0)
    #: Verify mode: most feature floats one response may carry (prompt length x captured
    #: layers x hidden size for a prefill). SGLang sends them as JSON, about 20 bytes a
    #: float; past this the rollout is refused with a pointer to native mode.
    verify_max_feature_floats: int = Field(default=8_000_000, gt=0)
    #: More SGLang flags. Refused: ``--host``/``--port`` (the launcher binds 127.0.0.1 on
    #: ``sglang.port``), parallel sizes above 1 (one GPU per server), and in native mode
    #: ``--enable-mixed-chunk`` and DP attention (``launcher.check_extra_args``).
    extra_args: List[str] = Field(default_factory=list)
    #: Module run as ``python -m MODULE`` (the test stand-in replaces SGLang's own).
    launch_module: str = "sglang.launch_server"
    #: Port of a launched server; None picks a free one on 127.0.0.1.
    port: Optional[int] = Field(default=None, gt=0, lt=65536)
    #: Retries per request on a transient error (connection refused, timeout, HTTP 5xx).
    max_retries: int = Field(default=4, ge=0)
    backoff_s: float = Field(default=0.5, ge=0.0)
    #: Restart a launched server once if it dies mid-run.
    restart_on_death: bool = True
    #: Server log file; None = <output.dir>/sglang_server.log.
    log_file: Optional[str] = None


class OutputConfig(Section):
    dir: str = "runs/default"
    tensorboard: bool = True
    wandb_project: Optional[str] = None


class ExperimentConfig(Section):
    """The whole experiment. Sections may be omitted in YAML (defaults apply)."""

    name: str = "experiment"
    target: TargetConfig = Field(default_factory=TargetConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    opd: OPDConfig = Field(default_factory=OPDConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    #: Directory the YAML came from; relative paths in the config resolve against the repo root.
    source_file: Optional[str] = None

    def resolve_path(self, p: Optional[str]) -> Optional[Path]:
        """Resolve a config path: absolute as is; relative against the current directory;
        ``published:NAME`` to a drafter shipped in the package (``specforge_opd.models.published``).

        Raises:
            ConfigError: ``published:NAME`` names no published drafter.
        """
        if p is None:
            return None
        if str(p).startswith(SCHEME):
            try:
                return resolve(str(p))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return Path(os.path.expanduser(p)).resolve()


# ---------------------------------------------------------------------------
# loading


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_valid_keys(ann, dotted + "."))
    return keys


def _initials(name: str) -> str:
    """The first letters of ``name``'s ``_``-separated words (``lr`` for ``learning_rate``)."""
    return "".join(w[:1] for w in name.split("_"))


def _near_leaves(leaf: str, names: list[str]) -> list[str]:
    """Field names near ``leaf``, nearest kind first: the same initials, ``leaf`` as a prefix, a
    close spelling, then looser spellings only when nothing else matched."""
    if not leaf:
        return []
    found = [x for x in names if _initials(x) == leaf]
    found += [x for x in names if x.startswith(leaf) and x not in found]
    found += [x for x in difflib.get_close_matches(leaf, names, n=3, cutoff=0.6) if x not in found]
    return found or difflib.get_close_matches(leaf, names, n=3, cutoff=0.5)


def _suggest(bad: str) -> str:
    """The nearest valid keys to the unknown dotted key ``bad``, as `` (did you mean `KEY`?)``
    (up to three, nearest kind first), or ''.

    A key under a known section is matched by its last name among that section's own fields,
    then among every section's fields (``opd.lr`` -> ``training.learning_rate``); it is never
    answered with a section's own name. An unknown top-level name (a misspelled section: pydantic
    reports the section, not the dotted key under it) is matched against every key."""
    keys = _valid_keys(ExperimentConfig)
    if "." not in bad:
        close = difflib.get_close_matches(bad, keys, n=1, cutoff=0.6)
        return f" (did you mean `{close[0]}`?)" if close else ""
    section, leaf = bad.rsplit(".", 1)
    depth = section.count(".") + 1
    own = [k.rsplit(".", 1)[1] for k in keys if k.startswith(section + ".") and k.count(".") == depth]
    close = [f"{section}.{x}" for x in _near_leaves(leaf, own)]
    if not close:  # every section's fields; a name several sections share is offered in each
        dotted = [k for k in keys if "." in k]
        names = list(dict.fromkeys(k.rsplit(".", 1)[1] for k in dotted))
        close = [k for x in _near_leaves(leaf, names) for k in dotted if k.rsplit(".", 1)[1] == x]
    if not close:
        return ""
    names = [f"`{x}`" for x in close[:3]]
    return f" (did you mean {', '.join(names[:-1]) + ' or ' + names[-1] if len(names) > 1 else names[0]}?)"


def _format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        dotted = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key `{dotted}`{_suggest(dotted)}")
        else:
            lines.append(f"{where}: `{dotted}`: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML (so `1e-4`, `true`, `[1,2]` work)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set ``data[a][b] = value`` for ``dotted = "a.b"``, creating sections as needed."""
    parts = dotted.split(".")
    cur = data
    for p in parts[:-1]:
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override `{dotted}`: `{p}` is not a section")
        cur = nxt
    cur[parts[-1]] = value


def load_config(
    path: Optional[str | os.PathLike],
    overrides: Optional[list[str]] = None,
    flags: Optional[dict[str, Any]] = None,
) -> ExperimentConfig:
    """Load an experiment YAML, apply ``section.field=value`` overrides, then flag shorthands.

    Precedence: YAML < overrides < flags (``flags`` maps dotted keys to values,
    e.g. ``{"output.dir": "runs/x"}`` for ``--out``; None values are ignored).

    Raises:
        ConfigError: missing/unreadable file, YAML syntax error, malformed
            override, unknown key (with the nearest valid key), or wrong type.
    """
    data: dict = {}
    where = "<defaults>"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (pass -c with a YAML under configs/)")
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"config file {p} is unreadable: {e}") from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: YAML syntax error: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
        data.setdefault("source_file", str(p.resolve()))
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override `{ov}` must look like section.field=value")
        key, val = ov.split("=", 1)
        apply_override(data, key.strip(), _parse_value(val))
    if overrides:
        where = f"{where} + overrides"
    for key, val in (flags or {}).items():
        if val is not None:
            apply_override(data, key, val)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None


def dump_config(cfg: ExperimentConfig) -> str:
    """The resolved config as YAML (what ``specforge-opd config`` prints)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
