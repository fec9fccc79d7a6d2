"""A streaming client that reads nothing, behind a real uvicorn on 127.0.0.1.

The server must not buffer its whole output: the engine's outputs for the stream are
merged while the send is blocked (one queued item per request), and once nothing was
read for the stall timeout the request is aborted, its KV blocks freed and the abort
counted in /metrics (``stream_aborts_total{reason="stalled"}``). Meanwhile the request
is held (backpressure): once its reader is behind, it is not decoded any more.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.state import ServerSettings
from tests.server.helpers import (
    Gate,
    ServerThread,
    TinyServer,
    metric,
    scrape,
    tiny_engine,
    wait_until,
)

N, MAX_TOKENS = 16, 480
STALL_S = 1.5


def stalled_client(url: str, body: dict) -> socket.socket:
    """Send ``body`` on a socket with a tiny receive buffer, then never read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.settimeout(10)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    return sock


@contextlib.contextmanager
def small_buffer_server(settings: ServerSettings, **engine_kw) -> Iterator[TinyServer]:
    """``tiny_server`` whose accepted sockets have an 8 KiB send buffer (inherited from
    the listening socket), so that a client that reads nothing stalls the server's sends
    after a few steps, whatever the kernel's buffer autotuning would allow."""
    engine = tiny_engine(**engine_kw)
    gate = Gate(engine)
    async_engine = AsyncEngine(engine)
    st = ServerThread(create_app(async_engine, settings))
    st.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    with st:
        yield TinyServer(st.url, async_engine, gate)
        gate.open()


def test_never_reading_stream_is_bounded_then_aborted():
    settings = ServerSettings(served_model_names=("tiny",), stream_stall_timeout_s=STALL_S)
    blocks = N * (MAX_TOKENS + 8) // 4 + 64
    with small_buffer_server(settings, num_kv_blocks=blocks) as ts:
        streams = []
        add = ts.async_engine.add_requests

        def recording_add(requests):  # noqa: ANN001, ANN202
            streams.append(add(requests))
            return streams[-1]

        ts.async_engine.add_requests = recording_add
        step = ts.gate._step

        def slow_step():  # noqa: ANN202 - ~10 ms a step: the stall comes before the end
            time.sleep(0.01)
            return step()

        ts.gate._step = slow_step
        body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": MAX_TOKENS, "n": N,
                "temperature": 1.0, "seed": 3, "ignore_eos": True, "logprobs": 5,
                "stream": True}
        sock = stalled_client(ts.url, body)
        try:
            assert wait_until(lambda: streams, 10)
            stream = streams[0]
            most_items = most_tokens = most_held = 0
            deadline = time.monotonic() + 30
            while not stream.finished and time.monotonic() < deadline:
                try:  # read from this thread while the event loop changes it
                    most_items = max(most_items, stream.pending_items)
                    most_tokens = max(most_tokens, stream.pending_tokens)
                    most_held = max(most_held, ts.async_engine.stats().num_held)
                except RuntimeError:
                    pass
                time.sleep(0.005)
            assert stream.finished, "the stalled stream was never aborted"
            assert metric(scrape(ts.url), "roseinfer:stream_aborts_total", reason="stalled") == 1
            assert wait_until(lambda: metric(scrape(ts.url), "roseinfer:request_success_total",
                                             finished_reason="abort") == N, 10, 0.2)
            # the engine ran ahead of the blocked send: deltas waited, merged into one item
            assert most_items == 1 and most_tokens >= 4 * N, (most_items, most_tokens)
            generated = ts.engine.get_stats().generation_tokens_total
            # held once its reader fell behind: decoding stopped long before the abort
            # (~150 steps of 10 ms), not run to the end
            assert most_held == N, most_held
            assert generated < N * MAX_TOKENS // 4, generated
            bm = ts.engine.block_manager
            assert wait_until(lambda: (bm.num_free_blocks == bm.num_blocks
                                       and not ts.engine.has_unfinished_requests()), 10)
            samples = scrape(ts.url)
            assert (metric(samples, "roseinfer:kv_cache_free_blocks")
                    == metric(samples, "roseinfer:kv_cache_total_blocks") == bm.num_blocks)
        finally:
            sock.close()
