"""Hostile clients for the soak benchmark (``benchmarks/soak.py --hostile-rounds``).

Three kinds, each a loop that keeps ``count`` connections of its kind going:

* stalled readers: a streaming completion (``n`` sequences, long outputs) sent on a
  socket with a 4 KiB receive buffer that never reads; once the kernel's buffers are
  full the server's sends wait, and it should abort the request after its stall
  timeout (``--stream-stall-timeout``). A connection is held ``hold_s`` then
  closed and replaced (a socket the server gave up on may linger: the client never
  read what was in flight).
* slow headers: a request head sent one byte every ``drip_s`` seconds; the server should
  close it after its header timeout. How long each lasted is recorded.
* rebinding Host: completions with a foreign ``Host`` header (what a browser sends on a
  DNS-rebinding page); the server should refuse them (4xx). Their statuses are counted.

Only loopback addresses are used. Nothing here parses responses beyond the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

REBIND_HOST = "rebind.attacker.example:8000"


@dataclass
class HostileOptions:
    stalled: int = 2  # concurrent never-reading streams
    # n x max_tokens events with 20 logprobs each (~1.5 KB): ~3 MB, well past the ~0.15 MB
    # (64 KiB send buffer, doubled by the kernel, plus the transport's 16 KiB) the
    # server takes before a stalled client's send() has to wait (server/conn_limits.py)
    stalled_n: int = 2
    stalled_max_tokens: int = 1024
    hold_s: float = 60.0  # a stalled socket is closed (and replaced) after this long
    slow_headers: int = 8  # concurrent slow-header connections
    drip_s: float = 1.0
    max_drip_s: float = 120.0  # a slow-header connection the server never closes ends here
    rebind_interval_s: float = 0.5


@dataclass
class HostileStats:
    stalled_opened: int = 0
    slow_opened: int = 0
    slow_closed_by_server: int = 0
    slow_lifetimes_s: list[float] = field(default_factory=list)
    rebind_status: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        life = sorted(self.slow_lifetimes_s)
        return {"stalled_opened": self.stalled_opened, "slow_opened": self.slow_opened,
                "slow_closed_by_server": self.slow_closed_by_server,
                "slow_lifetime_max_s": life[-1] if life else None,
                "rebind_status": {str(k): v for k, v in sorted(self.rebind_status.items())},
                "errors": dict(self.errors)}


class HostileMix:
    """Runs the hostile loops against ``url`` until ``stop()``."""

    def __init__(self, url: str, model: str, options: HostileOptions) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.model = model
        self.opt = options
        self.stats = HostileStats()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._stop.clear()
        loops = ([self._stalled_loop() for _ in range(self.opt.stalled)]
                 + [self._slow_loop() for _ in range(self.opt.slow_headers)]
                 + [self._rebind_loop()])
        self._tasks = [asyncio.ensure_future(loop) for loop in loops]

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _pause(self, seconds: float) -> bool:
        """Sleep; False once stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return not self._stop.is_set()

    def _head(self, path: str, body: bytes, host: str | None = None) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: {host or f'{self.host}:{self.port}'}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode() + body

    # ----------------------------------------------------------- stalled readers
    async def _stalled_loop(self) -> None:
        loop = asyncio.get_running_loop()
        body = json.dumps({"model": self.model, "prompt": "Tell me a very long story.",
                           "max_tokens": self.opt.stalled_max_tokens, "n": self.opt.stalled_n,
                           "stream": True, "ignore_eos": True, "temperature": 0.8,
                           "logprobs": 20}).encode()  # large events: buffers fill sooner
        while not self._stop.is_set():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the window
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (self.host, self.port))
                await loop.sock_sendall(sock, self._head("/v1/completions", body))
                self.stats.stalled_opened += 1
                await self._pause(self.opt.hold_s)  # never read
            except OSError as exc:
                self.stats.errors[f"stalled: {type(exc).__name__}"] += 1
                await self._pause(1.0)
            finally:
                sock.close()

    # -------------------------------------------------------------- slow headers
    async def _slow_loop(self) -> None:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nX-Slow: "
        while not self._stop.is_set():
            start = time.monotonic()
            writer = None
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.stats.slow_opened += 1
                writer.write(head.encode())
                await writer.drain()
                closed = False
                while time.monotonic() - start < self.opt.max_drip_s:
                    with contextlib.suppress(TimeoutError):
                        if not await asyncio.wait_for(reader.read(4096), self.opt.drip_s):
                            closed = True  # EOF: the server closed it (after a 408 or not)
                            break
                        continue  # an answer came (a 408): read on until EOF
                    writer.write(b"a")
                    await writer.drain()
                if closed:
                    self.stats.slow_closed_by_server += 1
                    self.stats.slow_lifetimes_s.append(time.monotonic() - start)
            except (ConnectionError, OSError):
                self.stats.slow_closed_by_server += 1  # reset by the server
                self.stats.slow_lifetimes_s.append(time.monotonic() - start)
            finally:
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
            if not await self._pause(0.1):
                return

    # ------------------------------------------------------------- rebinding Host
    async def _rebind_loop(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "hi", "max_tokens": 4}).encode()
        while await self._pause(self.opt.rebind_interval_s):
            writer = None
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                writer.write(self._head("/v1/completions", body, host=REBIND_HOST))
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 60)
                parts = line.split()
                self.stats.rebind_status[int(parts[1]) if len(parts) > 1 else "none"] += 1
            except (OSError, TimeoutError, ValueError) as exc:
                self.stats.errors[f"rebind: {type(exc).__name__}"] += 1
            finally:
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()


