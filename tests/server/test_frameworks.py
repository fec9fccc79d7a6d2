"""Agent frameworks against a real uvicorn (issue 26): openai-agents, pydantic-ai,
LangChain (langchain-openai) and litellm, as app developers call them, over the default
model (the session's one `roseinfer serve` process, tests/server/conftest.py).

The tests assert the protocol, not the model's wisdom: each round trip succeeds,
the framework parses our responses (whole and streamed), constrained answers validate
against the pydantic model, a named tool is called exactly once and executed once per
call, our own items sent back in the next turn are accepted, and usage adds up.
instructor is not here: every instructor release pins jiter below what the openai SDK
the other tests use requires (docs/serving.md, Agent frameworks)."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
from types import ModuleType
from typing import Any

import pytest
from agents import Agent as AgentsAgent
from agents import (
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.models.openai import OpenAIResponsesModel as PydanticResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.server.framework_helpers import (
    MAX_TOKENS,
    MODEL_NAME,
    PROMPT,
    TOOL_RESULT,
    ForceToolOnce,
    Weather,
    WeatherTool,
    async_client,
    litellm_offline,
    sampling,
)
from tests.server.helpers import ServerProcess
from tests.server.test_structured_http import no_whitespace

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

HIDDEN = 576  # SmolLM2-135M's hidden size: the embeddings' length
TEXT_TOKENS = 16  # plain-text turns: a story outlasts the budget; answers need no more
NO_TRACING = RunConfig(tracing_disabled=True)  # openai-agents would export traces


@pytest.fixture(scope="module")
def ts(server: ServerProcess) -> ServerProcess:
    """The session's default-model server (loaded once for every module that uses it)."""
    return server


@pytest.fixture(scope="module")
def bias() -> dict[str, int]:
    return no_whitespace()


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    with litellm_offline():
        return importlib.import_module("litellm")


# ----------------------------------------------------------------- openai-agents
@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_openai_agents_tool_then_output_type(ts, bias, model_class) -> None:
    """The Agents SDK's default (Responses) model and its chat model: a named tool, then
    an ``output_type`` answer in the same run (tools beside a json_schema format)."""
    tool = WeatherTool()
    s = sampling(bias)
    agent = AgentsAgent(
        name="weather", instructions="Answer with the weather.",
        model=model_class(model=MODEL_NAME, openai_client=async_client(ts.url)),
        tools=[function_tool(tool.function())], output_type=Weather,
        hooks=ForceToolOnce("get_weather"), reset_tool_choice=False,
        model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS,
                                     extra_body=s["extra_body"]))
    result = Runner.run_sync(agent, PROMPT, max_turns=4, run_config=NO_TRACING)
    assert isinstance(result.final_output, Weather)
    first = [item for item in result.raw_responses[0].output if item.type == "function_call"]
    assert len(first) == 1 and first[0].name == "get_weather"  # one call for a named tool
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(tool.cities) == len(calls) == len(outputs) >= 1  # each call executed once
    assert [c.raw_item.call_id for c in calls] == [o.raw_item["call_id"] for o in outputs]
    assert all(o.output == TOOL_RESULT for o in outputs)
    usage = result.context_wrapper.usage
    assert usage.requests == len(result.raw_responses) >= 2
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_openai_agents_streamed_then_replayed(ts, bias) -> None:
    """A streamed run (the SDK checks our event sequence) whose items, ids and statuses
    included, go back as the next run's input."""
    tool = WeatherTool()
    agent = AgentsAgent(
        name="weather", model=OpenAIResponsesModel(model=MODEL_NAME,
                                                   openai_client=async_client(ts.url)),
        tools=[function_tool(tool.function())], output_type=Weather,
        hooks=ForceToolOnce("get_weather"), reset_tool_choice=False,
        model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS,
                                     extra_body=sampling(bias)["extra_body"]))

    async def run() -> tuple[Any, list[str], Any]:
        streamed = Runner.run_streamed(agent, PROMPT, max_turns=4, run_config=NO_TRACING)
        kinds = [event.type async for event in streamed.stream_events()]
        follow = [*streamed.to_input_list(), {"role": "user", "content": "And in Rome?"}]
        again = await Runner.run(agent, follow, max_turns=4, run_config=NO_TRACING)
        return streamed, kinds, again

    streamed, kinds, again = asyncio.run(run())
    assert isinstance(streamed.final_output, Weather) and isinstance(again.final_output, Weather)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    replayed = [i for i in streamed.to_input_list() if i.get("type") == "function_call"]
    assert replayed and all(i["id"].startswith("fc_") for i in replayed)
    assert len(tool.cities) == sum(1 for r in (streamed, again) for i in r.new_items
                                   if i.type == "tool_call_item")


