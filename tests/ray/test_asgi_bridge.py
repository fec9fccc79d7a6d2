"""An HTTP request through an in-process ASGI app (the replica's side), without Ray."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from roseinfer.ray_serve.asgi_bridge import ForwardedRequest, ResponseHead, call_app
from roseinfer.server.streaming import StreamResponse


def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "query": request.url.query,
                             "auth": request.headers.get("authorization")}, status_code=201)

    @app.get("/stream")
    async def stream() -> StreamResponse:
        async def chunks():  # noqa: ANN202
            for i in range(100):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)

        return StreamResponse(chunks(), on_close=lambda: events.append("closed"))

    @app.get("/boom")
    async def boom() -> StreamingResponse:
        async def chunks():  # noqa: ANN202
            yield b"one"
            raise RuntimeError("mid-body failure")

        return StreamingResponse(chunks())

    return app


async def _collect(app: FastAPI, request: ForwardedRequest, limit: int | None = None) -> list:
    items = []
    gen = call_app(app, request)
    async for item in gen:
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    await gen.aclose()
    return items


def test_request_and_answer_pass_through() -> None:
    request = ForwardedRequest("POST", "/echo", b"x=1", ((b"Authorization", b"Bearer k"),
                                                         (b"content-type", b"application/json")),
                               json.dumps({"a": 1}).encode())
    head, *body = asyncio.run(_collect(_app([]), request))
    assert isinstance(head, ResponseHead) and head.status == 201
    assert head.header(b"Content-Type") == b"application/json" and not head.is_event_stream
    assert json.loads(b"".join(body)) == {"got": {"a": 1}, "query": "x=1", "auth": "Bearer k"}


def test_stream_comes_chunk_by_chunk_and_stops_when_the_caller_leaves() -> None:
    events: list[str] = []
    items = asyncio.run(_collect(_app(events), ForwardedRequest("GET", "/stream"), limit=4))
    assert items[0].is_event_stream
    assert items[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert events == ["closed"]  # the app saw the disconnect and closed its stream


def test_unknown_route_is_the_apps_404() -> None:
    head, *body = asyncio.run(_collect(_app([]), ForwardedRequest("GET", "/nope")))
    assert head.status == 404 and b"Not Found" in b"".join(body)


def test_app_failure_mid_body_reaches_the_caller() -> None:
    with pytest.raises(RuntimeError, match="mid-body failure"):
        asyncio.run(_collect(_app([]), ForwardedRequest("GET", "/boom")))
