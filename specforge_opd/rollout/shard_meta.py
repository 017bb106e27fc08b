"""The shard meta: what a rollout's shards were produced with, built in one place for every rollout driver,
and the check that shards may share a directory (``rollout.shards`` module docstring).

Standard library only (with the ground-layer config types), so the SGLang plugin and the shard reader can
both use it without loading safetensors here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from specforge_opd.teacher_form import TeacherForm

#: The meta keys that shards in one directory must agree on: a trainer reading them mixes their tensors.
COMPAT_KEYS = ("block_size", "target_layer_ids", "target_identity", "mask_token_id", "target_dtype")


@dataclass(frozen=True)
class ShardMeta:
    """The meta every shard of a rollout carries (in its safetensors metadata and the directory's manifest).

    Attributes:
        target_identity: ``models.target.target_identity`` of the target that verified and scored.
        drafter_identity: the drafter's path or published name.
        drafter_step: the optimizer step of the drafter that proposed (0 for the start).
        block_size: the drafter's block size (anchor plus ``block_size - 1`` drafted tokens).
        target_layer_ids: the target layers whose hidden states feed the drafter.
        mask_token_id: the drafter's mask token.
        temperature, top_p, top_k: the target's sampler.
        seed: the sampler seed of this rollout (``rollout.seed`` plus the OPD iteration).
        teacher: the stored teacher form.
        anchors: ``real`` (the drafter's own blocks) or ``random``.
        features: whether target features are stored.
        thinking: the chat template's thinking switch.
        target_dtype: the target's dtype.
        iteration: the OPD iteration; None (left out of the dict) for a standalone ``rollout``.
    """

    target_identity: str
    drafter_identity: str
    drafter_step: int
    block_size: int
    target_layer_ids: Any
    mask_token_id: Any
    temperature: float
    top_p: float
    top_k: int
    seed: int
    teacher: TeacherForm
    anchors: str
    features: bool
    thinking: bool
    target_dtype: str
    iteration: Optional[int] = None

    @classmethod
    def of_rollout(cls, cfg, *, target_identity: str, drafter_identity: str, drafter_step: int, block_size: int,
                   target_layer_ids, mask_token_id, iteration: Optional[int] = None) -> "ShardMeta":
        """The meta of a rollout under experiment config ``cfg`` (its ``rollout`` and ``target`` sections);
        an OPD iteration offsets the sampler seed by its index, so every refresh draws afresh."""
        r = cfg.rollout
        return cls(target_identity=target_identity, drafter_identity=drafter_identity, drafter_step=drafter_step,
                   block_size=block_size, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                   temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed + (iteration or 0),
                   teacher=r.teacher, anchors=r.anchors, features=r.store_features, thinking=cfg.target.thinking,
                   target_dtype=cfg.target.dtype, iteration=iteration)

    def to_dict(self) -> dict:
        """The JSON form the shard files and manifest store (keys in their historical order)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("iteration", "target_dtype")}
        if self.iteration is not None:
            out["iteration"] = self.iteration
        out["target_dtype"] = self.target_dtype
        return out


def compat_problems(have: dict, want: dict) -> list[str]:
    """The ``COMPAT_KEYS`` on which two metas (dicts) disagree, as ``key=have (expected want)``; a key missing
    from either side, or None in ``want``, is not compared."""
    out = []
    for k in COMPAT_KEYS:
        if k in want and want[k] is not None and k in have and have[k] != want[k]:
            out.append(f"{k}={have[k]!r} (expected {want[k]!r})")
    return out
