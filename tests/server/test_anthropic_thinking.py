"""Anthropic ``thinking`` through the official SDK against a tiny random Qwen3 served by
a real uvicorn: the reasoning of a ``<think>`` block comes back as a ``thinking`` block
(whole and streamed alike), ``enable_thinking`` follows ``thinking``, and a thinking
block sent back in a later turn is accepted.

The tokenizer is the chat reasoning tests' tiny Qwen3-style one (ChatML, ``<think>`` /
``</think>`` tokens of their own) with a Qwen3-style template written here: with
``enable_thinking`` the generation prompt opens the ``<think>`` block (as Qwen3's
thinking-only templates do), without it an empty block is written first.
A random model never closes the block, so its whole output is reasoning."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.state import ServerSettings
from tests.server.qwen3_helpers import qwen3_engine, qwen3_tokenizer
from tests.server.tokenizer_server import TcpServerThread

MODEL_NAME = "tiny-qwen3-thinking"
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.reasoning_content %}"
    "<|im_start|>assistant\n<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n"
    "{%- else %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
USER = [{"role": "user", "content": "Why is the sky blue?"}]
THINK = {"type": "adaptive"}  # "enabled" needs max_tokens > budget_tokens >= 1024


@contextlib.contextmanager
def qwen3_server(directory: Path) -> Iterator[str]:
    tokenizer = qwen3_tokenizer(directory, QWEN3_STYLE_TEMPLATE)
    engine = qwen3_engine(tokenizer, intermediate_size=128, max_positions=2048,
                          num_kv_blocks=160)
    settings = ServerSettings(served_model_names=(MODEL_NAME,))
    with TcpServerThread(create_app(AsyncEngine(engine), settings)) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    with qwen3_server(tmp_path_factory.mktemp("qwen3-tokenizer")) as url:
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **kwargs: object) -> anthropic.types.Message:
    fields = {"model": MODEL_NAME, "max_tokens": 10, "messages": USER,
              "extra_body": {"temperature": 0}, **kwargs}
    return client.messages.create(**fields)  # type: ignore[arg-type]


def test_thinking_block_whole_and_streamed(client: anthropic.Anthropic) -> None:
    whole = create(client, thinking=THINK)
    assert [b.type for b in whole.content][:1] == ["thinking"], whole
    block = whole.content[0]
    assert block.thinking and block.signature == ""
    assert whole.stop_reason in ("max_tokens", "end_turn")
    with client.messages.stream(model=MODEL_NAME, messages=USER, max_tokens=10,
                                thinking=THINK, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == block.thinking
    assert [d.type for d in deltas if d.type != "thinking_delta"][:1] == ["signature_delta"]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    omitted = create(client, thinking={**THINK, "display": "omitted"})
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
    enabled = create(client, thinking={"type": "enabled", "budget_tokens": 1024},
                     max_tokens=1025, stop_sequences=[block.thinking[2:5]])
    assert enabled.content[0].type == "thinking" and enabled.stop_reason == "stop_sequence"


def test_no_thinking_unless_asked(client: anthropic.Anthropic) -> None:
    for thinking in (None, {"type": "disabled"}):
        extra = {} if thinking is None else {"thinking": thinking}
        msg = create(client, **extra)
        assert all(b.type == "text" for b in msg.content), msg
    on = client.messages.count_tokens(model=MODEL_NAME, messages=USER, thinking=THINK)
    off = client.messages.count_tokens(model=MODEL_NAME, messages=USER)
    assert on.input_tokens < off.input_tokens  # "<think>\n" vs "<think>\n\n</think>\n\n"


def test_thinking_block_sent_back(client: anthropic.Anthropic) -> None:
    first = create(client, thinking=THINK)
    turn = [*USER, first.to_param(), {"role": "user", "content": "And at sunset?"}]
    msg = create(client, messages=turn, thinking=THINK)
    assert msg.content[0].type == "thinking"
    shown = client.messages.count_tokens(model=MODEL_NAME, messages=turn).input_tokens
    bare = [*USER, {"role": "assistant", "content": [
        b for b in first.to_param()["content"] if b.type != "thinking"]}, turn[-1]]
    assert shown > client.messages.count_tokens(model=MODEL_NAME, messages=bare).input_tokens