# ------------------------------------------------------------------ phases
@dataclass
class Phase:
    hostile: bool
    start: float  # seconds since the load began
    end: float = 0.0


def phase_order(rounds: int) -> list[bool]:
    """Interleaved A/B phases, ABBA order (drift cancels): False = normal load alone."""
    order: list[bool] = []
    for r in range(rounds):
        order += [False, True] if r % 2 == 0 else [True, False]
    return order


async def run_phases(mix: HostileMix, rounds: int, phase_s: float, t0: float,
                     delay_s: float = 0.0) -> list[Phase]:
    """After ``delay_s`` (warm-up), alternate ``phase_s``-long phases of normal load
    alone and normal load beside the hostile mix."""
    await asyncio.sleep(delay_s)
    phases = []
    for hostile in phase_order(rounds):
        phase = Phase(hostile, time.monotonic() - t0)
        if hostile:
            mix.start()
        await asyncio.sleep(phase_s)
        if hostile:
            await mix.stop()
        phase.end = time.monotonic() - t0
        phases.append(phase)
    return phases


def _pct(values: list[float], q: float) -> float | None:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else None


def _median(values: list[float]) -> float | None:
    s = sorted(v for v in values if v is not None)
    if not s:
        return None
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def compare_phases(phases: list[Phase], ttfts: list[tuple[float, float]]) -> dict[str, Any]:
    """Normal clients' TTFT per phase (``ttfts``: (start, ttft) of their streams), and
    the median over phases of each condition of the p50 and p99."""
    rows = []
    for p in phases:
        values = [ttft for start, ttft in ttfts if p.start <= start < p.end]
        rows.append({"hostile": p.hostile, "start_s": p.start, "end_s": p.end,
                     "streams": len(values), "ttft_p50_s": _pct(values, 50),
                     "ttft_p99_s": _pct(values, 99)})
    out: dict[str, Any] = {"phases": rows}
    for name, hostile in (("normal_only", False), ("with_hostile", True)):
        mine = [r for r in rows if r["hostile"] is hostile]
        out[name] = {"phases": len(mine),
                     "ttft_p50_s_median": _median([r["ttft_p50_s"] for r in mine]),
                     "ttft_p99_s_median": _median([r["ttft_p99_s"] for r in mine])}
    return out
