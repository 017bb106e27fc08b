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

from ..config import SGLangConfig
from .contract import MIN_SGLANG_VERSION, parse_server_info, server_layer_ids, version_tuple

Mode = Literal["verify", "native", "plain"]


class ServerError(RuntimeError):
    """The SGLang server did not start, died, or is unreachable; the message points at its log."""


def find_free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
) -> list[str]:
    """The SGLang command-line arguments for ``mode``.

    verify: hidden states of the DFlash layers (``--enable-return-aux-hidden-states``
    with ``--return-aux-hidden-state-layer-ids``, see ``contract.server_layer_ids``);
    native: ``--speculative-algorithm DFLASH --speculative-draft-model-path DIR
    --speculative-num-draft-tokens block_size``; plain: the target alone (benchmark baseline).

    Raises:
        ValueError: a field the mode needs is missing (named).
    """
    args = [
        "--model-path", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-total-tokens", str(cfg.max_total_tokens),
        "--skip-tokenizer-init",
    ]
    if dtype is not None:
        args += ["--dtype", {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[dtype]]
    if mode == "verify":
        if not target_layer_ids:
            raise ValueError("verify mode needs draft target_layer_ids (draft.target_layer_ids or the drafter's config)")
        args += [
            "--enable-return-hidden-states",
            "--enable-return-aux-hidden-states",
            "--return-aux-hidden-state-layer-ids",
            *[str(i) for i in server_layer_ids(target_layer_ids)],
        ]
    elif mode == "native":
        if draft_path is None or block_size is None:
            raise ValueError("native mode needs the drafter directory (draft.path) and draft.block_size")
        args += [
            "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(draft_path),
            "--speculative-num-draft-tokens", str(block_size),
            # the native plugin hooks the synchronous (spec-v1) DFLASH verify
            "--disable-overlap-schedule",
        ]
    return args + list(cfg.extra_args)


def _get_json(url: str, timeout: float) -> Optional[dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return json.loads(body) if body else {}
    except (urllib.error.URLError, OSError, ValueError):
        return None


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
    raise ServerError(f"SGLang server at {url} not healthy after {timeout_s:.0f} s (sglang.startup_timeout_s){_tail(log_path)}")


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

    def __init__(self, cfg: SGLangConfig, args_fn, *, log_path: str | os.PathLike, env: Optional[dict] = None):
        """``args_fn(port) -> list[str]`` builds the arguments (see ``server_args``)."""
        self.cfg = cfg
        self.args_fn = args_fn
        self.port = cfg.port or find_free_port()
        self.log_path = Path(log_path)
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self.version = "unknown"
        self._atexit = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [*shlex.split(self.cfg.python), "-m", self.cfg.launch_module, *self.args_fn(self.port)]

    def start(self) -> "SGLangServer":
        """Launch and wait for ``/health``; raises ``ServerError`` with the log's tail."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        log = open(self.log_path, "ab")
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
            wait_healthy(self.url, self.cfg.startup_timeout_s, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        info = _get_json(self.url + "/get_server_info", 10.0)
        self.version = parse_server_info(info)
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

    def __init__(self, urls: list[str], servers: Optional[list[SGLangServer]] = None, version: str = "unknown"):
        if not urls:
            raise ValueError("no SGLang server: set sglang.urls or let the launcher start one")
        self.urls = [u.rstrip("/") for u in urls]
        self.servers = servers
        self.version = version

    @classmethod
    def connect(cls, urls: list[str], timeout_s: float = 30.0) -> "Endpoints":
        """Wait for each given URL's ``/health`` and read its version."""
        version = "unknown"
        for u in urls:
            wait_healthy(u, timeout_s)
            version = parse_server_info(_get_json(u.rstrip("/") + "/get_server_info", 10.0))
        return cls(urls, None, version)

    @classmethod
    def launched(cls, servers: list[SGLangServer]) -> "Endpoints":
        return cls([s.url for s in servers], servers, servers[0].version if servers else "unknown")

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
        return ok

    def version_warning(self) -> Optional[str]:
        vt = version_tuple(self.version) if self.version != "unknown" else ()
        if vt and vt < version_tuple(MIN_SGLANG_VERSION):
            return f"SGLang {self.version} is older than {MIN_SGLANG_VERSION}, the version the contract was read from"
        return None
