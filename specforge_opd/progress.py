"""Progress bars for long work, readable on a terminal and in a log file.

Every long step (responses, features, rollouts, distillation, trajectory caches, offline
replay) shows a tqdm bar. On a terminal it is tqdm's live bar. Where stderr is not a
terminal (a job whose output goes to a log, as the benchmarks and ``nohup`` runs do), tqdm
would either hide the bar (``disable=None``) or write carriage-return updates that a log
shows as one endless line; here it writes one plain line at most every
``LOG_INTERVAL_S`` seconds instead, so ``tail`` of a log says how far a job is and when it
ends.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

from tqdm import tqdm

#: Seconds between two progress lines in a log (stderr not a terminal).
LOG_INTERVAL_S = 30.0


_CURSOR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Lines:
    """A text stream for tqdm that turns its redraws (carriage returns, cursor moves of nested bars) into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        s = _CURSOR.sub("", s.replace("\r", "")).strip()
        if s:
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: Optional[int], desc: str, unit: str = "it", *, initial: int = 0, disable: bool = False,
                 log: bool = True, leave: bool = True) -> tqdm:
    """A tqdm bar over ``total`` units of ``unit``, starting at ``initial`` (work already done).

    ``disable`` hides it everywhere (for example on ranks other than 0); ``log=False`` hides
    it only where stderr is not a terminal (an inner bar whose outer bar already reports).
    In a log the bar writes one line per ``LOG_INTERVAL_S`` seconds and a last one at close.

    Returns:
        The tqdm bar (``update``, ``set_postfix``, ``close``; usable as a context manager).
    """
    tty = sys.stderr.isatty()
    if tty:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=disable, leave=leave, dynamic_ncols=True)
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=disable or not log, leave=True,
                file=_Lines(sys.stderr), mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S * 4, ncols=100)
