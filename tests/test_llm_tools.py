"""Offline tool calling: ``LLM.chat(tools=...)`` and the model-independent ``tool_calls``.

Plan / grammar / render / parse units need no model; the tiny random Llama with the
default model's tokenizer checks that the offline result equals the server's for the
same request (greedy), and the errors; ``slow`` tests run the default model through
required / named / none / auto / parallel and a follow-up turn, every call's arguments
validated against its tool's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.llm import LLM
from roseinfer.outputs import CompletionOutput, RequestOutput, ToolCall
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_outputs import StructuredOutputsParams
from roseinfer.tool_calls import (
    DEFAULT_TOOL_PROMPT,
    Tool,
    call_text,
    chat_text,
    conversation,
    parse_tool_calls,
    parse_tools,
    plan_tools,
    tool_constraint,
    tool_grammar,
    with_tool_calls,
)
from tests.server.helpers import TinyServer
from tests.server.test_structured_http import no_whitespace
from tests.server.tokenizer_server import MODEL_NAME, tokenizer_engine, tokenizer_server

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ADD_CHOICE = {"type": "function", "function": {"name": "add"}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_calls(out: CompletionOutput, names: set[str]) -> None:
    assert out.tool_calls and out.finish_reason == "tool_calls", out
    for call in out.tool_calls:
        assert call.id.startswith("call_") and call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ------------------------------------------------------------------ no model
@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
    ([TOOLS[0], TOOLS[0]], None, "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, "tools"),
    ({"type": "function"}, None, "tools"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, {"type": "function", "name": "add"}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tool_requests_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        plan_tools(tools, choice)
    assert info.value.param == param, info.value


def test_plans() -> None:
    assert plan_tools(None).mode == "none" and not plan_tools([]).active
    auto = plan_tools(TOOLS)
    assert auto.mode == "auto" and auto.parallel and [t.name for t in auto.allowed] == [
        "get_weather", "add"]
    named = plan_tools(TOOLS, ADD_CHOICE, parallel_tool_calls=False)
    assert named.mode == "required" and [t.name for t in named.allowed] == ["add"]
    assert not named.parallel and len(named.tools) == 2
    tool = parse_tools([{"type": "function", "function": {"name": "f"}}])[0]
    assert tool == Tool("f") and tool.openai() == {"type": "function", "function": {"name": "f"}}
    assert tool.schema == {"type": "object", "properties": {}}


def test_grammar_shapes() -> None:
    required = tool_grammar(plan_tools(TOOLS, "required", False))
    assert required.startswith('start: "<tool_call>" calls\ncalls: body\n')
    assert "call_0 | call_1" in required and "%json" in required
    parallel = tool_grammar(plan_tools(TOOLS, "required"))
    assert '("\\n"? "<tool_call>" body)*' in parallel and "call_1" in parallel
    named = tool_grammar(plan_tools(TOOLS, ADD_CHOICE))  # one call, even with parallel calls on
    assert "<tool_call>\" body" not in named and "call_1" not in named
    assert tool_grammar(plan_tools(TOOLS)).startswith("start: TEXT | TEXT_CALL calls")


def test_parse_completion_text() -> None:
    text = ('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>\n ')
    content, calls = parse_tool_calls(text)
    assert content == "Let me see. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3})]
    assert parse_tool_calls("no calls <tool_") == ("no calls <tool_", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])
    cut = '<tool_call>{"name": "add", "argu'
    assert parse_tool_calls(cut) == (cut, [])


def test_outputs_get_tool_calls_and_finish_reason() -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'

    def out(text: str, reason: str) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, [5], reason)], True)

    made = with_tool_calls(out("hi " + call, "stop")).outputs[0]
    assert made.text == "hi " and made.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in made.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    cut = with_tool_calls(out(call + "\n<tool_call>{", "length")).outputs[0]
    assert cut.finish_reason == "length" and len(cut.tool_calls) == 1
    assert cut.text == ""  # the unfinished block is dropped, never returned as markup
    plain = with_tool_calls(out("just text", "stop")).outputs[0]
    assert plain.text == "just text" and plain.tool_calls == () and plain.finish_reason == "stop"


def follow_up(call: ToolCall | dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "developer", "content": "Be brief."}, *MSG,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


def test_conversation_plain_and_native() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')
    tools = parse_tools(TOOLS)
    plain = conversation(follow_up(call), native=False, tools=tools)
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert plain[0]["content"].startswith("Be brief.\n\nYou may call")
    assert json.dumps(TOOLS[0]) in plain[0]["content"]
    assert plain[2]["content"] == call_text(call.name, call.arguments)
    assert plain[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'
    # the OpenAI dict of the call (arguments as text or as an object) renders the same
    as_dict = conversation(follow_up(call.openai()), native=False, tools=tools)
    args_obj = {**call.openai(), "function": {"name": call.name,
                                              "arguments": json.loads(call.arguments)}}
    assert as_dict == plain == conversation(follow_up(args_obj), native=False, tools=tools)
    native = conversation(follow_up(call), native=True)
    assert native[2]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]
    assert native[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    parts = conversation([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}], False)
    assert parts == [{"role": "user", "content": "ab"}]
    assert conversation(MSG, False, tools)[0] == {"role": "system",
                                                  "content": DEFAULT_TOOL_PROMPT.format(
                                                      tools="\n".join(json.dumps(t)
                                                                      for t in TOOLS))}


@pytest.mark.parametrize("bad", [[{"content": "no role"}], [{"role": "user", "content": 3}],
                                 [{"role": "assistant", "tool_calls": [{"id": "x"}]}]])
def test_malformed_messages_name_messages(bad: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        conversation(bad, native=False)
    assert info.value.param == "messages"


class _TemplateWithTools:
    """A tokenizer stand-in whose template prints the tools it is given."""

    chat_template = "fake"

    @property
    def hf(self) -> _TemplateWithTools:
        return self

    def apply_chat_template(self, conv: list[dict[str, Any]], tools: Any = None,
                            tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return json.dumps({"messages": conv, "tools": tools})


def test_native_templates_get_the_tools() -> None:
    tok = _TemplateWithTools()
    rendered = json.loads(chat_text(tok, MSG, parse_tools(TOOLS)))
    assert rendered == {"messages": MSG, "tools": TOOLS}
    assert json.loads(chat_text(tok, MSG)) == {"messages": MSG, "tools": None}


# ------------------------------------------------------ tiny model, real tokenizer
@pytest.fixture(scope="module")
def tiny_llm() -> LLM:
    return LLM.from_engine(tokenizer_engine())


@pytest.fixture(scope="module")
def ts() -> Iterator[TinyServer]:
    with tokenizer_server() as server:
        yield server


def greedy(max_tokens: int = 64, **kw: Any) -> SamplingParams:
    bias = {int(k): v for k, v in no_whitespace().items()}
    return SamplingParams(max_tokens=max_tokens, logit_bias=bias, **{"temperature": 0.0, **kw})


@pytest.mark.parametrize("kwargs", [
    {"tool_choice": "required"},
    {"tool_choice": ADD_CHOICE, "parallel_tool_calls": False},
    {"tool_choice": "auto", "parallel_tool_calls": False},
    {"tool_choice": "none"},
])
def test_offline_equals_the_server(tiny_llm: LLM, ts: TinyServer, kwargs: dict[str, Any]) -> None:
    """Same engine weights, same request, greedy: the same content, calls and finish."""
    offline = tiny_llm.chat(MSG, greedy(), tools=TOOLS, **kwargs)[0].outputs[0]
    body = {"model": MODEL_NAME, "messages": MSG, "tools": TOOLS, "max_tokens": 64,
            "temperature": 0, "logit_bias": no_whitespace(), **kwargs}
    resp = httpx.post(f"{ts.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in choice["message"].get("tool_calls") or ()]
    assert [(c.name, c.arguments) for c in offline.tool_calls] == calls
    assert (offline.text or None) == choice["message"]["content"]
    assert offline.finish_reason == choice["finish_reason"]
    if kwargs["tool_choice"] != "none" and offline.finish_reason == "tool_calls":
        for call in offline.tool_calls:
            json.loads(call.arguments)


def test_offline_required_calls_follow_the_schemas(tiny_llm: LLM) -> None:
    outs = tiny_llm.chat(MSG, greedy(160, n=3, temperature=0.8, seed=1), tools=TOOLS,
                         tool_choice="required", parallel_tool_calls=False)
    for out in outs[0].outputs:
        valid_calls(out, {"get_weather", "add"})
        assert out.text == "" and len(out.tool_calls) == 1


def test_offline_errors(tiny_llm: LLM) -> None:
    bad_schema = [{"type": "function", "function": {"name": "f",
                                                    "parameters": {"type": "bogus"}}}]
    for tools, choice in ((bad_schema, "auto"), (bad_schema, "none")):
        with pytest.raises(InvalidRequestError) as info:
            tiny_llm.chat(MSG, greedy(2), tools=tools, tool_choice=choice)
        assert info.value.param == "tools"
    json_params = greedy(2, structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(InvalidRequestError, match="SamplingParams.structured_outputs") as info:
        tiny_llm.chat(MSG, json_params, tools=TOOLS)
    assert info.value.param == "tools"
    with pytest.raises(InvalidRequestError) as info:
        tiny_llm.chat(MSG, greedy(2), tools=TOOLS, tool_choice={"type": "function",
                                                                 "function": {"name": "nope"}})
    assert info.value.param == "tool_choice"
    # tool_choice "none" keeps the request's own constraint; no tools is a plain chat
    out = tiny_llm.chat(MSG, json_params, tools=TOOLS, tool_choice="none")[0].outputs[0]
    assert out.tool_calls == ()
    plain = tiny_llm.chat(MSG, greedy(3))[0]
    assert plain.prompt_token_ids == tiny_llm.render_chat(MSG)


def test_none_hides_the_tools_and_follow_ups_render(tiny_llm: LLM) -> None:
    none = tiny_llm.chat(MSG, greedy(2), tools=TOOLS, tool_choice="none")[0]
    assert none.prompt_token_ids == tiny_llm.render_chat(MSG)
    first = tiny_llm.chat(MSG, greedy(), tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False)[0].outputs[0]
    call = first.tool_calls[0]
    turn = [*MSG, {"role": "assistant", "content": first.text or None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    out = tiny_llm.chat(turn, greedy(4), tools=TOOLS)[0]
    text = tiny_llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert call_text(call.name, call.arguments) in text and "<tool_response>" in text
    assert out.prompt_token_ids == tiny_llm.render_chat(
        [*MSG, {"role": "assistant", "content": None, "tool_calls": [call.openai()]}, turn[2]],
        parse_tools(TOOLS))


# ------------------------------------------------------------ the default model
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_gb=0.25, max_num_batched_tokens=512)


def ask(llm: LLM, content: str, max_tokens: int = 64, **kwargs: Any) -> CompletionOutput:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat([{"role": "user", "content": content}], params, tools=TOOLS,
                    **kwargs)[0].outputs[0]


@pytest.mark.slow
def test_default_model_required_named_and_parallel(llm: LLM) -> None:
    out = ask(llm, "What is the weather in Paris?", tool_choice="required",
              parallel_tool_calls=False)
    valid_calls(out, {"get_weather", "add"})
    assert len(out.tool_calls) == 1 and out.text == ""
    assert json.loads(out.tool_calls[0].arguments)["city"] == "Paris"
    out = ask(llm, "What is 12 plus 30?", tool_choice=ADD_CHOICE, parallel_tool_calls=False)
    valid_calls(out, {"add"})
    assert json.loads(out.tool_calls[0].arguments) == {"a": 12, "b": 30}
    out = ask(llm, "What is the weather in Paris and in London?", 96, tool_choice="required")
    valid_calls(out, {"get_weather", "add"})
    cities = {json.loads(c.arguments)["city"] for c in out.tool_calls}
    assert len(out.tool_calls) >= 2 and {"Paris", "London"} <= cities


@pytest.mark.slow
def test_default_model_auto_and_none(llm: LLM) -> None:
    out = ask(llm, "Say hello.", 16, tool_choice="auto")
    assert "<tool_call>" not in out.text or out.finish_reason == "length"
    if out.tool_calls:
        valid_calls(out, {"get_weather", "add"})
    out = ask(llm, "What is the weather in Paris?", 8, tool_choice="none")
    assert out.tool_calls == () and out.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_default_model_matches_generate_and_follows_up(llm: LLM) -> None:
    """The chat result is the rendered prompt + the tools' grammar through generate."""
    out = ask(llm, "What is the weather in Paris?", tool_choice="required",
              parallel_tool_calls=False)
    plan = plan_tools(TOOLS, "required", False)
    spec = tool_constraint(plan, llm.engine.validator.compile_grammar)
    ref = llm.generate(llm.render_chat(MSG, plan.tools),
                       SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=spec))
    content, calls = parse_tool_calls(ref[0].outputs[0].text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [(c.name, c.arguments)
                                                              for c in calls]
    assert out.text == content
    call = out.tool_calls[0]
    turn = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call.openai()]},
            {"role": "tool", "tool_call_id": call.id,
             "content": '{"temperature": 21, "unit": "celsius"}'}]
    answer = llm.chat(turn, SamplingParams(temperature=0.0, max_tokens=32), tools=TOOLS,
                      tool_choice="none")[0].outputs[0]
    assert answer.text and answer.tool_calls == ()
    assert answer.finish_reason in ("stop", "length")
