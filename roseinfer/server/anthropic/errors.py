"""Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``, for every
failure on the Messages routes.

The routes raise the server's ``APIError`` like the OpenAI ones; ``AnthropicRoute``
turns it (and a body that fails validation) into Anthropic's shape with the same status
code, and ``anthropic_error`` does the same for the API-key and body-size guards in
front of the app, whose answers on these paths must look the same.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from roseinfer.server.errors import APIError, _validation_message, safe_text

PATH_PREFIX = "/v1/messages"
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_type(status_code: int) -> str:
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "api_error" if status_code >= 500 else "invalid_request_error"


def error_body(status_code: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status_code),
                                       "message": safe_text(str(message))}}


class AnthropicAPIError(APIError):
    """An ``APIError`` whose body is Anthropic's (same status, headers and message)."""

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message)


def anthropic_error(error: APIError) -> AnthropicAPIError:
    return AnthropicAPIError(error.status_code, error.message, param=error.param,
                             code=error.code, headers=error.headers)


def shaped_for(path: str, error: APIError) -> APIError:
    """``error`` in the shape of the API that ``path`` belongs to."""
    return anthropic_error(error) if is_anthropic_path(path) else error


class AnthropicRoute(APIRoute):
    """A route whose errors (``APIError``, validation, HTTP errors) answer in Anthropic's
    shape; anything else goes on to the app's handlers (a 500 there)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def shaped(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return anthropic_error(exc).response()
            except RequestValidationError as exc:
                message, _ = _validation_message(exc)
                return JSONResponse(error_body(400, message), status_code=400)
            except StarletteHTTPException as exc:
                message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
                return JSONResponse(error_body(exc.status_code, message),
                                    status_code=exc.status_code, headers=exc.headers)

        return shaped
