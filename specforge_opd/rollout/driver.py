"""One rollout loop for every backend: resume from the shards written, roll out the rest, count (DESIGN.md section 5).

``drive`` is what ``specforge-opd rollout`` and each OPD iteration's rollout phase run. It finds the
sequences already in complete shards of the writer's directory (``shards.written_sample_ids``), hands
the rest to a ``RolloutBackend``, and follows the shards as they are written (progress bar with the
running tau, the caller's ``on_write``). The backend is chosen once, from ``rollout.backend``, by
``stages.rollout.make_backend``: ``EmbeddedBackend`` here (the in-process ``SpeculativeEngine``), or
SGLang's verify and native modes (``sglang.rollout_backend.SGLangBackend``). A new server (vLLM, say)
implements ``RolloutBackend`` and adds one branch there.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from specforge_opd.progress import progress_bar
from specforge_opd.rollout.engine import SpeculativeEngine
from specforge_opd.rollout.records import RolloutRecord, tau_of
from specforge_opd.rollout.shards import InOrderShards, ShardWriter, written_sample_ids

#: (sample id, prompt token ids): one prompt as every backend takes it
Prompt = tuple[str, list[int]]
OnWrite = Callable[[list[RolloutRecord]], None]


class RolloutBackend(Protocol):
    """What rolls prompts out into shards.

    ``name`` is the ``rollout.backend`` value it serves (for messages). ``roll_out`` rolls out every
    prompt it is given (none of them written yet) and writes the records with ``writer.write`` in
    groups (one shard each), calling ``on_write(records)`` after each shard. ``skipped`` lists the
    sample ids of the last ``roll_out`` that were left out (prompts over the context limit with
    ``target.too_long=skip``).
    """

    name: str

    @property
    def skipped(self) -> Sequence[str]: ...

    def roll_out(self, prompts: list[Prompt], writer: ShardWriter, *, drafter_step: int, on_write: OnWrite) -> None: ...


class EmbeddedBackend:
    """The in-process target and drafter (``engine.SpeculativeEngine``): one continuous batch of
    ``batch_size`` rows over the prompts, written as shards of ``per`` sequences in prompt order
    (``shards.InOrderShards``, so a resumed run writes the shards an uninterrupted one would)."""

    name = "embedded"

    def __init__(self, engine: SpeculativeEngine, *, per: int, batch_size: Optional[int]):
        self.engine, self.per, self.batch_size = engine, int(per), batch_size

    @property
    def skipped(self) -> Sequence[str]:
        return self.engine.skipped

    def roll_out(self, prompts: list[Prompt], writer: ShardWriter, *, drafter_step: int, on_write: OnWrite) -> None:
        shards = InOrderShards(writer, [s for s, _ in prompts], self.per, skipped=lambda: self.engine.skipped,
                               on_write=on_write)
        self.engine.generate([p for _, p in prompts], [s for s, _ in prompts], drafter_step=drafter_step,
                             batch_size=self.batch_size, on_record=shards.add)
        shards.close()


@dataclass
class Driven:
    """What one ``drive`` call did. Counts cover the sequences rolled out by this call, not those found written.

    Attributes: prompts (given), resumed (already in complete shards, not rolled out again), sequences,
    completion_tokens, verify_steps (blocks), shards (written now), skipped (too long, left out),
    seconds (wall time of the call).
    """

    prompts: int
    resumed: int
    sequences: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    shards: int = 0
    skipped: int = 0
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Accepted length of this call's sequences: completion tokens per verify step (0.0 when none ran)."""
        return self.completion_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Completion tokens per second of this call; None when nothing was rolled out."""
        return self.completion_tokens / self.seconds if self.seconds > 0 and self.completion_tokens else None


def drive(backend: RolloutBackend, prompts: list[Prompt], writer: ShardWriter, *, drafter_step: int = 0,
          on_write: Optional[OnWrite] = None, quiet: bool = False) -> Driven:
    """Roll out the ``prompts`` that ``writer``'s directory does not hold yet, through ``backend``.

    A rerun into the same directory resumes: the writer has verified the shards there (a damaged one
    is moved aside, ``shards.heal_shards``), and sequences in complete shards are not rolled out again.
    ``on_write(records)`` is called after each shard written (after the bar's update); ``quiet``
    hides the bar and the resume line (ranks other than 0).

    Raises:
        whatever the backend raises on bad input (``engine.RolloutError``, the SGLang client's errors);
        the shards written before the error stay.
    """
    done = written_sample_ids(writer.dir)
    todo = [p for p in prompts if p[0] not in done]
    run = Driven(prompts=len(prompts), resumed=len(prompts) - len(todo))
    if run.resumed and not quiet:
        print(f"rollout: resuming in {writer.dir}: {run.resumed} of {len(prompts)} sequences already written",
              file=sys.stderr)
    t0 = time.perf_counter()
    bar = progress_bar(len(prompts), "rollout", "seq", initial=run.resumed, disable=quiet)
    window: list = []  # the last sequences written, for the bar's tau

    def written(recs: list[RolloutRecord]) -> None:
        run.sequences += len(recs)
        run.completion_tokens += sum(r.completion_tokens for r in recs)
        run.verify_steps += sum(r.num_blocks for r in recs)
        run.shards += 1
        window.extend(recs[-64:])
        del window[:-64]
        bar.update(len(recs))
        bar.set_postfix(tau=f"{tau_of(window):.2f}", refresh=False)
        if on_write is not None:
            on_write(recs)

    try:
        if todo:
            backend.roll_out(todo, writer, drafter_step=drafter_step, on_write=written)
    finally:
        bar.close()
    run.skipped = len(backend.skipped or ()) if todo else 0
    run.seconds = time.perf_counter() - t0
    return run
