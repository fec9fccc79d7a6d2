"""Output constraints of a chat / completions body -> ``SamplingParams`` fields.

``response_format`` (OpenAI: ``text``, ``json_object``, ``json_schema``) and
``structured_outputs`` (vLLM's extension: json, json_object, regex, choice, grammar)
become one ``StructuredOutputsParams``; ``logit_bias`` (string token ids -> bias) and
``allowed_token_ids`` are passed on as ids. Shapes are checked here (a 400 naming the
field); whether a schema / regex / grammar compiles and whether every id is inside the
vocabulary is the engine's ``RequestValidator``'s call, made off the event loop before
the request is queued (``check_constraints``), with errors naming the field the client
used.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.errors import bad_request
from roseinfer.server.protocol import ResponseFormat, SamplingFields
from roseinfer.server.state import ServerState
from roseinfer.structured_outputs import StructuredOutputsParams

_ENGINE_PARAM = "structured_outputs"  # what the engine's errors name
_SO = "StructuredOutputsParams"  # how its own errors begin


def constraint_param(body: SamplingFields) -> str:
    """The body field that carries the structured-output constraint."""
    fmt = body.response_format
    return "response_format" if fmt is not None and fmt.type != "text" else _ENGINE_PARAM


def constraint_fields(body: SamplingFields) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for the body's constraints (APIError 400)."""
    fields: dict[str, Any] = {}
    spec = _structured_outputs(body)
    if spec is not None:
        fields["structured_outputs"] = spec
    if body.logit_bias is not None:
        fields["logit_bias"] = _logit_bias(body.logit_bias)
    if body.allowed_token_ids is not None:
        fields["allowed_token_ids"] = tuple(body.allowed_token_ids)
    return fields


async def check_constraints(state: ServerState, params: SamplingParams,
                            body: SamplingFields) -> None:
    """Compile the grammar now, on a worker thread (the engine caches it, so the check
    ``ServerState.submit`` repeats is a lookup); a 400 naming the field the client used."""
    if params.structured_outputs is not None:
        await compile_constraint(state, params.structured_outputs, constraint_param(body))


async def compile_constraint(state: ServerState, spec: StructuredOutputsParams,
                             param: str) -> None:
    """Compile ``spec`` off the event loop; a 400 naming ``param`` if it does not."""
    try:
        await run_in_threadpool(state.validator.compile_grammar, spec)
    except InvalidRequestError as exc:
        raise bad_request(str(exc).replace(_ENGINE_PARAM, param, 1), param) from exc


def _structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise bad_request("response_format and structured_outputs cannot both constrain the "
                          "output: send one of them", "structured_outputs")
    if so is not None:
        return _build("structured_outputs", _SO, "structured_outputs", json=so.json_,
                      json_object=so.json_object, regex=so.regex, grammar=so.grammar,
                      choice=None if so.choice is None else tuple(so.choice),
                      disable_any_whitespace=so.disable_any_whitespace)
    if fmt is not None:
        return _response_format(fmt)
    return None


def _response_format(fmt: ResponseFormat) -> StructuredOutputsParams | None:
    if fmt.type != "json_schema" and fmt.json_schema is not None:
        raise bad_request(f"response_format.json_schema is only allowed with type "
                          f"'json_schema', not '{fmt.type}'", "response_format")
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _build("response_format", _SO, "response_format", json_object=True)
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema is required when type is "
                          "'json_schema'", "response_format")
    return _build("response_format", f"{_SO}.json", "response_format.json_schema.schema",
                  json=fmt.json_schema.schema_)


def _build(param: str, old: str, new: str, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs); its ValueError is a 400 naming ``param``, its
    message speaking of ``new`` (the body's path) where it said ``old``."""
    try:
        spec = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        message = message.replace(old, new, 1) if old in message else f"{param}: {message}"
        raise bad_request(message, param) from exc
    try:
        spec.key[1].encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate inside a schema given as an object
        raise bad_request(f"{new} is not valid Unicode text: it holds a lone surrogate "
                          f"U+{ord(exc.object[exc.start]):04X}", param) from exc
    return spec


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``{"<token id>": bias}`` as ``{id: bias}`` (a 400 for a key that is not a
    token id, or two keys naming one id); the vocabulary is checked by the engine."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers "
                              f"written as strings), got {key!r}", "logit_bias")
        token = int(key)
        if token in out:
            raise bad_request(f"logit_bias names token id {token} twice", "logit_bias")
        out[token] = value
    return out
