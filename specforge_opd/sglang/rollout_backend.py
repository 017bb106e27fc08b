"""``rollout.backend: sglang_verify | sglang_native`` behind ``specforge-opd rollout`` (DESIGN.md section 5).

Connects to ``sglang.urls`` or launches one server for the configured target,
then rolls out the prompts not yet in the shard directory, one shard per group
(``rollout.sequences_per_shard``): a server that dies mid-rollout is restarted
once by the launcher, and a rerun resumes from the shards already written.

GPU memory: a launched server loads its own copy of the target, so the
in-process target leaves the GPU for the rollout (``sglang.offload_target``;
verify mode keeps the embedding and lm_head, which the drafter uses) and comes
back for training; ``sglang.mem_fraction_static`` (default: set from the memory
free at launch, leaving ``sglang.gpu_reserve_gb``) sets the server's share of
what is left. Under torchrun each rank's server gets the rank's own GPU
(``launcher.rank_gpu_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Iterable

import torch

from specforge_opd.config import ExperimentConfig, SGLangConfig
from specforge_opd.models.drafter import drafter_layer_ids
from specforge_opd.rollout.driver import OnWrite, Prompt
from specforge_opd.rollout.shards import ShardWriter
from specforge_opd.sglang.contract import server_layer_ids
from specforge_opd.sglang.launcher import Endpoints, SGLangServer, check_extra_args, mode_env, rank_gpu_env, server_args
from specforge_opd.sglang.native import native_rollout_async
from specforge_opd.sglang.sizing import launch_mem_fraction, startup_timeout_for
from specforge_opd.sglang.speculate import Drafter
from specforge_opd.sglang.verify_client import check_verify_feature_size, check_verify_settings, verify_rollout_to_shards


@contextlib.contextmanager
def endpoints_for(cfg: ExperimentConfig, *, mode: str, model_path: str, layer_ids: list[int], block_size: int,
                  draft_path: str | None, log_dir: Path, num_target_layers: int | None = None):
    """``Endpoints`` over ``sglang.urls``, or over a server launched (and stopped) here on this rank's GPU."""
    if cfg.sglang.urls:
        yield Endpoints.connect(cfg.sglang.urls, timeout_s=startup_timeout_for(cfg.sglang), mode=mode)
        return
    scfg = launch_config(cfg.sglang, mode)

    def args(port):
        return server_args(scfg, model_path=model_path, port=port, mode=mode, target_layer_ids=layer_ids,
                           draft_path=draft_path, block_size=block_size, dtype=cfg.target.dtype,
                           num_target_layers=num_target_layers)

    env = {**rank_gpu_env(), **mode_env(mode)}
    with SGLangServer(scfg, args, log_path=log_dir / f"sglang-{mode}.log", env=env, require_plugin=mode == "native",
                      startup_timeout_s=startup_timeout_for(scfg, model_path, draft_path)) as server:
        yield Endpoints.launched([server])


def launch_config(scfg: SGLangConfig, mode: str) -> SGLangConfig:
    """``scfg`` with what a launch here resolves: ``mem_fraction_static`` from the GPU memory free now
    (``sizing.launch_mem_fraction``, after the target left the GPU).

    Raises:
        ValueError: a refused flag in ``sglang.extra_args`` (``launcher.check_extra_args``), or too little
            free GPU memory for ``sglang.gpu_reserve_gb`` (``sizing.mem_fraction_for``).
    """
    check_extra_args(scfg.extra_args, mode)
    return scfg.model_copy(update={"mem_fraction_static": launch_mem_fraction(scfg)})


@contextlib.contextmanager
def target_off_gpu(model: torch.nn.Module, keep: Iterable[torch.nn.Module] = (), enabled: bool = True):
    """Move ``model`` to the CPU for the duration, except the modules in ``keep``; then back.

    A no-op for a model not on a CUDA device. Tied weights stay tied (a kept
    module's parameters move back with it).
    """
    dev = next(model.parameters()).device
    if not enabled or dev.type != "cuda":
        yield
        return
    model.to("cpu")
    for m in keep:
        m.to(dev)
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        model.to(dev)


def tconf_of(model):
    """The text model's config of ``model`` (a multimodal config's ``text_config``)."""
    return getattr(model.config, "text_config", model.config)


