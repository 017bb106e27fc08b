"""Atomic file writes: temporary name in the same directory, fsync, rename, fsync the directory.

Every writer of the project goes through here, so a kill or a full disk never
leaves a half-written file under its final name (DESIGN.md: "nothing already
written is lost").
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable (a no-op where the filesystem refuses)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` by ``write(f)`` on a temporary file, then rename it into place.

    Raises whatever ``write`` raises (e.g. ``OSError(ENOSPC)``): the temporary
    file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, write: Optional[Callable[[BinaryIO, bytes], None]] = None) -> None:
    """Atomically write ``data`` to ``path`` (``write(f, data)`` overrides the plain ``f.write``)."""
    atomic_write(path, (lambda f: write(f, data)) if write is not None else (lambda f: f.write(data)))


def atomic_write_text(path: Path, text: str) -> None:
    """Atomically write UTF-8 ``text`` to ``path``."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any, **dumps_kwargs) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON (non-JSON values via ``str``)."""
    kw = {"indent": 2, "sort_keys": True, "default": str, **dumps_kwargs}
    atomic_write_text(path, json.dumps(obj, **kw) + "\n")
