"""The web UI's routes: the page at ``/``, its files under ``/ui/static/``, and
``GET /ui/api/snapshot`` (the dashboard's one JSON endpoint).

Mounted by ``create_app`` when ``ServerSettings.ui`` is on (``roseinfer serve``: on,
``--no-ui``: off). The page and its files are public (``is_public``): they hold no
data, and the page must load to ask for the API key. The snapshot, like every API
route, needs the key when one is set (``GuardMiddleware``). The snapshot itself is
taken on the engine thread (``AsyncEngine.snapshot``); this side only shapes it.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from roseinfer.engine.request_stream import EngineDeadError
from roseinfer.server.errors import APIError
from roseinfer.server.state import get_state
from roseinfer.server.ui.assets import Asset, UiAssets
from roseinfer.server.ui.snapshot_json import snapshot_json

STATIC_PREFIX = "/ui/static/"
SNAPSHOT_PATH = "/ui/api/snapshot"
# The page runs only its own files: no inline script, nothing from another origin.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")


def is_public(path: str) -> bool:
    """The page and its static files: open without an API key."""
    return path == "/" or (path.startswith(STATIC_PREFIX) and "/" not in path[len(STATIC_PREFIX):])


def build_router(assets: UiAssets) -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def page(request: Request) -> Response:
        return _send(assets.files["index.html"], request,
                     {"Content-Security-Policy": PAGE_CSP, "X-Frame-Options": "DENY",
                      "Referrer-Policy": "no-referrer"})

    @router.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static_file(name: str, request: Request) -> Response:
        asset = assets.get(name)
        if asset is None:
            raise APIError(404, f"no UI file named {name!r}", code="not_found")
        return _send(asset, request, {})

    @router.get(SNAPSHOT_PATH, include_in_schema=False)
    async def snapshot(request: Request) -> Response:
        state = get_state(request)
        try:
            snap = await state.engine.snapshot()
        except EngineDeadError as exc:
            raise APIError(503, f"The engine is not available: {exc}",
                           code="engine_unavailable") from exc
        body = snapshot_json(snap, now=time.monotonic(), model=state.model_name,
                             healthy=state.engine.healthy)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router


def _send(asset: Asset, request: Request, headers: dict[str, str]) -> Response:
    headers = {**headers, "ETag": asset.etag, "Cache-Control": "no-cache",
               "X-Content-Type-Options": "nosniff"}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.content_type, headers=headers)
