"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers raise ``APIError``; FastAPI's validation errors, Starlette's HTTP errors
(unknown route, wrong method) and unexpected exceptions are mapped to the same body.
An error body always encodes: text it echoes that is not valid Unicode (lone
surrogates) is escaped as ``\\udXXX`` first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def safe_text(text: str) -> str:
    """``text`` with lone surrogates escaped, so it always encodes to UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _safe(value: str | None) -> str | None:
    return None if value is None else safe_text(str(value))


class APIError(Exception):
    """An error answered to the client with an OpenAI-shaped body."""

    def __init__(self, status_code: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPES.get(status_code, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def refuse_unknown_fields(body: Any) -> None:
    """A body field this server does not know could change the output: a 400 naming it
    (``body`` is a pydantic model that keeps its extra fields)."""
    for name in getattr(body, "model_extra", None) or {}:
        raise bad_request(f"Unrecognized request argument supplied: {name}", name)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": safe_text(str(message)), "type": _safe(type),
                      "param": _safe(param), "code": _safe(code)}}


def error_response(status_code: int, message: str, *, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return APIError(status_code, message, code=code, headers=headers).response()


def _is_type_mismatch(error: Mapping[str, Any]) -> bool:
    return str(error.get("type", "")).endswith("_type")


def _field_path(loc: Any) -> str | None:
    # Union members add their type name to the location ("str", "list[...]",
    # "function-before[...]", "constrained-int"); keep field names and list indices.
    path = [str(p) for p in loc if p != "body"]
    path = [p for p in path if "[" not in p and "-" not in p and p not in _TYPE_TAGS]
    return ".".join(path) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # A union reports one error per member; the member of the right type that failed a
    # constraint (a bound, a lone surrogate, a non-finite float) says what is wrong.
    first = next((e for e in errors if not _is_type_mismatch(e)), errors[0])
    param = _field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if first.get("type") == "missing":
        if param is None:
            return "the request body is missing: send a JSON object", None
        return f"'{param}' is a required field", param
    if param is None and _is_type_mismatch(first):
        return "the request body must be a JSON object", None
    # Other members' type mismatches are noise next to a constraint error: not counted.
    others = [e for e in errors if e is not first
              and (_is_type_mismatch(first) or not _is_type_mismatch(e))]
    extra = f" ({len(others)} more error(s))" if others else ""
    return (f"{param}: {msg}" if param else msg) + extra, param


def routing_message(status: int, method: str, path: str,
                    allow: str | None = None) -> tuple[str, str]:
    """(message, code) of an unknown route (404) or a wrong method (405): the client
    sees which request missed, not a bare "Not Found" that reads like a missing model."""
    if status == 404:
        return (f"Invalid URL ({method} {path}): no such route on this server",
                "unknown_url")
    allowed = f" (allowed: {allow})" if allow else ""
    return (f"Method {method} is not allowed for {path}{allowed}", "method_not_allowed")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = None
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            message = f"the body is not valid UTF-8: {cause.reason} at byte {cause.start}"
        elif exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            message, code = routing_message(exc.status_code, request.method,
                                            request.url.path, (exc.headers or {}).get("Allow"))
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
