"""The pipeline's output events as Anthropic content blocks.

``BlockWriter`` turns text, reasoning and tool-call events into block operations:
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` payloads, in
order, with their indexes. The stream sends them as they come (``sse``); the whole
message applies the same operations (``MessageAssembler``), so a stream's blocks put
together are exactly the non-streamed message's. A new kind of output closes the open
block and starts another: thinking, then text, then each call in its own ``tool_use``
block (``id`` ``toolu_...``; its ``input`` streams as ``input_json_delta`` pieces).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

Payload = dict[str, Any]

def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: str, matched: str | int | None,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of the pipeline's finish reason: ``length``
    is ``max_tokens``, ``tool_calls`` is ``tool_use``; a ``stop`` on one of the
    request's ``stop_sequences`` is ``stop_sequence`` (naming it), else ``end_turn``."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


class BlockWriter:
    """Block operations of one message, from its output events."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.calls = 0

    def _start(self, block: Payload) -> list[Payload]:
        ops = self.close()
        self.index += 1
        self.open = block["type"]
        return [*ops, {"type": "content_block_start", "index": self.index,
                       "content_block": block}]

    def _delta(self, delta: Payload) -> Payload:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[Payload]:
        """Close the open block (a thinking block gets its signature first)."""
        if self.open is None:
            return []
        ops = []
        if self.open == "thinking":
            ops.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*ops, {"type": "content_block_stop", "index": self.index}]

    def text(self, text: str) -> list[Payload]:
        if not text:
            return []
        ops = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return [*ops, self._delta({"type": "text_delta", "text": text})]

    def reasoning(self, text: str) -> list[Payload]:
        if not text:
            return []
        ops = [] if self.open == "thinking" else self._start(
            {"type": "thinking", "thinking": "", "signature": ""})
        if self.omit_thinking:
            return ops
        return [*ops, self._delta({"type": "thinking_delta", "thinking": text})]

    def tool_call_start(self, name: str, call_id: str | None = None) -> list[Payload]:
        """Open a ``tool_use`` block; its arguments follow (``tool_call_arguments``)."""
        self.calls += 1
        return self._start({"type": "tool_use", "id": call_id or new_tool_use_id(),
                            "name": name, "input": {}})

    def tool_call_arguments(self, piece: str) -> list[Payload]:
        if not piece or self.open != "tool_use":
            return []
        return [self._delta({"type": "input_json_delta", "partial_json": piece})]

    def tool_call(self, name: str, arguments: str, call_id: str | None = None) -> list[Payload]:
        """A whole call: its block opened, its arguments, the block closed."""
        return [*self.tool_call_start(name, call_id), *self.tool_call_arguments(arguments),
                *self.close()]


class MessageAssembler:
    """The content blocks that a sequence of block operations describes."""

    def __init__(self) -> None:
        self.content: list[Payload] = []
        self._json: dict[int, list[str]] = {}

    def apply(self, ops: list[Payload]) -> None:
        for op in ops:
            kind, index = op["type"], op["index"]
            if kind == "content_block_start":
                self.content.append(dict(op["content_block"]))
            elif kind == "content_block_delta":
                self._delta(index, op["delta"])
            elif kind == "content_block_stop" and index in self._json:
                self.content[index]["input"] = _object("".join(self._json.pop(index)))

    def _delta(self, index: int, delta: Payload) -> None:
        block = self.content[index]
        kind = delta["type"]
        if kind == "text_delta":
            block["text"] += delta["text"]
        elif kind == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "input_json_delta":
            self._json.setdefault(index, []).append(delta["partial_json"])


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object (the grammar makes them one)."""
    if not arguments:
        return {}
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"value": value}
