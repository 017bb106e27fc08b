"""Start a stock SGLang server as a subprocess, or connect to given URLs (DESIGN.md section 5).

SGLang usually lives in its own environment or image (its wheel pins CUDA
builds), so the command is ``<sglang.python> -m <sglang.launch_module> ARGS``
with ``sglang.python`` configurable. The server always binds 127.0.0.1 on a free
port, logs to a file, is stopped by PID (its process group: SGLang forks
scheduler and detokenizer processes) on exit, error or Ctrl-C, and is restarted
once if it dies mid-run.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal, Optional

from specforge_opd.config import SGLangConfig
from specforge_opd.errors import UserError
from specforge_opd.sglang.contract import (
    MIN_SGLANG_VERSION,
    parse_pool_tokens,
    parse_running_slots,
    parse_server_info,
    server_layer_ids,
    version_tuple,
)
from specforge_opd.sglang.sizing import startup_timeout_for

Mode = Literal["verify", "native", "plain"]


class ServerError(UserError, RuntimeError):
    """The SGLang server did not start, died, or is unreachable; the message points at its log."""


def find_free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_ONE_GPU = ("each launched server gets one GPU (its torchrun rank's, launcher.rank_gpu_env), so a parallel size above 1 "
            "cannot start; keep one server per GPU, or start a multi-GPU server yourself and list it in sglang.urls")
_OUTSIDE_VERIFY = ("it gives a decoding request one plain target token outside any verify step, which breaks the native "
                   "rollout's anchor recurrence (opd_anchor != expected)")

#: Flags of ``sglang.extra_args`` the launcher refuses: flag -> (modes, refused only when its value is not "1", reason).
#: argparse also takes an unambiguous prefix (``--tp`` for ``--tp-size``): ``check_extra_args`` matches those too.
REFUSED_FLAGS: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "--host": (("verify", "native", "plain"), False, "the launcher binds 127.0.0.1 itself (a server elsewhere: sglang.urls)"),
    "--port": (("verify", "native", "plain"), False, "the launcher picks a free port (a fixed one: sglang.port)"),
    **{f: (("verify", "native", "plain"), True, _ONE_GPU) for f in (
        "--tp-size", "--tensor-parallel-size", "--dp-size", "--data-parallel-size", "--pp-size",
        "--pipeline-parallel-size", "--attn-dp-size", "--attention-data-parallel-size", "--nnodes")},
    "--enable-dp-attention": (("verify", "native", "plain"), False, "DP attention needs several GPUs and, with extend "
                              "batches, " + _OUTSIDE_VERIFY),
    "--enable-mixed-chunk": (("native",), False, "a mixed prefill-decode batch " + _OUTSIDE_VERIFY),
}


def check_extra_args(extra_args: list[str], mode: Mode) -> None:
    """Refuse a flag of ``sglang.extra_args`` that cannot work for ``mode`` (``REFUSED_FLAGS``).

    Raises:
        ValueError: one line naming the flag, the reason and the fix.
    """
    args = [str(a) for a in extra_args]
    for i, tok in enumerate(args):
        if not tok.startswith("--"):
            continue
        name, eq, inline = tok.partition("=")
        hits = [f for f in REFUSED_FLAGS if f == name] or (
            [f for f in REFUSED_FLAGS if len(name) >= 4 and f.startswith(name)])
        for flag in hits:
            modes, only_above_one, reason = REFUSED_FLAGS[flag]
            if mode not in modes:
                continue
            value = inline if eq else (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
            if only_above_one and value.strip() == "1":
                continue
            raise ValueError(f"sglang.extra_args: {tok}{'' if eq or not value else ' ' + value} is refused in {mode} mode: "
                             f"{reason}; remove it from sglang.extra_args")


def check_server_flags(info: Optional[dict], mode: Mode, url: str) -> None:
    """Refuse a running server (``sglang.urls``) whose ``/server_info`` shows flags ``mode`` cannot use.

    0.5.23's ``/server_info`` carries the resolved server arguments; an answer without
    them passes. Native mode refuses mixed chunks and DP attention (``REFUSED_FLAGS``).

    Raises:
        ServerError: names the server, the flag and the fix.
    """
    if mode != "native" or not isinstance(info, dict):
        return
    bad = []
    if info.get("enable_mixed_chunk") is True:
        bad.append("--enable-mixed-chunk")
    dp = info.get("attn_dp_size")
    if info.get("enable_dp_attention") is True or (isinstance(dp, int) and not isinstance(dp, bool) and dp > 1):
        bad.append("DP attention (--attn-dp-size > 1)")
    if bad:
        raise ServerError(f"SGLang server {url} runs with {' and '.join(bad)}: {_OUTSIDE_VERIFY}; restart it without "
                          "them for rollout.backend sglang_native")


def server_args(
    cfg: SGLangConfig,
    *,
    model_path: str,
    port: int,
    mode: Mode,
    target_layer_ids: Optional[list[int]] = None,
    draft_path: Optional[str] = None,
    block_size: Optional[int] = None,
    dtype: Optional[str] = None,
    num_target_layers: Optional[int] = None,
) -> list[str]:
    """The SGLang command-line arguments for ``mode`` (every flag exists in 0.5.23: tests/test_sglang_contract.py).

    verify: hidden states of the DFlash layers (``--enable-return-aux-hidden-states``
    with ``--return-aux-hidden-state-layer-ids``, our ids unchanged, see
    ``contract.server_layer_ids``) and ``--speculative-algorithm DFLASH`` without a
    draft path: 0.5.23 refuses aux capture unless an algorithm names the capture
    convention, then resets the algorithm to none itself, so no draft runs.
    native: ``--speculative-algorithm DFLASH --speculative-draft-model-path DIR
    --speculative-num-draft-tokens block_size --disable-overlap-schedule`` (the drafter's
    ``target_layer_ids``, when given, must be distinct and ascending: SGLang captures them
    in layer order); plain:
    the target alone (benchmark baseline). ``sglang.max_total_tokens`` None leaves
    the pool to SGLang's sizing from the GPU; ``sglang.mem_fraction_static`` sets
    the server's share of the GPU.

    Raises:
        ValueError: a field the mode needs is missing, a layer id SGLang cannot capture, or a flag of
            ``sglang.extra_args`` the mode refuses (``check_extra_args``; named).
    """
    check_extra_args(cfg.extra_args, mode)
    args = [
        "--model-path", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--skip-tokenizer-init",
    ]
    if cfg.max_total_tokens is not None:
        args += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if dtype is not None:
        args += ["--dtype", {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[dtype]]
    if mode == "verify":
        if not target_layer_ids:
            raise ValueError("verify mode needs draft target_layer_ids (draft.target_layer_ids or the drafter's config)")
        args += [
            "--enable-return-hidden-states",
            "--enable-return-aux-hidden-states",
            "--return-aux-hidden-state-layer-ids",
            *[str(i) for i in server_layer_ids(target_layer_ids, num_target_layers)],
            # names the capture convention only (SGLang resets it: no draft path)
            "--speculative-algorithm", "DFLASH",
        ]
    elif mode == "native":
        if draft_path is None or block_size is None:
            raise ValueError("native mode needs the drafter directory (draft.path) and draft.block_size")
        if target_layer_ids and list(target_layer_ids) != server_layer_ids(target_layer_ids, num_target_layers):
            # SGLang reads the ids from the drafter's config and captures inside its layer loop: each layer once,
            # ascending, fed to the drafter in that order
            raise ValueError(
                f"draft target_layer_ids {list(target_layer_ids)}: SGLang's DFLASH captures each target layer once, in "
                "ascending order, and feeds them to the drafter in that order, so this drafter would see other features "
                "than it was trained on; use a drafter with distinct ascending ids, or rollout.backend sglang_verify"
            )
        args += [
            "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(draft_path),
            "--speculative-num-draft-tokens", str(block_size),
            # the plugin synchronises once per verify step to read its values, so
            # overlap would gain nothing; its anchor reading is overlap-safe anyway
            "--disable-overlap-schedule",
        ]
    return args + list(cfg.extra_args)


#: Large enough that ``len(output_ids) % interval == 0`` never holds: a non-streaming
#: response is then sent once, at its finish (the plugin's request-level keys make
#: this a second guard, not the only one).
NO_EARLY_FLUSH = str(1 << 30)

#: Our plugin's entry point (setup.py) and the group SGLang 0.5.23 loads general plugins from.
PLUGIN_NAME = "specforge_opd_native"
PLUGIN_GROUP = "sglang.srt.plugins"

#: Lines SGLang logs (and serves on) when our plugin or one of its hooks failed.
PLUGIN_FAILURE_MARKERS = (
    "Failed to load plugin specforge_opd_native",
    "Failed to execute general plugin: specforge_opd_native",
    "Failed to apply hooks to sglang.srt.speculative.dflash_worker_v2",
    "Failed to apply hooks to sglang.srt.managers.scheduler_components.output_streamer",
)


def rank_gpu_env(environ: Optional[dict] = None) -> dict:
    """``CUDA_VISIBLE_DEVICES`` for the server a torchrun rank launches: its own GPU.

    Rank ``LOCAL_RANK`` gets entry LOCAL_RANK of the visible devices (all GPUs when
    ``CUDA_VISIBLE_DEVICES`` is unset), the GPU its trainer process uses, so that
    the servers of one machine do not all start on GPU 0. Empty outside torchrun.

    Raises:
        ValueError: LOCAL_RANK beyond the visible devices (names both).
    """
    env = os.environ if environ is None else environ
    if "LOCAL_RANK" not in env:
        return {}
    local = int(env["LOCAL_RANK"])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return {"CUDA_VISIBLE_DEVICES": str(local)}
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    if local >= len(ids):
        raise ValueError(f"LOCAL_RANK={local} but CUDA_VISIBLE_DEVICES={visible} lists {len(ids)} devices: one GPU per rank is needed")
    return {"CUDA_VISIBLE_DEVICES": ids[local]}


def mode_env(mode: Mode) -> dict:
    """Environment a launched server of ``mode`` needs besides the GPU (native: no early flush, our plugin allowed)."""
    if mode != "native":
        return {}
    env = {"SGLANG_FORCE_STREAM_INTERVAL": NO_EARLY_FLUSH}
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed and "specforge_opd_native" not in allowed.split(","):
        env["SGLANG_PLUGINS"] = allowed + ",specforge_opd_native"
    return env


def check_plugin_log(log_path: Optional[Path], since: int = 0) -> None:
    """Raise ``ServerError`` when the server log (from byte ``since``) shows our plugin failed to load or hook."""
    if log_path is None or not Path(log_path).is_file():
        return
    with open(log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    for marker in PLUGIN_FAILURE_MARKERS:
        if marker in text:
            raise ServerError(
                f"SGLang logged '{marker}...': the native plugin is not active, so no verify step would be recorded; "
                f"fix the plugin install in SGLang's environment (docs/sglang.md){_tail(log_path)}"
            )


def _get_json(url: str, timeout: float) -> Optional[dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return json.loads(body) if body else {}
    except (urllib.error.URLError, OSError, ValueError):
        return None


def server_info(url: str) -> Optional[dict]:
    """``GET /server_info`` (0.5.23; ``/get_server_info`` is its deprecated alias, tried second)."""
    base = url.rstrip("/")
    return _get_json(base + "/server_info", 10.0) or _get_json(base + "/get_server_info", 10.0)


def wait_healthy(url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None, log_path: Optional[Path] = None) -> None:
    """Poll ``GET {url}/health`` until it answers 200.

    Raises:
        ServerError: the process exited first, or ``timeout_s`` passed (with the log's tail).
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"SGLang server exited with code {proc.returncode} before /health answered{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    raise ServerError(
        f"SGLang server at {url} not healthy after {timeout_s:.0f} s: a large target's start-up (weights, CUDA graphs of "
        f"target and draft, kernel compilation) can take longer; raise sglang.startup_timeout_s{_tail(log_path)}"
    )


