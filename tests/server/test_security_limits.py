"""Connection limits through a real uvicorn on our protocol (``conn_limits``), both
HTTP implementations: a request's head and body must arrive within the request timeout
(408, then closed), a silent connection is closed, idle keep-alive connections close,
connections past ``max_connections`` get the OpenAI-shaped 503, and neither ordinary
requests nor a stream longer than the timeout are cut."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.conn_limits import ConnectionLimits, server_config
from roseinfer.server.state import ServerSettings
from tests.server.helpers import Gate, tiny_engine, wait_until

TIMEOUT_S = 1.0
IMPLS = ["h11", "httptools"]


@contextlib.contextmanager
def limited_server(impl: str, limits: ConnectionLimits, keep_alive_s: int = 1,
                   servers: list[uvicorn.Server] | None = None) -> Iterator[tuple[str, Gate]]:
    if impl == "httptools":
        pytest.importorskip("httptools")
    engine = tiny_engine()
    gate = Gate(engine)
    app = create_app(AsyncEngine(engine), ServerSettings(served_model_names=("tiny",)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = server_config(app, limits, impl=impl, log_level="warning",
                           timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if servers is not None:
        servers.append(server)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 30), "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", gate
    finally:
        gate.open()
        server.should_exit = True
        thread.join(15)
        sock.close()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``limit_s``), and when it closed."""
    start = time.monotonic()
    data = b""
    s.settimeout(0.2)
    while time.monotonic() - start < limit_s:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    else:
        raise AssertionError(f"still open after {limit_s} s; got {data!r}")
    return data, time.monotonic() - start


def assert_error(data: bytes, status: int, code: str) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), data
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


@pytest.fixture(params=IMPLS, scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Gate]]:
    with limited_server(request.param, ConnectionLimits(TIMEOUT_S, 64)) as s:
        yield s


def test_half_sent_headers_get_408_and_close(server: tuple[str, Gate]) -> None:
    with connect(server[0]) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        data, closed_s = read_until_closed(s, 10 * TIMEOUT_S)
    assert 0.5 * TIMEOUT_S <= closed_s < 5 * TIMEOUT_S
    assert_error(data, 408, "request_timeout")


def test_trickling_body_gets_408_and_close(server: tuple[str, Gate]) -> None:
    with connect(server[0]) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{")
        start = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(10):  # a byte every TIMEOUT_S / 4: never idle, never done
                time.sleep(TIMEOUT_S / 4)
                s.sendall(b" ")
        data, _ = read_until_closed(s, 10 * TIMEOUT_S)
        assert time.monotonic() - start < 6 * TIMEOUT_S
    assert_error(data, 408, "request_timeout")


def test_silent_and_idle_keep_alive_connections_close(server: tuple[str, Gate]) -> None:
    with connect(server[0]) as s:  # connects, sends nothing
        data, closed_s = read_until_closed(s, 10 * TIMEOUT_S)
    assert data == b"" and closed_s < 5 * TIMEOUT_S
    with connect(server[0]) as s:  # one request, then idle on keep-alive
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data, closed_s = read_until_closed(s, 10 * TIMEOUT_S)
    assert data.startswith(b"HTTP/1.1 200") and closed_s < 5 * TIMEOUT_S


def test_requests_and_a_stream_longer_than_the_timeout_are_not_cut(
        server: tuple[str, Gate]) -> None:
    url, gate = server
    with httpx.Client(base_url=url, timeout=30) as client:  # one keep-alive connection
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(TIMEOUT_S * 0.6)  # below keep-alive; the sum is past the timeout
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True,
                "temperature": 0, "ignore_eos": True}
        gate.close()  # the engine stops in its next step: the stream waits
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert gate.entered.wait(10)
            time.sleep(2.5 * TIMEOUT_S)
            gate.open()
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("impl", IMPLS)
def test_connections_past_the_cap_get_503(impl: str) -> None:
    with limited_server(impl, ConnectionLimits(5.0, 2)) as (url, _):
        held = [connect(url) for _ in range(2)]
        try:
            time.sleep(0.3)  # accepted
            with connect(url) as s:
                s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Length: 2\r\n\r\n{}")
                data, _ = read_until_closed(s, 10)
            assert_error(data, 503, "too_many_connections")
            assert b"retry-after: 1" in data.lower()
            held.pop().close()
            assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, 5)
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_accepted_sockets_get_a_small_send_buffer(impl: str) -> None:
    """A client that stops reading fills 64 KiB of kernel buffer (doubled by the kernel)
    and 16 KiB of the transport's, not autotuned MiBs, before the stream's send() waits
    (and the stall timeout can see it): the defaults."""
    servers: list[uvicorn.Server] = []
    with limited_server(impl, ConnectionLimits(5.0, 8),
                        servers=servers) as (url, _), connect(url) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert client.recv(65536).startswith(b"HTTP/1.1 200")
        conns = list(servers[0].server_state.connections)
        assert len(conns) == 1
        sock = conns[0].transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * (64 << 10)  # doubled
        assert conns[0].transport.get_write_buffer_limits()[1] == 16 << 10
