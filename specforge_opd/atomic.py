"""Atomic file writes: temporary name in the same directory, fsync, rename, fsync the directory.

Every writer of the project goes through here, so a kill or a full disk never
leaves a half-written file under its final name (DESIGN.md: "nothing already
written is lost"). A full disk is reported as ``errors.DiskFullError`` naming the
file. Files get the process umask's mode (0644 under umask 0022), as ``open`` would
give them, not ``mkstemp``'s owner-only 0600: an SGLang server running as another
user reads the exports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from specforge_opd.errors import DiskFullError, is_disk_full, process_umask


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

    The file's mode is ``0o666`` less the process umask.

    Raises:
        DiskFullError: the disk filled up (``OSError`` errno ENOSPC, a ``UserError``);
            the message names ``path``.
        whatever else ``write`` raises. In every case the temporary file is removed
        and ``path`` is untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as e:
        if is_disk_full(e):
            raise DiskFullError(path) from e
        raise
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, Exception) and not isinstance(e, DiskFullError) and is_disk_full(e):
            raise DiskFullError(path) from e
        raise
    fsync_dir(path.parent)


def atomic_link(src: Path, dst: Path) -> None:
    """Make ``dst`` the file ``src``: a hard link under a temporary name renamed into place, or,
    where the filesystem links nothing across (another device, no hard links), an atomic copy.

    Raises:
        DiskFullError: the copy filled the disk (``dst`` untouched, as ``atomic_write``).
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.link-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        with open(src, "rb") as f:
            atomic_write(dst, lambda out: shutil.copyfileobj(f, out))
        return
    os.replace(tmp, dst)
    # when dst already was a link to the same file, rename does nothing and tmp stays
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fsync_dir(dst.parent)


def private_dir_to_umask(path: Path) -> Path:
    """Give a ``tempfile.mkdtemp`` directory (0700) the mode ``mkdir`` would (0755 under umask 0022)."""
    os.chmod(path, 0o777 & ~process_umask())
    return path


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