class SGLangBackend:
    """``rollout.backend: sglang_verify | sglang_native`` as a ``rollout.driver.RolloutBackend``.

    Args:
        cfg: the run's config (``rollout``, ``sglang``, ``target.dtype``, ``training.feature_source``).
        bundle: the loaded ``TargetBundle`` (verify mode drafts with its embedding and lm_head).
        drafter: the DFlash drafter (verify mode drafts with it here; native mode reads its layer ids
            and block size, and the server loads ``draft_path``).
        draft_path: the drafter's directory, which a launched native-mode server loads.
        log_dir: where a launched server's log goes.
    """

    skipped: tuple = ()  # SGLang does not apply target.too_long: nothing is skipped

    def __init__(self, cfg: ExperimentConfig, bundle, drafter, *, draft_path: str | None, log_dir: Path):
        self.name = cfg.rollout.backend
        self.cfg, self.bundle, self.drafter, self.draft_path, self.log_dir = cfg, bundle, drafter, draft_path, Path(log_dir)

    def roll_out(self, prompts: list[Prompt], writer: ShardWriter, *, drafter_step: int, on_write: OnWrite) -> None:
        sglang_rollout(self.cfg, self.bundle, self.drafter, prompts, writer, drafter_step=drafter_step,
                       draft_path=self.draft_path, out_dir=self.log_dir, on_write=on_write)


def sglang_rollout(cfg: ExperimentConfig, bundle, drafter, prompts: list[tuple[str, list[int]]], writer, *,
                   drafter_step: int, draft_path: str | None, out_dir: Path, on_write: OnWrite | None = None) -> int:
    """Roll out every one of ``prompts`` through SGLang into ``writer`` (a ``shards.ShardWriter``); returns
    sequences written. The caller (``rollout.driver.drive``) has left out the sequences already written.

    One shard per ``rollout.sequences_per_shard`` sequences; ``on_write(records)`` after each.

    Raises:
        ValueError: a setting the mode cannot honour (names the field).
        ServerError / ContractError: the server failed to start or answered outside the contract.
    """
    def write(recs):
        writer.write(recs)
        if on_write is not None:
            on_write(recs)

    rc = cfg.rollout
    layer_ids = drafter_layer_ids(drafter)
    bs = int(drafter.block_size)
    mode = "verify" if rc.backend == "sglang_verify" else "native"
    if mode == "verify":
        check_verify_settings(rc.temperature, rc.teacher, cfg.training.feature_source)
        # before a server starts (minutes at the paper's size): a prefill too large to travel as JSON
        check_verify_feature_size(prompts, len(server_layer_ids(layer_ids)) * int(tconf_of(bundle.model).hidden_size), cfg.sglang)
    model = bundle.model
    tconf = tconf_of(model)
    keep = (model.get_input_embeddings(), model.get_output_embeddings()) if mode == "verify" else ()
    with target_off_gpu(model, keep, enabled=cfg.sglang.offload_target), endpoints_for(
        cfg, mode=mode, model_path=str(bundle.path), layer_ids=layer_ids, block_size=bs, draft_path=draft_path,
        log_dir=out_dir, num_target_layers=int(tconf.num_hidden_layers),
    ) as ep:
        if mode == "verify":
            d = Drafter(drafter, model.get_input_embeddings(), model.get_output_embeddings())
            return verify_rollout_to_shards(
                ep, d, prompts, sglang_cfg=cfg.sglang, sequences_per_shard=rc.sequences_per_shard, write_shard=write,
                max_new_tokens=rc.max_new_tokens, stop_token_ids=list(bundle.stop_token_ids), teacher=rc.teacher,
                teacher_topk=rc.teacher_topk, feature_dim=len(layer_ids) * int(tconf.hidden_size), drafter_step=drafter_step,
                layer_ids=layer_ids,
            )
        n = 0
        for i in range(0, len(prompts), rc.sequences_per_shard):
            group = prompts[i : i + rc.sequences_per_shard]
            recs = asyncio.run(native_rollout_async(
                ep, group, sglang_cfg=cfg.sglang, block_size=bs, max_new_tokens=rc.max_new_tokens,
                stop_token_ids=list(bundle.stop_token_ids), teacher=rc.teacher, temperature=rc.temperature,
                drafter_step=drafter_step,
            ))
            write(recs)
            n += len(recs)
        return n
