"""The rollout stage (``specforge-opd rollout``) and the one place that picks a backend from ``rollout.backend``.

``make_backend`` turns the config into a ``rollout.driver.RolloutBackend``: the in-process engine
(``embedded``) or SGLang (``sglang_verify``, ``sglang_native``); ``response_generator`` does the same for
the SFT stage's plain target responses. ``run_rollout`` is the verb: load target, drafter and prompts,
drive one pass into shards (``rollout.driver.drive``), resumable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from specforge_opd.config import ExperimentConfig
from specforge_opd.data import prompts as prompts_mod
from specforge_opd.data.chat import render_prompt
from specforge_opd.models import target as target_mod
from specforge_opd.models.drafter import drafter_mask_token_id, load_drafter
from specforge_opd.rollout.driver import EmbeddedBackend, RolloutBackend, drive
from specforge_opd.rollout.engine import RolloutError, SpeculativeEngine
from specforge_opd.rollout.shard_meta import ShardMeta
from specforge_opd.rollout.shards import ShardWriter


def make_backend(cfg: ExperimentConfig, bundle, engine: SpeculativeEngine, *, per: int, draft_path: Optional[str],
                 log_dir: Path) -> RolloutBackend:
    """The backend ``cfg.rollout.backend`` names, rolling out with ``engine``'s drafter.

    ``per``: sequences per shard of the embedded backend, which decodes ``rollout.batch_size`` rows at
    once (SGLang writes ``rollout.sequences_per_shard``). ``draft_path``: the drafter's directory (a
    launched native-mode server loads it). ``log_dir``: a launched server's log.

    Raises:
        ValueError: a backend this build does not know (the config's schema refuses it first).
    """
    backend = cfg.rollout.backend
    if backend == "embedded":
        return EmbeddedBackend(engine, per=per, batch_size=cfg.rollout.batch_size)
    if backend in ("sglang_verify", "sglang_native"):
        # lazy: the SGLang client needs the optional ``sglang`` extra (aiohttp), which embedded runs do without
        from specforge_opd.sglang.rollout_backend import SGLangBackend

        return SGLangBackend(cfg, bundle, engine.drafter, draft_path=draft_path, log_dir=log_dir)
    raise ValueError(f"rollout.backend={backend!r}: use embedded, sglang_verify or sglang_native")


def response_generator(cfg: ExperimentConfig) -> Optional[Callable[..., list[list[int]]]]:
    """How the SFT stage's target responses are generated: None for the embedded target
    (``responses.generate_responses`` decodes in process), else SGLang's ``/generate`` at ``sglang.urls``
    (``sglang.generate.sglang_generate`` with the prompts, ``sample_ids`` and the sampling keywords)."""
    if cfg.rollout.backend == "embedded":
        return None
    # lazy: the SGLang client needs the optional ``sglang`` extra (aiohttp), which embedded runs do without
    from specforge_opd.sglang.generate import sglang_generate

    def remote(prompts: list[list[int]], **kw) -> list[list[int]]:
        return sglang_generate(cfg.sglang.urls, prompts, timeout_s=cfg.sglang.request_timeout_s, **kw)

    return remote


def _pool_prompts(cfg: ExperimentConfig, tokenizer) -> list[tuple[str, list[int]]]:
    """The training pool as (id, token ids), rendered with the target's chat template."""
    out = []
    for pr in prompts_mod.training_pool(cfg.data, tokenizer=tokenizer):
        text = render_prompt(tokenizer, pr.chat_messages(), thinking=cfg.target.thinking, system_prompt=cfg.target.system_prompt)
        out.append((str(pr.id), tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def run_rollout(cfg: ExperimentConfig, out_dir, drafter_step: int = 0, prompts=None) -> int:
    """Load target, drafter and prompts from ``cfg``, roll out every prompt, write shards to ``out_dir``.

    ``prompts``: (id, token ids) pairs; None renders the training pool (``data``) with the target's chat
    template. The embedded backend writes shards of ``rollout.sequences_per_shard`` sequences. A rerun
    into the same ``out_dir`` resumes: its shards are verified (a damaged one is moved aside,
    ``shards.heal_shards``) and the sequences they hold are not rolled out again. Returns 0.

    Raises:
        RolloutError: no drafter path (draft.path) or a bad prompt.
    """
    if cfg.draft.path is None:
        raise RolloutError("draft.path is not set: pass the drafter to roll out with (draft.path=DIR)")
    bundle = target_mod.load_target(cfg.target)  # through the module: tests patch it there
    draft_path = str(cfg.resolve_path(cfg.draft.path))
    drafter = load_drafter(draft_path, target_config=bundle.model.config, target_dtype=cfg.target.dtype)
    drafter = drafter.to(next(bundle.model.parameters()).device)
    mask = cfg.draft.mask_token_id if cfg.draft.mask_token_id is not None else drafter_mask_token_id(drafter)
    stops = sorted(set(bundle.stop_token_ids) | set(cfg.target.stop_token_ids))
    engine = SpeculativeEngine(
        bundle.model, drafter, cfg.rollout, stop_token_ids=stops, mask_token_id=mask,
        max_context=cfg.target.max_context, too_long=cfg.target.too_long, prefill_chunk=cfg.target.prefill_chunk,
    )
    if prompts is None:
        prompts = _pool_prompts(cfg, bundle.tokenizer)
    meta = ShardMeta.of_rollout(cfg, target_identity=bundle.identity, drafter_identity=str(cfg.draft.path),
                                drafter_step=int(drafter_step), block_size=engine.block_size,
                                target_layer_ids=engine.layer_ids, mask_token_id=mask)
    writer = ShardWriter(out_dir, meta)
    backend = make_backend(cfg, bundle, engine, per=cfg.rollout.sequences_per_shard, draft_path=draft_path,
                           log_dir=Path(out_dir))
    run = drive(backend, prompts, writer, drafter_step=drafter_step)
    print(f"rollout ({backend.name}): {run.sequences} sequences, {run.completion_tokens} completion tokens, "
          f"{run.verify_steps} verify steps, tau={run.tau:.3f}, {run.skipped} skipped (too long) -> {out_dir}")
    return 0
