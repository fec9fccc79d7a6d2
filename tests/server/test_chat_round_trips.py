"""Chat completions as agent frameworks use them (issue 26), through the official `openai`
client against the tiny tokenizer server: the SDK's own message sent back, one call for a
named tool, no markup when a call is cut, arguments closed to the declared properties,
tools beside a json_schema answer, vLLM's chat options, `system_fingerprint`,
`models.retrieve` and the errors of unknown routes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from roseinfer.tool_calls import plan_tools, strict_schema, tool_grammar
from tests.server.test_structured_http import no_whitespace
from tests.server.tokenizer_server import MODEL_NAME

MSG = [{"role": "user", "content": "What is 2 plus 3?"}]
# As LangChain / instructor / raw openai send schemas: no additionalProperties.
OPEN_ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}
ADD = {**OPEN_ADD, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
OPEN_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": OPEN_ADD}}]
NAMED = {"type": "function", "function": {"name": "add"}}
ANSWER = {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}},
          "required": ["sum"], "additionalProperties": False}


class Add(pydantic.BaseModel):
    a: int = pydantic.Field(ge=0, le=99)
    b: int = pydantic.Field(ge=0, le=99)


class Sum(pydantic.BaseModel):
    sum: int = pydantic.Field(ge=0, le=99)




def create(c: openai.OpenAI, **kwargs: Any) -> Any:
    body = {"model": MODEL_NAME, "messages": MSG, "tools": TOOLS, "logit_bias": no_whitespace(),
            "temperature": 1.0, "max_tokens": 96, **kwargs}
    return c.chat.completions.create(**body)


def test_sdk_message_sent_back(client) -> None:
    """Point 5: ``message.model_dump()`` (refusal, annotations, audio, function_call and
    tool_calls, nulls included; ``parse()``'s ``parsed`` and ``parsed_arguments``) is
    valid input for the next turn."""
    first = create(client, tool_choice=NAMED, seed=1)
    called = first.choices[0].message
    dumped = called.model_dump()
    assert {"annotations", "refusal", "audio", "function_call"} <= set(dumped)
    plain = create(client, tools=None, max_tokens=4, seed=2).choices[0].message.model_dump()
    plain["annotations"] = []
    messages = [*MSG, dumped, {"role": "tool", "tool_call_id": called.tool_calls[0].id,
                               "content": "5"}, plain, {"role": "user", "content": "Thanks"}]
    out = create(client, messages=messages, max_tokens=4, seed=3)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    parsed = client.chat.completions.parse(
        model=MODEL_NAME, messages=MSG, tools=[openai.pydantic_function_tool(Add, name="add")],
        tool_choice=NAMED, logit_bias=no_whitespace(), max_tokens=96, seed=4)
    answer = client.chat.completions.parse(model=MODEL_NAME, messages=MSG, response_format=Sum,
                                           logit_bias=no_whitespace(), max_tokens=96, seed=4)
    sent = [parsed.choices[0].message.model_dump(), answer.choices[0].message.model_dump()]
    assert sent[0]["tool_calls"][0]["function"]["parsed_arguments"] and sent[1]["parsed"]
    call_id = sent[0]["tool_calls"][0]["id"]
    out = create(client, messages=[*MSG, sent[0], {"role": "tool", "tool_call_id": call_id,
                                                   "content": "5"}, sent[1]], max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as info:  # what would change the output
        create(client, messages=[*MSG, {**dumped, "refusal": "no"}], max_tokens=2)
    assert info.value.param.startswith("messages")
    with pytest.raises(openai.BadRequestError) as info:
        create(client, max_tokens=2, extra_body={"no_such_option": 1})
    assert info.value.param == "no_such_option"


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_makes_one_call(client, stream: bool) -> None:
    """Point 6: a named ``tool_choice`` ends after exactly one call (parallel_tool_calls
    left at its default, true)."""
    out = create(client, tool_choice=NAMED, n=6, seed=7, max_tokens=200, stream=stream)
    if not stream:
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert len(choice.message.tool_calls) == 1 and choice.message.content is None
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                                ADD)
        return
    calls: dict[int, set[int]] = {}
    finish = {}
    for chunk in out:
        for ch in chunk.choices:
            for piece in ch.delta.tool_calls or ():
                calls.setdefault(ch.index, set()).add(piece.index)
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert all(v == {0} for v in calls.values()) and len(calls) == 6, calls
    assert set(finish.values()) == {"tool_calls"}


def test_cut_call_leaves_no_markup(client) -> None:
    """Point 7: a call block cut by max_tokens is not returned as content."""
    kwargs = {"tool_choice": "required", "max_tokens": 6, "n": 2, "seed": 5}
    whole = create(client, **kwargs)
    for choice in whole.choices:
        assert choice.finish_reason == "length"
        assert choice.message.content is None and choice.message.tool_calls is None
    text = "".join(ch.delta.content or "" for chunk in create(client, stream=True, **kwargs)
                   for ch in chunk.choices)
    assert text == ""
    auto = create(client, tool_choice="auto", max_tokens=12, n=4, seed=9)
    for choice in auto.choices:
        assert "<tool" not in (choice.message.content or ""), choice


def test_arguments_hold_declared_properties_only(client) -> None:
    """Point 8: without additionalProperties in the schema, arguments still hold only
    ``a`` and ``b``; ``strict_tool_arguments: false`` keeps the schema as written."""
    out = create(client, tools=OPEN_TOOLS, tool_choice=NAMED, n=6, seed=13, max_tokens=200)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        args = json.loads(choice.message.tool_calls[0].function.arguments)
        assert set(args) == {"a", "b"}, args
    loose = create(client, tools=OPEN_TOOLS, tool_choice=NAMED, max_tokens=200, seed=13,
                   extra_body={"strict_tool_arguments": False})
    assert loose.choices[0].finish_reason in ("tool_calls", "length")
    nested = {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "x": {"type": "integer"}}}, "q": {"type": "object", "additionalProperties": True,
                                          "properties": {}}}}
    closed = strict_schema(nested)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["p"]["additionalProperties"] is False
    assert closed["properties"]["q"]["additionalProperties"] is True
    plan = plan_tools(OPEN_TOOLS, NAMED)
    assert '"additionalProperties": false' in tool_grammar(plan)
    assert "additionalProperties" not in tool_grammar(plan, strict=False)


def test_tools_with_json_schema_answer(client) -> None:
    """Point 2: tools and response_format json_schema together: each choice either
    calls a tool or answers with JSON that follows the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    out = create(client, response_format=fmt, n=8, seed=21, max_tokens=120,
                 parallel_tool_calls=False)
    kinds = set()
    for choice in out.choices:
        if choice.message.tool_calls:
            kinds.add("call")
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                                ADD)
        elif choice.finish_reason == "stop":
            kinds.add("answer")
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
    assert kinds == {"call", "answer"}, out
    required = create(client, response_format=fmt, tool_choice="required", seed=2,
                      parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"


def test_vllm_chat_options(client, ts) -> None:
    """Point 10: continue_final_message renders the last message open; template kwargs
    and add_generation_prompt are accepted (reserved template names are not)."""
    tok = ts.engine.tokenizer
    conv = [*MSG, {"role": "assistant", "content": "The answer is"}]
    rendered = tok.apply_chat_template(conv, add_generation_prompt=False)
    expected = rendered[:rendered.rindex("The answer is") + len("The answer is")]
    assert expected != rendered
    out = create(client, messages=conv, tools=None, max_tokens=1,
                 extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
    plain = create(client, tools=None, max_tokens=1)
    kw = create(client, tools=None, max_tokens=1,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kw.usage.prompt_tokens == plain.usage.prompt_tokens
    no_prompt = create(client, tools=None, max_tokens=1,
                       extra_body={"add_generation_prompt": False})
    assert no_prompt.usage.prompt_tokens < plain.usage.prompt_tokens
    for extra in ({"chat_template_kwargs": {"tools": []}}, {"continue_final_message": True}):
        with pytest.raises(openai.BadRequestError):
            create(client, tools=None, max_tokens=1, extra_body=extra)


def test_fingerprint_models_and_routes(client, ts) -> None:
    """Point 10 / 9 and models.retrieve."""
    body = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2}
    raw = httpx.post(f"{ts.url}/v1/chat/completions", json=body, timeout=60).json()
    assert "system_fingerprint" in raw
    with httpx.stream("POST", f"{ts.url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and all("system_fingerprint" in c for c in chunks)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-nope")
    assert info.value.code == "model_not_found"
    missing = httpx.post(f"{ts.url}/v1/nope", json={}, timeout=10)
    assert missing.status_code == 404
    assert "POST /v1/nope" in missing.json()["error"]["message"]
    wrong = httpx.get(f"{ts.url}/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]
