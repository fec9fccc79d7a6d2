"""A thinking model's ``<think>`` block as ``reasoning_content`` (issue 26), through the
official `openai` client against a real uvicorn over a TINY random Qwen3 with a
Qwen3-style tokenizer (``<think>``/``</think>`` as tokens of their own) and Qwen3's chat
template, written here. The assistant turn is left open inside ``<think>`` and a bias on
``</think>`` makes the random model close it, so both sides of the split occur: whole,
streamed (``delta.reasoning_content``), with ``enable_thinking`` off and reasoning sent
back. ``ChoiceReader`` itself is checked on known texts, in every chunking."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.chat_reader import ChoiceReader, reasoning_token_count
from roseinfer.server.state import ServerSettings
from roseinfer.tokenizer import Tokenizer
from tests.server.helpers import ServerThread
from tests.server.qwen3_helpers import qwen3_engine, qwen3_tokenizer

MODEL = "tiny-qwen3"
MSG = [{"role": "user", "content": "why is the sky blue"}]
# The assistant's turn left open inside <think> (continue_final_message): the random model
# goes on reasoning; a bias on </think> makes it close the block, then answer.
THINKING = [*MSG, {"role": "assistant", "content": "<think>\nlet me see"}]
OPEN = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Tokenizer]]:
    tokenizer = qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"))
    app = create_app(AsyncEngine(qwen3_engine(tokenizer)),
                     ServerSettings(served_model_names=(MODEL,)))
    with ServerThread(app) as st:
        yield st.url, tokenizer


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def ask(client: openai.OpenAI, tok: Tokenizer, **kwargs: Any) -> Any:
    close = tok.encode("</think>", add_special_tokens=False)[0]
    body = {"model": MODEL, "messages": THINKING, "max_tokens": 24, "seed": 3,
            "temperature": 1.0, "logit_bias": {str(close): 4.0}, "extra_body": OPEN, **kwargs}
    return client.chat.completions.create(**body)


def test_think_block_is_reasoning_content(client, server) -> None:
    out = ask(client, server[1], n=6)
    split = 0
    for choice in out.choices:
        message = choice.message
        reasoning = message.model_extra["reasoning_content"]
        assert isinstance(reasoning, str) and "</think>" not in reasoning, choice
        if message.content:
            split += 1
            assert not message.content[:1].isspace()  # the gap after </think> is dropped
    assert split >= 2, out  # some choices closed the block and went on answering
    plain = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, seed=1,
                                           logit_bias={str(i): -100 for i in range(
                                               server[1].vocab_size - 6, server[1].vocab_size)})
    assert "reasoning_content" not in plain.choices[0].message.model_extra


def test_stream_reasoning_deltas_join_to_the_whole(client, server) -> None:
    whole = ask(client, server[1], n=3).choices
    got: dict[int, list[str]] = {}
    for chunk in ask(client, server[1], n=3, stream=True):
        for ch in chunk.choices:
            entry = got.setdefault(ch.index, ["", ""])
            entry[0] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            entry[1] += ch.delta.content or ""
    for choice in whole:
        assert got[choice.index] == [choice.message.model_extra["reasoning_content"],
                                     choice.message.content]


def test_template_kwargs_and_reasoning_sent_back(client, server) -> None:
    """``enable_thinking: false`` reaches the template (its empty think block is in the
    prompt); an assistant message's ``reasoning_content`` is rendered back."""
    tok = server[1]
    default = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    off = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    expected = tok.hf.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False)
    assert expected.endswith("<think>\n\n</think>\n\n")
    assert off.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
    assert off.usage.prompt_tokens > default.usage.prompt_tokens
    answered = {"role": "assistant", "content": "blue light", "reasoning_content": "because",
                "refusal": None, "annotations": None, "audio": None, "function_call": None,
                "tool_calls": None}
    turns = [client.chat.completions.create(model=MODEL, messages=[*MSG, m], max_tokens=1,
                                            extra_body=OPEN)
             for m in (answered, {**answered, "reasoning_content": None})]
    assert turns[0].usage.prompt_tokens > turns[1].usage.prompt_tokens


@pytest.mark.parametrize("step", [1, 2, 3, 100])
def test_reader_splits_known_texts(step: int) -> None:
    cases = [  # (text, reasoning, tools, inside) -> (reasoning, content, calls)
        ("\n<think>\nhmm</think>\n\nthe answer", True, False, False, "\nhmm", "the answer", 0),
        ("no thinking <think>x</think>", True, False, False, None, "no thinking <think>x</think>",
         0),
        ("<thin", True, False, False, None, "<thin", 0),
        ("still thinking</thi", True, False, True, "still thinking</thi", "", 0),
        ('why</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>', True, True, True,
         "why", "", 1),
        ("<think>a</think>b", False, False, False, None, "<think>a</think>b", 0),
    ]
    for text, reasoning, tools, inside, want_reasoning, want_content, calls in cases:
        reader = ChoiceReader(tools=tools, reasoning=reasoning, inside=inside)
        got_reasoning, got_content, got_calls = "", "", 0
        for i in range(0, len(text), step):
            piece = reader.feed(text[i:i + step], final=i + step >= len(text))
            got_reasoning += piece.reasoning
            got_content += piece.content
            got_calls += len(piece.calls)
        assert (got_reasoning if piece.reasoned else None) == want_reasoning, text
        assert (got_content, got_calls) == (want_content, calls), text


@pytest.mark.parametrize(("parts", "inside", "thought"), [
    (["\n", " ", "<think>", "hmm", " sky", "</think>", "\n\n", "blue"], False, "hmm sky"),
    (["<think>", "a", "b", "c"], False, "abc"),  # cut by max_tokens inside the block
    (["no", "<think>", "a", "</think>"], False, ""),  # a block not opening the output
    (["why", " sky", "</think>", "<tool_call>"], True, "why sky"),  # the prompt opened it
    (["</think>", "answer"], True, ""),
])
def test_reasoning_token_count(server, parts: list[str], inside: bool, thought: str) -> None:
    """The reasoning tokens of known outputs: those of the text ``ChoiceReader`` gives
    as reasoning, the tags left out."""
    tok = server[1]
    encoded = [tok.encode(part, add_special_tokens=False) for part in parts]
    ids = [i for part in encoded for i in part]
    piece = ChoiceReader(reasoning=True, inside=inside).feed(tok.decode(ids), final=True)
    assert piece.reasoning == thought
    want = sum(len(e) for part, e in zip(parts, encoded, strict=True) if part in thought
               and part.strip() and part not in ("<think>", "</think>"))
    assert reasoning_token_count(tok, ids, inside) == want


def test_tool_calls_with_tag_tokens(client) -> None:
    """``<tool_call>`` / ``</tool_call>`` are tokens of their own here (as in Qwen's
    vocabularies), which llguidance takes as special: the tool grammar names them, so
    calls work (they were a 400: "grammar cannot be run")."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"]}}}]
    out = client.chat.completions.create(model=MODEL, messages=MSG, tools=tools, n=2, seed=1,
                                         tool_choice="required", max_tokens=300,
                                         parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls[0].function.name == "add"
    auto = client.chat.completions.create(model=MODEL, messages=MSG, tools=tools, n=4, seed=1,
                                          max_tokens=300, parallel_tool_calls=False)
    assert {c.finish_reason for c in auto.choices} <= {"stop", "tool_calls", "length"}
