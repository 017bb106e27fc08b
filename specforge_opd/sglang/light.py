"""A light, CPU-only copy of the pinned SGLang wheel, importable far enough to run its argument pipeline and plugin loader.

SGLang's full dependency set is 11 GB (CUDA torch, flashinfer, ...). Its argument
parser, the model-independent resolution handlers and its ``HookRegistry`` need
only three small packages besides this project's environment (torch,
transformers, numpy, ...): ``LIGHT_PACKAGES``. ``ensure_light_env`` unpacks the
wheel checked by ``wheel.py`` (no dependencies) and installs those with
``pip install --no-deps --only-binary=:all: --target`` into
``$SPECFORGE_OPD_CACHE/sglang-light-0.5.23`` once (about 5 MB, seconds);
``light_probe`` runs there in a subprocess.

Two imports are stood in for by empty modules (``STUBBED``), each named with why; and
one import chain needs CUDA (``NEEDS_CUDA``): the plugin's hook targets cannot be
imported in this environment, so applying our hooks to SGLang's real classes stays
with the source-reading contract test and the GPU check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specforge_opd.sglang import wheel

#: The packages SGLang's server_args and plugin modules import that this project's environment lacks (pinned).
LIGHT_PACKAGES = ("msgspec==0.23.0", "pybase64==1.5.1", "pyzmq==27.3.0")

#: Top-level modules replaced by empty stand-ins in the probe, with the reason.
STUBBED = {
    "triton": "imported at the top of sglang/srt/utils/common.py (so by `import sglang`); a 150+ MB GPU kernel "
              "compiler that argument parsing and the hook registry never call",
    "IPython": "imported by sglang/utils.py for notebook display only; pulls a dozen packages",
}

#: The import that keeps the hook targets out of a light environment.
NEEDS_CUDA = (
    "sglang.srt.speculative.dflash_worker_v2 and sglang.srt.managers.scheduler_components.output_streamer import "
    "sglang.srt.configs, whose janus_pro module registers an image processor with transformers' AutoImageProcessor, "
    "which needs torchvision: a binary built for SGLang's pinned CUDA torch (2.14.1), not installable beside this "
    "project's CPU torch"
)

MARKER = ".complete"


class LightEnvError(RuntimeError):
    """The light environment could not be built (offline, wheel missing); the message says how to get it."""


def light_dir() -> Path:
    """``$SPECFORGE_OPD_CACHE/sglang-light-<version>`` (default cache ``~/.cache/specforge_opd``)."""
    return wheel.cache_path().parent.parent / f"sglang-light-{wheel.VERSION}"


def ensure_light_env(python: str = sys.executable) -> Path:
    """The light environment's directory (to put first on ``sys.path``), built once and kept.

    Built in a temporary directory beside it and renamed into place, so an interrupted
    build leaves nothing half-made. The manifest (``.complete``) lists the wheel's sha256
    and ``LIGHT_PACKAGES``; a different manifest rebuilds.

    Raises:
        LightEnvError: the wheel cannot be fetched or pip cannot install the packages (offline).
    """
    dest = light_dir()
    manifest = "\n".join([wheel.SHA256, *LIGHT_PACKAGES]) + "\n"
    if (dest / MARKER).is_file() and (dest / MARKER).read_text() == manifest:
        return dest
    try:
        whl = wheel.fetch(python)
    except wheel.WheelError as e:
        raise LightEnvError(str(e)) from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + ".tmp"))
    try:
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(tmp, [n for n in zf.namelist() if n.startswith("sglang/") or ".dist-info/" in n])
        cmd = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps", "--only-binary=:all:",
               "--target", str(tmp), *LIGHT_PACKAGES]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            raise LightEnvError(f"could not install {' '.join(LIGHT_PACKAGES)} for the light SGLang environment: {tail}. "
                                "Offline? Run `python -m specforge_opd.sglang.light` once online")
        (tmp / MARKER).write_text(manifest)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def run_probe(request: dict, timeout_s: float = 120.0) -> dict:
    """Run ``light_probe`` on ``request`` in a subprocess with the light environment first on ``sys.path``.

    Raises:
        LightEnvError: the environment cannot be built.
        RuntimeError: the probe failed (its stderr's tail).
    """
    import json

    site = ensure_light_env()
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(repo), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", SGLANG_PLUGINS="specforge_opd_native")
    r = subprocess.run([sys.executable, "-m", "specforge_opd.sglang.light_probe"], input=json.dumps(request),
                       capture_output=True, text=True, env=env, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"light SGLang probe failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    """``python -m specforge_opd.sglang.light``: build the light environment (a warning offline)."""
    try:
        print(f"[sglang light] {ensure_light_env()}")
    except LightEnvError as e:
        print(f"[sglang light] warning: {e}; tests/test_sglang_light.py will skip", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
