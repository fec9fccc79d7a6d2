"""A ``roseinfer serve`` process for the serving benchmarks: start it on a free port of
127.0.0.1, wait until ``/health`` answers, and stop it with SIGTERM (the graceful
shutdown), killing it only if it does not exit in time."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(serve_args: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """``roseinfer serve SERVE_ARGS`` on a free port; (process, base URL). Its output
    goes to ``log_path``; it is not healthy yet (``wait_healthy``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "roseinfer.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(serve_args)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    print(f"started: {shlex.join(cmd)} (pid {proc.pid}, log {log_path})", flush=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float,
                 interval: float = 0.5) -> None:
    """Return once ``url``/health answers 200; SystemExit if the process exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(interval)
    raise SystemExit(f"server not healthy after {timeout:.0f}s")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)
