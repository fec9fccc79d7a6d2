"""Prompt work before admission, bounded: a prompt's size in characters is checked
before anything tokenizes it, and tokenization / chat templating run off the event loop,
a few at a time.

A prompt (each prompt of a ``/v1/completions`` batch; all messages of a chat, with its
tools' definitions) longer than ``MAX_PROMPT_CHARS_PER_TOKEN`` x ``max_model_len``
characters is a 400 naming the field, before it is tokenized: no tokenizer in use
packs 16 characters of text into one token on average, so such a prompt could not fit
the context anyway (natural text averages 3-5 characters a token). Without the bound a
4 MiB prompt took 3-5 s of tokenizing only to be refused for its token count.

The tokenizer runs in the thread pool (``ServerState.encode`` / ``render_chat``); the
gate lets at most ``slots`` prompts (default: the cores, at most 4) be tokenized or
rendered at once, so a burst of large prompts cannot take every pool thread (which
``/metrics`` and the grammar compiler share) nor every core. ``/detokenize`` goes
through the same slots, with at most as many ids as a prompt may have characters.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from roseinfer.server.errors import bad_request
from roseinfer.server.protocol import ChatMessage, ToolDefinition
from roseinfer.server.state import ServerState

MAX_PROMPT_CHARS_PER_TOKEN = 16
MAX_SLOTS = 4


def default_slots() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_SLOTS, cores or 1))


def messages_chars(messages: Sequence[ChatMessage],
                   tools: Sequence[ToolDefinition] | None = None) -> int:
    """Characters a conversation brings to its prompt: every message's text, name, tool
    call id and tool calls, plus the tools' definitions (as JSON)."""
    total = 0
    for m in messages:
        total += len(m.text()) + len(m.name or "") + len(m.tool_call_id or "")
        total += len(m.reasoning_content or m.reasoning or "")
        for call in m.tool_calls or ():
            total += len(call.id) + len(call.function.name) + len(call.function.arguments)
    for tool in tools or ():
        total += len(json.dumps(tool.model_dump(exclude_none=True)))
    return total


def conversation_chars(messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None = None) -> int:
    """``messages_chars`` of message and tool dicts (``ChatTurn``'s shapes)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, Sequence):
            total += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, Mapping))
        total += len(m.get("name") or "") + len(m.get("tool_call_id") or "")
        total += len(m.get("reasoning_content") or "")
        for call in m.get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments")
            total += len(call.get("id") or "") + len(function.get("name") or "") + len(
                arguments if isinstance(arguments, str) else json.dumps(arguments))
    for tool in tools or ():
        total += len(json.dumps(tool))
    return total


class PromptGate:
    """The character bound and the tokenizer slots of one app (``app.state.prompt_gate``)."""

    def __init__(self, slots: int | None = None) -> None:
        self.slots = slots or default_slots()
        self._slots = asyncio.Semaphore(self.slots)

    @staticmethod
    def char_limit(state: ServerState) -> int:
        return MAX_PROMPT_CHARS_PER_TOKEN * state.max_model_len

    def check_chars(self, state: ServerState, chars: int, param: str) -> None:
        """A 400 naming ``param`` when ``chars`` characters cannot fit the context."""
        limit = self.char_limit(state)
        if chars > limit:
            raise bad_request(
                f"The {param} is {chars} characters long; this server refuses prompts over "
                f"{limit} characters ({MAX_PROMPT_CHARS_PER_TOKEN} per token of the model's "
                f"maximum context length, {state.max_model_len} tokens) before tokenizing "
                "them. Please shorten it.", param)

    def check_chat(self, state: ServerState, messages: Sequence[ChatMessage],
                   tools: Sequence[ToolDefinition] | None = None,
                   param: str = "messages") -> None:
        self.check_chars(state, messages_chars(messages, tools), param)

    async def encode(self, state: ServerState, text: str, param: str,
                     add_special_tokens: bool = True) -> list[int]:
        """``text`` checked, then tokenized off the event loop in one of the slots."""
        self.check_chars(state, len(text), param)
        async with self._slots:
            return await state.encode(text, add_special_tokens)

    async def decode(self, state: ServerState, ids: list[int], param: str = "tokens") -> str:
        """Ids to text (``/detokenize``), bounded like a prompt: at most as many ids as
        characters, decoded off the event loop in one of the slots."""
        tok = state.engine.engine.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer")
        limit = self.char_limit(state)
        if len(ids) > limit:
            raise bad_request(f"{len(ids)} token ids are more than this server decodes at "
                              f"once ({limit}, {MAX_PROMPT_CHARS_PER_TOKEN} x the model's "
                              "maximum context length).", param)
        async with self._slots:
            return await run_in_threadpool(tok.decode, ids, False)

    async def render_chat(self, state: ServerState, messages: Sequence[ChatMessage], *,
                          add_generation_prompt: bool = True,
                          tools: Sequence[ToolDefinition] | None = None,
                          rendered_tools: Sequence | None = None) -> list[int]:
        """The conversation checked (with ``tools``, the request's definitions), then
        rendered and tokenized off the event loop in one of the slots; ``rendered_tools``
        are what the template is shown (``ServerState.render_chat``'s ``tools``)."""
        self.check_chat(state, messages, tools)
        async with self._slots:
            return await state.render_chat(messages, add_generation_prompt,
                                           tools=rendered_tools)

    async def render_conversation(self, state: ServerState,
                                  messages: Sequence[Mapping[str, Any]], *,
                                  tools: Sequence | None = None, param: str = "messages",
                                  add_generation_prompt: bool = True,
                                  continue_final_message: bool = False,
                                  template_kwargs: Mapping[str, Any] | None = None,
                                  ) -> tuple[list[int], str]:
        """Prompt (ids, text) of message dicts, rendered off the event loop in one of
        the slots (the caller checked their size: ``check_chars``); ``tools`` are the
        ``Tool`` records the model is shown."""
        async with self._slots:
            return await state.render_conversation(
                messages, tools=tools, param=param, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, template_kwargs=template_kwargs)


def get_gate(request: Request) -> PromptGate:
    return request.app.state.prompt_gate
