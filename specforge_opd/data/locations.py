"""Where assets are found: the asset cache directory and data files inside installed packages.

``assets`` (the embedded target) and ``prompts`` (the offline prompt sets) both read
from here, so neither has to import the other to find its files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Optional

from specforge_opd.errors import UserError


#: Environment variable that moves the asset cache.
CACHE_ENV = "SPECFORGE_OPD_CACHE"


class AssetError(UserError, RuntimeError):
    """An asset is missing, differs from the pinned one, or failed its pinned checks."""


def cache_dir(override: Optional[str | os.PathLike] = None) -> Path:
    """The asset cache: ``override``, else ``$SPECFORGE_OPD_CACHE``, else ``~/.cache/specforge_opd``.

    The directory is created if needed.
    """
    if override is not None:
        p = Path(override)
    elif os.environ.get(CACHE_ENV):
        p = Path(os.environ[CACHE_ENV])
    else:
        p = Path.home() / ".cache" / "specforge_opd"
    p = p.expanduser()
    p.mkdir(parents=True, exist_ok=True)
    return p


def package_file(package: str, relpath: str, pip_name: str) -> Path:
    """The path of ``relpath`` inside the installed (importable) ``package``.

    Raises:
        AssetError: the package is not installed (names the pip package to
            install) or does not contain the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package `{package}` is not installed: pip install {pip_name}")
    for base in spec.submodule_search_locations:
        p = Path(base) / relpath
        if p.is_file():
            return p
    raise AssetError(f"package `{package}` has no file {relpath}: reinstall it with pip install {pip_name}")


def package_dir(package: str, pip_spec: str) -> tuple[Path, str]:
    """The source directory of the installed ``package`` and its installed version.

    ``pip_spec`` is ``name==version``: the distribution whose version is read, and the
    pin it must equal (a source tree parsed as data changes with the release). The
    package is located with ``importlib.util.find_spec``, which does not import it.

    Raises:
        AssetError: the package is not installed, or its version differs from the pin
            (both name ``pip install <pip_spec>``).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package `{package}` is not installed: pip install {pip_spec}")
    dist, _, pinned = pip_spec.partition("==")
    try:
        version = importlib.metadata.version(dist.strip())
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(f"package `{package}` has no distribution metadata for `{dist.strip()}`: "
                         f"pip install {pip_spec}") from None
    if pinned and version != pinned.strip():
        raise AssetError(f"package `{package}` is {version}, not the pinned {pinned.strip()}: pip install {pip_spec}")
    for base in spec.submodule_search_locations:
        if (Path(base) / "__init__.py").is_file():
            return Path(base), version
    raise AssetError(f"package `{package}` has no __init__.py (a namespace package?): reinstall it with pip install {pip_spec}")