# ------------------------------------------------------------------- pydantic-ai
def _force_tool_once(bias: dict[str, int]) -> Any:
    """pydantic-ai's per-step settings: the tool on the first step, the answer next."""
    def settings(ctx: Any) -> dict[str, Any]:
        first = ctx.run_step <= 1
        return {**sampling(bias), "parallel_tool_calls": False,
                "tool_choice": ["get_weather"] if first else "none"}
    return settings


@pytest.mark.parametrize("model_class", [PydanticResponsesModel, OpenAIChatModel])
def test_pydantic_ai_native_output_with_tools(ts, bias, model_class) -> None:
    """``NativeOutput`` (json_schema) with a tool: pydantic-ai sends both in one request."""
    tool = WeatherTool()
    provider = OpenAIProvider(openai_client=async_client(ts.url))
    agent = PydanticAgent(model_class(MODEL_NAME, provider=provider),
                          output_type=NativeOutput(Weather), tools=[tool.function()],
                          instructions="Answer with the weather.",
                          model_settings=_force_tool_once(bias))
    result = agent.run_sync(PROMPT)
    assert isinstance(result.output, Weather)
    parts = [p for m in result.all_messages() for p in m.parts]
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    returns = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert len(calls) == len(returns) == len(tool.cities) == 1
    assert calls[0].tool_call_id == returns[0].tool_call_id
    assert result.usage.requests == 2 and result.usage.tool_calls == 1
    # the whole history (our response ids, call ids, items) sent back
    again = agent.run_sync("And in Rome?", message_history=result.all_messages())
    assert isinstance(again.output, Weather) and len(tool.cities) == 2


def test_pydantic_ai_streamed_structured_output(ts, bias) -> None:
    provider = OpenAIProvider(openai_client=async_client(ts.url))
    agent = PydanticAgent(PydanticResponsesModel(MODEL_NAME, provider=provider),
                          output_type=NativeOutput(Weather), model_settings=sampling(bias))

    async def run() -> list[Any]:
        async with agent.run_stream(PROMPT) as streamed:
            return [out async for out in streamed.stream_output()]

    outputs = asyncio.run(run())
    assert outputs and isinstance(outputs[-1], Weather)


# --------------------------------------------------------------------- LangChain
def chat_openai(ts: ServerProcess, bias: dict[str, int], responses: bool,
                max_tokens: int = MAX_TOKENS) -> ChatOpenAI:
    s = sampling(bias)
    return ChatOpenAI(model=MODEL_NAME, base_url=f"{ts.url}/v1", api_key="unused",
                      temperature=0, max_tokens=max_tokens, max_retries=0,
                      use_responses_api=responses, extra_body=s["extra_body"],
                      stream_usage=True)


def text_of(message: AIMessage) -> str:
    return message.text if isinstance(message.text, str) else message.text()


@pytest.mark.parametrize("responses", [True, False], ids=["responses", "chat"])
def test_langchain_invoke_and_stream(ts, bias, responses) -> None:
    llm = chat_openai(ts, bias, responses, TEXT_TOKENS)
    whole = llm.invoke("Tell me a story.")
    chunks = list(llm.stream("Tell me a story."))
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined = joined + chunk
    assert text_of(joined) == text_of(whole) != ""  # greedy: the same tokens
    for usage in (whole.usage_metadata, joined.usage_metadata):
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert usage["output_tokens"] == TEXT_TOKENS


def test_langchain_previous_response_id(ts, bias) -> None:
    """``use_previous_response_id``: LangChain sends only the turn's new messages and the
    last response's id; the server puts the stored conversation before them."""
    llm = chat_openai(ts, bias, True, TEXT_TOKENS).model_copy(
        update={"use_previous_response_id": True})
    first = llm.invoke([HumanMessage("Tell me a story.")])
    second = llm.invoke([HumanMessage("Tell me a story."), first, HumanMessage("Go on.")])
    used, prior = second.usage_metadata, first.usage_metadata
    assert second.response_metadata["id"] != first.response_metadata["id"]
    assert used["input_tokens"] > prior["input_tokens"] + prior["output_tokens"]
    assert used["input_token_details"]["cache_read"] > 0  # the stored turn's prefix