def _tail(log_path: Optional[Path], n: int = 20) -> str:
    if log_path is None or not Path(log_path).is_file():
        return ""
    lines = Path(log_path).read_text(errors="replace").splitlines()[-n:]
    return f"; log {log_path}, last lines:\n  " + "\n  ".join(lines)


class SGLangServer:
    """One launched SGLang server.

    Use as a context manager (stops on exit, error or Ctrl-C); ``ensure_running()``
    restarts it once (same port) if it died. The server's own child processes
    share its process group, which ``stop()`` signals by the PID we started.
    """

    def __init__(self, cfg: SGLangConfig, args_fn, *, log_path: str | os.PathLike, env: Optional[dict] = None,
                 require_plugin: bool = False, startup_timeout_s: Optional[float] = None):
        """``args_fn(port) -> list[str]`` builds the arguments (see ``server_args``); ``require_plugin``:
        fail the start when the log shows the native plugin did not load or hook (``check_plugin_log``);
        ``startup_timeout_s``: seconds to wait for ``/health`` (None: ``startup_timeout_for(cfg)``)."""
        self.cfg = cfg
        self.startup_timeout_s = startup_timeout_for(cfg) if startup_timeout_s is None else float(startup_timeout_s)
        self.args_fn = args_fn
        self.port = cfg.port or find_free_port()
        self.log_path = Path(log_path)
        self.env = env
        self.require_plugin = require_plugin
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self.version = "unknown"
        #: KV pool in tokens as the server reports it (None: not reported)
        self.pool_tokens: Optional[int] = None
        #: requests the server decodes at once (``contract.parse_running_slots``; None: not reported)
        self.running_slots: Optional[int] = None
        self._atexit = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [*shlex.split(self.cfg.python), "-m", self.cfg.launch_module, *self.args_fn(self.port)]

    def check_python(self) -> None:
        """Raise ``ServerError`` when ``sglang.python`` cannot import the launch module's package.

        The default ``python`` is usually this project's environment, which has no
        SGLang (SGLang pins its own torch and transformers): fail here, naming the
        setting, instead of after a start-up timeout.
        """
        pkg = self.cfg.launch_module.split(".")[0]
        probe = [*shlex.split(self.cfg.python), "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({pkg!r}) is None)"]
        try:
            ok = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            raise ServerError(
                f"sglang.python={self.cfg.python!r} cannot import {pkg!r}: set sglang.python to the Python of SGLang's "
                "own environment (docs/sglang.md), or sglang.urls to a running server"
            )

    def check_plugin_installed(self) -> None:
        """Raise ``ServerError`` when ``sglang.python``'s environment lacks our plugin's entry point.

        SGLang loads general plugins from the ``sglang.srt.plugins`` entry points of its
        own environment and says nothing when there are none, so a native server
        without the plugin would start and serve, and every rollout would fail later
        for want of the per-step keys.
        """
        probe = [*shlex.split(self.cfg.python), "-c",
                 "import sys; from importlib.metadata import entry_points; "
                 f"sys.exit(not any(e.name == {PLUGIN_NAME!r} for e in entry_points(group={PLUGIN_GROUP!r})))"]
        try:
            ok = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            repo = Path(__file__).resolve().parents[2]
            raise ServerError(
                f"sglang.python={self.cfg.python!r} has no {PLUGIN_NAME!r} entry point in group {PLUGIN_GROUP!r}: native "
                f"mode needs the plugin in SGLang's environment; install it without dependencies: "
                f"{self.cfg.python} -m pip install --no-deps -e {repo} (docs/sglang.md)"
            )

    def start(self) -> "SGLangServer":
        """Launch and wait for ``/health``; raises ``ServerError`` with the log's tail."""
        self.check_python()
        if self.require_plugin:
            self.check_plugin_installed()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        log = open(self.log_path, "ab")
        log_start = log.tell()
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {shlex.join(cmd)}\n".encode())
        log.flush()
        env = dict(os.environ)
        env.update(self.env or {})
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        try:
            wait_healthy(self.url, self.startup_timeout_s, self.proc, self.log_path)
            if self.require_plugin:
                check_plugin_log(self.log_path, log_start)
        except BaseException:
            self.stop()
            raise
        info = server_info(self.url)
        self.version = parse_server_info(info)
        self.pool_tokens = parse_pool_tokens(info) or self.cfg.max_total_tokens
        self.running_slots = parse_running_slots(info)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> bool:
        """True when the server runs (restarting it once if it died and restarts are allowed)."""
        if self.alive():
            return True
        if self.proc is None or not self.cfg.restart_on_death or self.restarts >= 1:
            return False
        self.restarts += 1
        self.stop()
        self.start()
        return True

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group (by our child's PID), SIGKILL after ``grace_s``."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)

    def __enter__(self) -> "SGLangServer":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Endpoints:
    """The servers a rollout talks to: launched ones (restartable) or given URLs (``sglang.urls``).

    Sequences are spread round-robin over the URLs; ``recover(i)`` is called after
    a connection failure and answers whether retrying that server makes sense.
    """

    def __init__(self, urls: list[str], servers: Optional[list[SGLangServer]] = None, version: str = "unknown",
                 pool_tokens: Optional[list[Optional[int]]] = None, running_slots: Optional[list[Optional[int]]] = None):
        if not urls:
            raise ValueError("no SGLang server: set sglang.urls or let the launcher start one")
        self.urls = [u.rstrip("/") for u in urls]
        self.servers = servers
        self.version = version
        #: per URL, the KV pool in tokens (None: unknown, no token bound)
        self.pool_tokens = list(pool_tokens) if pool_tokens is not None else [None] * len(self.urls)
        #: per URL, the requests it decodes at once (None: unknown, no bound besides sglang.max_in_flight)
        self.running_slots = list(running_slots) if running_slots is not None else [None] * len(self.urls)

    @classmethod
    def connect(cls, urls: list[str], timeout_s: float = 30.0, mode: Optional[Mode] = None) -> "Endpoints":
        """Wait for each given URL's ``/health`` and read its version and KV pool size.

        With ``mode``, refuse a server whose flags that mode cannot use (``check_server_flags``)."""
        version = "unknown"
        pools, slots = [], []
        for u in urls:
            wait_healthy(u, timeout_s)
            info = server_info(u)
            if mode is not None:
                check_server_flags(info, mode, u)
            version = parse_server_info(info)
            pools.append(parse_pool_tokens(info))
            slots.append(parse_running_slots(info))
        return cls(urls, None, version, pools, slots)

    @classmethod
    def launched(cls, servers: list[SGLangServer]) -> "Endpoints":
        return cls([s.url for s in servers], servers, servers[0].version if servers else "unknown",
                   [s.pool_tokens for s in servers], [getattr(s, "running_slots", None) for s in servers])

    def url(self, i: int) -> str:
        return self.urls[i % len(self.urls)]

    def recover(self, i: int) -> bool:
        """After a failed request to server i: restart it if it died (once); False when hopeless."""
        if self.servers is None:
            return True  # remote server: nothing to restart; retries with backoff decide
        s = self.servers[i % len(self.servers)]
        if s.alive():
            # a crashing server drops connections a moment before its process is reaped
            try:
                s.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                return True
        ok = s.ensure_running()
        if ok:
            self.version = s.version
            self.pool_tokens[i % len(self.servers)] = s.pool_tokens
            self.running_slots[i % len(self.servers)] = s.running_slots
        return ok

    def version_warning(self) -> Optional[str]:
        vt = version_tuple(self.version) if self.version != "unknown" else ()
        if vt and vt < version_tuple(MIN_SGLANG_VERSION):
            return f"SGLang {self.version} is older than {MIN_SGLANG_VERSION}, the version the contract was read from"
        return None
