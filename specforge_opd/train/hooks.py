"""Callbacks into the trainer and the OPD stage's rollout phase, for tests and tooling."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainHooks:
    """Test and tooling hooks; the default does nothing.

    ``train.trainer.distill`` and ``stages.opd.run_opd`` take one as ``hooks=`` (None:
    this no-op default). Subclass it and override the methods needed: tests inject a
    simulated kill (an exception) to check resume, or read the gradients of each step.
    An exception raised by a hook propagates out of ``distill`` / ``run_opd`` as it is.
    """

    def after_shard(self, shards: int) -> None:
        """A rollout shard was written; ``shards``: how many this rollout phase has written so far (1-based)."""

    def on_gradients(self, step: int, drafter) -> None:
        """On every rank, after the backward passes of step ``step`` (1-based, as in the metrics), before clipping.

        ``drafter``: the trained module (FSDP2-sharded under torchrun: ``p.grad`` may be a
        DTensor, ``full_tensor()`` gathers it); its gradients must not be modified.
        """

    def after_step(self, step: int, total: int, steps_run: int) -> None:
        """After step ``step`` of ``total`` (1-based) is done: logged, and checkpointed when due.

        ``steps_run``: the steps this ``distill`` call has run (a resumed call starts at 0).
        """
