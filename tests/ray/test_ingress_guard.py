"""The Ray ingress checks the API key and the body size before it reads or parses a
body: the real ``Ingress.__call__`` behind a real uvicorn on 127.0.0.1, with stand-ins
for the tokenizer (``PrefixKeys``) and the replicas' handle, so no Ray cluster is
needed. Raw sockets send a head that announces a huge body and only part of it: the
answer must come before the body does."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

pytest.importorskip("ray.serve", reason="the 'ray' extra is not installed")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402

from roseinfer.ray_serve.asgi_bridge import ResponseHead  # noqa: E402
from roseinfer.ray_serve.ingress import Ingress  # noqa: E402
from roseinfer.ray_serve.ingress_guard import IngressLimits  # noqa: E402
from tests.server.helpers import ServerThread  # noqa: E402

KEY = "sekret"
LIMIT = 1 << 20


class CountingKeys:
    """Stands in for ``PrefixKeys``: counts the bodies parsed."""

    def __init__(self) -> None:
        self.parsed = 0

    def for_body(self, path: str, body: bytes) -> tuple[int, ...]:
        self.parsed += 1
        return ()


class Call:
    """A replica's streamed answer: a head and ``{}``, or (``endless``) SSE chunks of
    64 KiB until cancelled."""

    def __init__(self, endless: bool = False) -> None:
        kind = b"text/event-stream" if endless else b"application/json"
        self.items = [ResponseHead(200, ((b"content-type", kind),)), b"{}"]
        self.endless = endless
        self.cancelled = False

    def __aiter__(self):  # noqa: ANN204
        return self

    async def __anext__(self):  # noqa: ANN204
        if self.endless and not self.cancelled:
            await asyncio.sleep(0.001)
            return self.items.pop(0) if self.items else b"data: " + b"x" * 0x10000 + b"\n\n"
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True
        self.items = []


class Replicas:
    """Stands in for the replicas' ``DeploymentHandle``."""

    def __init__(self, endless: bool = False) -> None:
        self.forward = self
        self.stats = self
        self.endless = endless
        self.calls: list[Call] = []

    def options(self, **_: object) -> Replicas:
        return self

    def remote(self, *args: object, **kwargs: object):  # noqa: ANN201
        if kwargs:  # stats(replica_slot=...)
            async def stats() -> dict:
                return {"replica_id": "r0"}
            return stats()
        self.calls.append(Call(self.endless))
        return self.calls[-1]


def ingress_server(replicas: Replicas | None = None,
                   stall_s: float = 60.0) -> tuple[ServerThread, CountingKeys]:
    ingress = Ingress.__new__(Ingress)
    ingress.keys = CountingKeys()
    ingress.replicas = replicas or Replicas()
    ingress.num_replicas = 1
    ingress.max_retries = 0
    ingress.limits = IngressLimits(api_key=KEY, max_body_bytes=LIMIT,
                                   stream_stall_timeout_s=stall_s)
    app = Starlette(routes=[Route("/{path:path}", ingress.__call__,
                                  methods=["GET", "POST"])])
    return ServerThread(app), ingress.keys


def raw(url: str, head: str, body: bytes = b"", chunks: int = 0) -> tuple[int, float]:
    """Send ``head`` and ``body`` (then up to ``chunks`` chunked pieces of 64 KiB until
    answered); the status and how long the answer took."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        sock.settimeout(0.05 if chunks else 10)
        data = b""
        for _ in range(chunks + 1):
            try:
                data += sock.recv(65536)
                if data:
                    break
            except TimeoutError:
                sock.sendall(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
        sock.settimeout(10)
        while b"\r\n" not in data:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    return int(data.split(b" ", 2)[1]), time.monotonic() - start


def post_head(length: int | None, key: str | None = KEY) -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    size = (f"Content-Length: {length}\r\n" if length is not None
            else "Transfer-Encoding: chunked\r\n")
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
            f"Content-Type: application/json\r\n{size}\r\n")


def test_refused_before_the_body_is_read_or_parsed():
    server, keys = ingress_server()
    with server:
        huge = 20 << 20
        for head in (post_head(huge, key=None), post_head(huge, key="wrong"),
                     post_head(10, key=None)):
            status, took = raw(server.url, head, b'{"prompt"')
            assert status == 401 and took < 5
        status, took = raw(server.url, post_head(huge), b'{"prompt"')
        assert status == 413 and took < 5
        status, _ = raw(server.url, post_head(None), chunks=4 * LIMIT // 0x10000)
        assert status == 413  # no length: counted as it came, cut off at the limit
        assert keys.parsed == 0
        ok = b'{"prompt": "hi"}'
        status, _ = raw(server.url, post_head(len(ok)), ok)
        assert status == 200 and keys.parsed == 1


def test_replica_stats_need_the_key_and_probes_do_not():
    server, _ = ingress_server()
    with server:
        get = "GET {} HTTP/1.1\r\nHost: 127.0.0.1\r\n{}\r\n"
        assert raw(server.url, get.format("/ray/replicas", ""))[0] == 401
        auth = f"Authorization: Bearer {KEY}\r\n"
        assert raw(server.url, get.format("/ray/replicas", auth))[0] == 200
        assert raw(server.url, get.format("/health", ""))[0] == 200


def test_relay_to_a_client_that_reads_nothing_ends_and_cancels_the_call():
    replicas = Replicas(endless=True)
    server, _ = ingress_server(replicas, stall_s=1.0)
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # accepted sockets too
    with server:
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.connect((host, int(port)))
            ok = b'{"prompt": "hi", "stream": true}'
            sock.sendall(post_head(len(ok)).encode() + ok)  # then never read
            deadline = time.monotonic() + 20
            while not (replicas.calls and replicas.calls[0].cancelled):
                assert time.monotonic() < deadline, "the stalled relay was never ended"
                time.sleep(0.05)
        finally:
            sock.close()
