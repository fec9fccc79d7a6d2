"""Reasoning items of the Responses API through the official `openai` client, against a
real uvicorn over a TINY random Qwen3 (the chat reasoning tests' tokenizer and Qwen3
template, whose generation prompt here opens ``<think>`` as thinking-only templates do).
A bias on ``</think>`` makes the random model close the block, so a response holds a
``reasoning`` item then a ``message``; streamed, the ``reasoning_text`` events join to
the same item; ``reasoning.effort: "none"`` closes the block in the prompt; a reasoning
item sent back reaches the template as the assistant's ``reasoning_content``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.state import ServerSettings
from roseinfer.tokenizer import Tokenizer
from tests.server.helpers import ServerThread
from tests.server.qwen3_helpers import QWEN3_TEMPLATE, qwen3_engine, qwen3_tokenizer

MODEL = "tiny-qwen3"
# thinking on unless enable_thinking is false: the generation prompt opens <think>
_CLOSED = "    {%- endif %}\n{%- endif %}"
TEMPLATE = QWEN3_TEMPLATE[:QWEN3_TEMPLATE.rindex(_CLOSED)] + (
    "    {%- else %}\n        {{- '<think>\\n' }}\n" + _CLOSED)
ASK = "why is the sky blue"
REASONING_EVENTS = ["response.output_item.added", "response.content_part.added",
                    "response.reasoning_text.delta"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Tokenizer]]:
    tokenizer = qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"), TEMPLATE)
    app = create_app(AsyncEngine(qwen3_engine(tokenizer)),
                     ServerSettings(served_model_names=(MODEL,)))
    with ServerThread(app) as st:
        yield st.url, tokenizer


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def create(client: openai.OpenAI, tok: Tokenizer, seed: int = 3, **kwargs: Any) -> Any:
    """A response; a bias on ``</think>`` lets the random model close its block."""
    close = tok.encode("</think>", add_special_tokens=False)[0]
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 24, "temperature": 1.0,
            "extra_body": {"logit_bias": {str(close): 4.0}, "seed": seed}, **kwargs}
    return client.responses.create(**body)


def split_response(client: openai.OpenAI, tok: Tokenizer) -> tuple[Any, int]:
    """A response that closed its think block and answered (and its seed)."""
    for seed in range(12):
        out = create(client, tok, seed)
        if [item.type for item in out.output] == ["reasoning", "message"]:
            return out, seed
    raise AssertionError("no seed closed the think block")


def test_reasoning_item_then_message(client, server) -> None:
    out, _ = split_response(client, server[1])
    reasoning, message = out.output
    assert reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert reasoning.summary == [] and reasoning.encrypted_content is None
    text = reasoning.content[0].text
    assert reasoning.content[0].type == "reasoning_text" and text
    assert "<think>" not in text and "</think>" not in text
    assert out.output_text == message.content[0].text  # the SDK's join leaves reasoning out


def test_reasoning_tokens_are_exact(client, server) -> None:
    """``reasoning_tokens`` counts the generated tokens before ``</think>`` (the prompt
    opened the block): the same seeded turn through chat completions, with a logprobs
    entry per generated token, shows where the close tag came."""
    tok = server[1]
    out, seed = split_response(client, tok)
    close = tok.encode("</think>", add_special_tokens=False)[0]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_completion_tokens=24,
        temperature=1.0, seed=seed, logit_bias={str(close): 4.0}, logprobs=True)
    tokens = [entry.token for entry in chat.choices[0].logprobs.content]
    assert len(tokens) == out.usage.output_tokens == chat.usage.completion_tokens
    assert chat.choices[0].message.reasoning_content == out.output[0].content[0].text
    assert 0 < out.usage.output_tokens_details.reasoning_tokens == tokens.index("</think>")


def test_stream_reasoning_events(client, server) -> None:
    tok = server[1]
    whole, seed = split_response(client, tok)
    events = list(create(client, tok, seed, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == REASONING_EVENTS
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas == done.text == whole.output[0].content[0].text
    first_text = kinds.index("response.output_item.added", 3)
    assert kinds[first_text - 3:first_text] == ["response.reasoning_text.done",
                                                "response.content_part.done",
                                                "response.output_item.done"]
    assert events[first_text].output_index == 1 and events[first_text].item.type == "message"
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert [i.type for i in final.output] == ["reasoning", "message"]


def test_effort_none_and_reasoning_sent_back(client, server) -> None:
    tok = server[1]
    thinking = create(client, tok, max_output_tokens=1)
    off = create(client, tok, max_output_tokens=1, reasoning={"effort": "none"})
    assert off.reasoning.effort == "none"
    prompt = tok.hf.apply_chat_template([{"role": "user", "content": ASK}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert off.usage.input_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert off.usage.input_tokens > thinking.usage.input_tokens
    assert [i.type for i in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0
    # a reasoning item before a call, after the last user message, is rendered back
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "I should call f"}]}
    turns = [create(client, tok, max_output_tokens=1,
                    input=[{"role": "user", "content": ASK}, *items, call, result])
             for items in ([thought], [])]
    assert turns[0].usage.input_tokens > turns[1].usage.input_tokens
