"""Fault injection and gradient capture for the trainer and OPD tests, through ``train.hooks.TrainHooks``."""

from dataclasses import dataclass
from typing import Callable, Optional

from specforge_opd.train.hooks import TrainHooks


class InjectedFault(RuntimeError):
    """A simulated kill, raised by ``FaultHooks``: for resume tests."""


@dataclass
class FaultHooks(TrainHooks):
    """``distill(hooks=...)`` / ``run_opd(hooks=...)`` for tests.

    after_shards: raise ``InjectedFault`` once a rollout phase has written that many shards.
    after_steps: raise ``InjectedFault`` once one ``distill`` call has run that many steps
        (not after the last step of the call: that one finishes normally).
    gradients: ``fn(step, drafter)`` called on every rank after the backward passes of a step.
    """

    after_shards: Optional[int] = None
    after_steps: Optional[int] = None
    gradients: Optional[Callable] = None

    def after_shard(self, shards: int) -> None:
        if self.after_shards is not None and shards >= self.after_shards:
            raise InjectedFault(f"injected fault in the rollout phase after {shards} shards")

    def on_gradients(self, step: int, drafter) -> None:
        if self.gradients is not None:
            self.gradients(step, drafter)

    def after_step(self, step: int, total: int, steps_run: int) -> None:
        if self.after_steps is not None and steps_run >= self.after_steps and step < total:
            raise InjectedFault(f"injected fault after step {step}")
