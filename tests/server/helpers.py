"""Helpers for the server tests: process control, in-process uvicorn over tiny engines,
an engine gate, and a /metrics scraper."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from roseinfer.bench.server_process import wait_healthy as wait_server_healthy
from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.state import ServerSettings

MODEL_NAME = "smollm2-test"
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log: Path) -> None:
    """The benchmarks' wait, with the server log's tail in the error."""
    try:
        wait_server_healthy(url, proc, timeout, interval=0.25)
    except SystemExit as exc:
        raise RuntimeError(f"{exc}:\n{log.read_text()[-4000:]}") from None


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


# ----------------------------------------------------------------- tiny servers
class ServerThread:
    """A real uvicorn server on 127.0.0.1 running in a background thread."""

    def __init__(self, app) -> None:  # noqa: ANN001
        # IPPROTO_TCP: asyncio turns Nagle off only on sockets created with it; otherwise
        # every response waits ~40 ms for the client's delayed ACK.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "uvicorn did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


class Gate:
    """Pauses the engine thread inside step() until opened (bounded wait)."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.opened = threading.Event()
        self.opened.set()
        self.entered = threading.Event()
        self._step = engine.step

        def gated_step():  # noqa: ANN202
            self.entered.set()
            self.opened.wait(10)
            return self._step()

        engine.step = gated_step

    def close(self) -> None:
        self.entered.clear()
        self.opened.clear()

    def open(self) -> None:
        self.opened.set()


def tiny_engine(**options):  # noqa: ANN201
    from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama

    options.setdefault("block_size", 4)
    options.setdefault("num_kv_blocks", 256)
    return engine_from_hf(tiny_hf_llama(), **options)


@dataclass
class TinyServer:
    url: str
    async_engine: AsyncEngine
    gate: Gate

    @property
    def engine(self):  # noqa: ANN201
        return self.async_engine.engine


@contextlib.contextmanager
def tiny_server(settings: ServerSettings | None = None, **engine_kw) -> Iterator[TinyServer]:
    max_waiting = engine_kw.pop("max_waiting_requests", None)
    engine = tiny_engine(**engine_kw)
    gate = Gate(engine)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting)
    settings = settings or ServerSettings(served_model_names=("tiny",))
    with ServerThread(create_app(async_engine, settings)) as st:
        yield TinyServer(st.url, async_engine, gate)
        gate.open()


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    raise KeyError(name)
