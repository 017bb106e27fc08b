"""The drafter an experiment config asks for: its mask token and its target-derived HF config.

``resolve_mask_token_id`` picks ``dflash_config.mask_token_id`` (DESIGN.md section 3,
"Mask token"); ``make_draft_config`` derives the drafter's ``Qwen3Config`` from the
target's config and the ``draft`` section (``drafter.derive_draft_config``);
``draft_config_dict`` is that config as the plain dict SFT writes and keys its train step on.
"""

from __future__ import annotations

from specforge_opd.config import ConfigError, ExperimentConfig
from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID
from specforge_opd.models.adapter import specforge_resolve_mask_token_id
from specforge_opd.models.drafter import DrafterError, derive_draft_config


def resolve_mask_token_id(cfg: ExperimentConfig, target_config, tokenizer=None) -> int:
    """The drafter's ``dflash_config.mask_token_id`` (DESIGN.md section 3, "Mask token").

    Embedded target: ``assets.EMBEDDED_MASK_TOKEN_ID`` (engineer A's documented
    choice for SmolLM2) unless ``draft.mask_token_id`` overrides it. Other
    targets: ``draft.mask_token_id``, else SpecForge's own resolution (the
    tokenizer's mask token, then the first embedding row past the tokenizer,
    e.g. 151669 for Qwen3), refusing a token that chat text produces (eos/stop).

    Raises:
        ConfigError: no safe id can be found; set ``draft.mask_token_id``.
    """
    if cfg.draft.mask_token_id is not None:
        return int(cfg.draft.mask_token_id)
    if cfg.target.path is None:
        return int(EMBEDDED_MASK_TOKEN_ID)
    if tokenizer is None:
        raise ConfigError(
            "draft.mask_token_id is not set and the target tokenizer is not loaded (dry run); "
            "set draft.mask_token_id (Qwen3: 151669, the first embedding row past the tokenizer)"
        )
    vocab = int(getattr(target_config, "text_config", target_config).vocab_size)
    mask = specforge_resolve_mask_token_id(explicit=None, tokenizer=tokenizer, embedding_vocab_size=vocab)
    produced = {tokenizer.eos_token_id, *list(cfg.target.stop_token_ids)}
    if mask in produced:
        raise ConfigError(
            f"SpecForge's mask-token resolution picked {mask}, a token the target emits (eos/stop); "
            "set draft.mask_token_id to an embedding row chat text never produces"
        )
    return int(mask)


def make_draft_config(cfg: ExperimentConfig, target_config, mask_token_id: int):
    """The drafter's HF config (a ``Qwen3Config``) derived from the target (``drafter.derive_draft_config``)
    with the ``draft`` section's layers, block size, layer ids and MLP width.

    Raises:
        ConfigError: a layer id outside the target, or a mask id outside its vocabulary.
    """
    try:
        return derive_draft_config(
            target_config,
            num_hidden_layers=cfg.draft.num_hidden_layers,
            block_size=cfg.draft.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=cfg.draft.target_layer_ids,
            intermediate_size=cfg.draft.intermediate_size,
        )
    except DrafterError as e:
        raise ConfigError(str(e)) from None


def draft_config_dict(draft_config) -> dict:
    """``draft_config.to_dict()`` without the fields that name a transformers install or a path
    (``transformers_version``, ``_name_or_path``, ``auto_map``), ``dtype`` as a name: the JSON the SFT
    stage writes for SpecForge and hashes into its train key."""
    d = draft_config.to_dict()
    for k in ("transformers_version", "_name_or_path", "auto_map"):
        d.pop(k, None)
    if "dtype" in d and not isinstance(d["dtype"], (str, type(None))):
        d["dtype"] = str(d["dtype"]).replace("torch.", "")
    return d
