"""Per-app server state and the checks every generation endpoint shares.

The state lives on ``app.state.server`` (no module globals), so two apps over two
engines can run in one process (the tests do).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.request_stream import (
    EngineDeadError,
    EngineStepError,
    PendingRequest,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
    RequestTooLargeError,
)
from roseinfer.engine.validation import InvalidRequestError, RequestValidator
from roseinfer.outputs import RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.access import AccessSettings
from roseinfer.server.errors import APIError, bad_request
from roseinfer.server.metrics import ServerMetrics
from roseinfer.server.protocol import ChatMessage
from roseinfer.server.streaming import ClientDisconnectedError, until_disconnect
from roseinfer.server.tools import message_dicts
from roseinfer.tool_calls import Tool, chat_text


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...] = ("roseinfer",)
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1
    ui: bool = False  # the web UI at / (routes_ui); `roseinfer serve` turns it on
    stream_stall_timeout_s: float = 60.0  # abort a stream whose client reads nothing (0: never)
    access: AccessSettings = AccessSettings()  # Host / Origin / public /metrics
    # tool arguments limited to the declared properties unless a schema allows more
    # (docs/structured-outputs.md, "Tool arguments"); --no-strict-tool-arguments
    strict_tool_arguments: bool = True
    # stored Responses API responses (previous_response_id): how many, and their JSON bytes
    responses_store_size: int = 256
    responses_store_bytes: int = 64 << 20
    # /v1/embeddings: how hidden states are pooled (--embedding-pooling, --no-embedding-normalize)
    embedding_pooling: PoolingParams = PoolingParams()

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if self.responses_store_size < 0 or self.responses_store_bytes < 0:
            raise ValueError("the responses store's bounds must be >= 0")


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    served_names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.served_names = frozenset(self.settings.served_model_names)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, model: str | None) -> str:
        """The name to echo back; 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.model_name
        if model not in self.served_names:
            raise APIError(404, f"The model '{model}' does not exist (served: "
                           f"{', '.join(self.settings.served_model_names)})",
                           param="model", code="model_not_found")
        return model

    # ------------------------------------------------------------ prompts
    def _tokenizer(self):  # noqa: ANN202
        tok = self.engine.engine.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
        return tok

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self._tokenizer()
        return await run_in_threadpool(tok.encode, text, add_special_tokens)

    async def render_chat(self, messages: Sequence[ChatMessage],
                          add_generation_prompt: bool = True,
                          tools: Sequence[Tool] | None = None) -> list[int]:
        """Prompt ids of a conversation; ``tools`` are shown to the model through its
        template when the template renders them, else through the default tool prompt
        (``roseinfer.tool_calls``)."""
        ids, _ = await self.render_conversation(message_dicts(messages), tools=tools,
                                                add_generation_prompt=add_generation_prompt)
        return ids

    async def render_conversation(self, messages: Sequence[Mapping[str, Any]], *,
                                  tools: Sequence[Tool] | None = None,
                                  param: str = "messages",
                                  add_generation_prompt: bool = True,
                                  continue_final_message: bool = False,
                                  template_kwargs: Mapping[str, Any] | None = None,
                                  ) -> tuple[list[int], str]:
        """Prompt (ids, text) of message dicts (``render_chat``'s, with the template's
        options); a template error is a 400 naming ``param``."""
        tok = self._tokenizer()

        def render() -> tuple[list[int], str]:
            text = chat_text(tok, messages, tools, add_generation_prompt,
                             continue_final_message=continue_final_message,
                             template_kwargs=template_kwargs)
            return tok.encode(text, add_special_tokens=False), text

        try:
            return await run_in_threadpool(render)
        except ValueError as exc:
            raise bad_request(str(exc), param) from exc
        except Exception as exc:  # jinja errors raised by the template itself
            raise bad_request(f"the chat template rejected the messages: {exc}",
                              param) from exc

    @property
    def validator(self) -> RequestValidator:
        """The engine's own checks (vocabulary, context, tokenizer); immutable, so
        handlers may call it off the engine thread."""
        return self.engine.engine.validator

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone (e.g. stop ids inside the vocabulary)."""
        try:
            self.validator.check_params(params)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param) from exc

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """Validate prompt ids; returns max_tokens (default: what fits)."""
        if not ids:
            raise bad_request("the prompt is empty", param)
        try:
            self.validator.check_token_ids(ids, param)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param) from exc
        limit = self.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(ids)
            if max_tokens < 1:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens, but the prompt "
                    f"has {len(ids)} tokens, leaving no room for a completion.", param)
        elif len(ids) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the prompt or max_tokens.", param)
        return max_tokens

    # ------------------------------------------------------------- submit
    def submit(self, requests: Sequence[PendingRequest]) -> RequestStream:
        for params in {id(r.params): r.params for r in requests}.values():
            self.check_params(params)  # the prompts of one request share their params
        try:
            return self.engine.add_requests(requests)
        except RequestTooLargeError as exc:
            raise bad_request(str(exc), "n") from exc
        except QueueFullError as exc:
            raise APIError(503, f"The server is overloaded: {exc}. Retry later.",
                           code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from exc
        except EngineDeadError as exc:
            raise APIError(503, f"The engine is not available: {exc}", code="engine_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from exc


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def make_params(build, *args, **kwargs) -> SamplingParams:  # noqa: ANN001
    """Call a SamplingParams factory; its ValueError becomes a 400."""
    try:
        return build(*args, **kwargs)
    except ValueError as exc:
        message = str(exc)
        param = message.split(".", 1)[1].split(" ", 1)[0] if message.startswith(
            "SamplingParams.") else None
        raise bad_request(message, param) from exc


def engine_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised by a request's stream."""
    if isinstance(exc, RequestRejectedError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not available: {exc}", code="engine_unavailable")
    if isinstance(exc, RequestFailedError):  # this request alone; the server goes on
        return APIError(500, f"The request failed in the engine: {exc}", code="request_failed")
    return APIError(500, f"The request failed in the engine: {exc}", code="engine_error")


async def collect(stream: RequestStream, request: Request) -> dict[str, RequestOutput]:
    """Final outputs of every request in ``stream``; aborts them if the client leaves."""

    async def consume() -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
        return finals

    try:
        return await until_disconnect(consume(), request.receive, stream.abort)
    except ClientDisconnectedError as exc:
        raise APIError(499, "client disconnected", code="client_closed_request") from exc
    except (EngineStepError, EngineDeadError, RequestRejectedError, RequestFailedError) as exc:
        raise engine_error(exc) from exc
    finally:
        stream.abort()
