"""The one base class of user-facing errors, and the disk-full error every writer raises.

A ``UserError`` is a fault of the input (config, paths, files on disk, the machine's
resources), not of the program: ``specforge_opd.cli.main`` prints its message as one
line on stderr and exits with code 2, for every verb. Its message names the field or
file and the fix. Any other exception keeps its traceback.

This module sits at the ground level of the package: it imports nothing of it.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

#: Exit code of a user error (argparse uses 2 for bad arguments too).
USER_ERROR_EXIT = 2

#: Substrings by which writers that hide the errno (safetensors' Rust writer, torch's
#: zip writer after a short write) report a full disk.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "unexpected pos")


class UserError(Exception):
    """Bad input or a fault of the environment; the message (one line) names the field or file and the fix."""


class DiskFullError(UserError, OSError):
    """Writing ``path`` failed because its filesystem is full (errno ``ENOSPC``).

    Also an ``OSError`` (errno ``ENOSPC``, filename ``path``), so callers that handle
    write failures keep working. The writer has removed its partial output before raising.
    """

    def __init__(self, path, detail: str = ""):
        self.path = str(path)
        more = f" ({detail})" if detail else ""
        self.message = (f"{self.path}: no space left on device{more}; nothing partial was kept and earlier "
                        f"output is intact: free space (or set output.dir on a larger disk) and rerun the same command")
        OSError.__init__(self, errno.ENOSPC, self.message, self.path)

    def __str__(self) -> str:
        return self.message


def is_disk_full(exc: Optional[BaseException]) -> bool:
    """True when ``exc`` or an exception it was raised from or during means a full disk.

    Looks for ``OSError`` errno ``ENOSPC``/``EDQUOT`` along ``__cause__``/``__context__``, and
    for the texts by which safetensors and torch's zip writer report it without an errno.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            return True
        if any(t in str(exc) for t in _DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def process_umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def one_line(message: str) -> str:
    """``message`` on one line: its non-empty lines joined with ``; ``."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