@pytest.mark.parametrize("responses", [True, False], ids=["responses", "chat"])
def test_langchain_structured_output_function_calling(ts, bias, responses) -> None:
    """``with_structured_output(method="function_calling")``: one named tool call."""
    structured = chat_openai(ts, bias, responses).with_structured_output(
        Weather, method="function_calling", include_raw=True)
    out = structured.invoke(PROMPT)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Weather)
    assert len(out["raw"].tool_calls) == 1 and out["raw"].tool_calls[0]["name"] == "Weather"


@pytest.mark.parametrize("responses", [True, False], ids=["responses", "chat"])
def test_langchain_bind_tools_round_trip(ts, bias, responses) -> None:
    tool = WeatherTool()
    get_weather = tool.function()
    llm = chat_openai(ts, bias, responses)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    messages: list[Any] = [HumanMessage(PROMPT)]
    ai = forced.invoke(messages)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
    result = get_weather(**ai.tool_calls[0]["args"])
    messages += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    answer = chat_openai(ts, bias, responses, TEXT_TOKENS).bind_tools(
        [get_weather], tool_choice="none").invoke(messages)
    assert answer.tool_calls == [] and text_of(answer)
    streamed = list(forced.stream(messages[:1]))
    joined = streamed[0]
    for chunk in streamed[1:]:
        joined = joined + chunk
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [
        (c["name"], c["args"]) for c in ai.tool_calls]
    assert len(tool.cities) == 1


def test_langchain_embeddings(ts) -> None:
    """``OpenAIEmbeddings`` on a non-OpenAI server: ``check_embedding_ctx_length=False``
    sends text (LangChain's own default would tokenize with tiktoken's OpenAI
    vocabulary, downloaded at first use)."""
    emb = OpenAIEmbeddings(model=MODEL_NAME, base_url=f"{ts.url}/v1", api_key="unused",
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(["the quick brown fox", "jumps over"])
    query = emb.embed_query("the quick brown fox")
    assert [len(v) for v in docs] == [HIDDEN, HIDDEN] and len(query) == HIDDEN
    assert math.isclose(math.fsum(x * x for x in query), 1.0, rel_tol=1e-5)
    assert query == pytest.approx(docs[0], abs=1e-6)


# ----------------------------------------------------------------------- litellm
def test_litellm_openai_routes(ts, litellm) -> None:
    """litellm's openai provider: completion (whole and streamed), responses, embedding
    (16 tokens: litellm raises a smaller ``max_output_tokens`` to OpenAI's minimum, 16)."""
    kw = {"model": f"openai/{MODEL_NAME}", "api_base": f"{ts.url}/v1", "api_key": "unused"}
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = litellm.completion(messages=messages, max_tokens=16, temperature=0, **kw)
    chunks = list(litellm.completion(messages=messages, max_tokens=16, temperature=0,
                                     stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    out = litellm.responses(input="Tell me a story.", max_output_tokens=16, temperature=0, **kw)
    assert out.status == "incomplete" and out.usage.output_tokens == 16
    assert out.output[0].content[0].text == text  # the same greedy turn
    emb = litellm.embedding(input=["a b", "c"], **kw)
    assert [len(d["embedding"]) for d in emb.data] == [HIDDEN, HIDDEN]


def test_litellm_anthropic_messages(ts, litellm) -> None:
    """litellm's anthropic provider on /v1/messages: a named tool (one ``tool_use``),
    streamed, a ``tool_result`` follow-up, and usage mapped back to OpenAI's counts."""
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                       "required": ["city"]}}}
    kw = {"model": f"anthropic/{MODEL_NAME}", "api_base": ts.url, "api_key": "unused",
          "messages": [{"role": "user", "content": PROMPT}], "tools": [tool],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = litellm.completion(**kw)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **kw))
    arguments = "".join(tc.function.arguments or "" for c in chunks if c.choices
                        for tc in c.choices[0].delta.tool_calls or ())
    assert arguments == calls[0].function.arguments
    follow = [*kw["messages"], whole.choices[0].message.model_dump(),
              {"role": "tool", "tool_call_id": calls[0].id, "content": TOOL_RESULT}]
    answer = litellm.completion(**{**kw, "messages": follow, "tool_choice": "none",
                                    "max_tokens": TEXT_TOKENS})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    usage = [c.usage for c in chunks if getattr(c, "usage", None)][-1]
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: litellm adds Anthropic's cache reads back into prompt_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
