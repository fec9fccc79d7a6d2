"""Generated text back into content and tool calls (``ToolCallParser``), as it comes.

One parser serves the streamed and the whole response alike, so assembling a stream's
pieces gives exactly the whole result. Text outside blocks is content, released as soon
as it cannot be the start of ``<tool_call>``; a block is held until it closes, then
becomes one call. Whitespace after a call is held back and dropped if nothing but
whitespace and calls follows. A block that does not hold a call is given back as
content; so is one that never closes, unless the output was cut by ``max_tokens``
(``finish(cut=True)``): then the unfinished block is dropped, never returned as markup.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

from roseinfer.outputs import CompletionOutput, RequestOutput, ToolCall
from roseinfer.tool_calls.grammar import CLOSE, OPEN


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(block: str) -> ParsedCall | None:
    """The call inside one ``<tool_call>`` block (None if it is not a call)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (
            "arguments" not in obj):
        return None
    return ParsedCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


@dataclass
class ToolCallParser:
    pending: str = ""  # text not released yet
    inside: bool = False  # pending is the inside of an open block
    calls: list[ParsedCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content released and calls completed by ``text``."""
        self.pending += text
        content: list[str] = []
        done: list[ParsedCall] = []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.inside = False
                call = parse_call(block)
                if call is None:
                    content.append(OPEN + block + CLOSE)
                else:
                    done.append(call)
                    self.calls.append(call)
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                head, self.pending = self.pending[:start], self.pending[start + len(OPEN):]
                content.append(self._outside(head))
                self.inside = True
                continue
            keep = _partial_open(self.pending)
            if self.calls and not self.pending[:len(self.pending) - keep].strip():
                break  # whitespace after a call: held back
            release = len(self.pending) - keep
            content.append(self._outside(self.pending[:release]))
            self.pending = self.pending[release:]
            break
        return "".join(content), done

    def _outside(self, text: str) -> str:
        """Text outside blocks: whitespace between calls is dropped."""
        return "" if self.calls and not text.strip() else text

    def finish(self, cut: bool = False) -> str:
        """The content still held when generation ends. ``cut`` (it ran out of
        ``max_tokens``): an unclosed block, or a partial ``<tool_call>`` at the end, is
        dropped rather than given back as markup."""
        if cut:
            rest = "" if self.inside else self.pending[:len(self.pending) - _partial_open(
                self.pending)]
        else:
            rest = (OPEN + self.pending) if self.inside else self.pending
        self.pending, self.inside = "", False
        return "" if self.calls and not rest.strip() else rest


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``OPEN``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str, list[ParsedCall]]:
    """A whole completion's content (the text outside calls) and its calls; ``cut``: it
    ran out of ``max_tokens`` (``ToolCallParser.finish``)."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    return content + parser.finish(cut), calls


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason of a choice that may make calls: ``tool_calls`` when it
    stopped after making calls, ``length`` when cut, else ``stop``."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if made_calls else "stop"


def with_tool_calls(out: RequestOutput) -> RequestOutput:
    """``out`` with each finished output's text split into content (``text``) and
    ``tool_calls``; one that stopped after making calls finishes ``"tool_calls"``
    (``length``, ``abort`` and ``error`` are kept)."""
    return replace(out, outputs=[_split(c) for c in out.outputs])


def _split(c: CompletionOutput) -> CompletionOutput:
    if c.finish_reason is None:
        return c
    content, calls = parse_tool_calls(c.text, cut=c.finish_reason == "length")
    if not calls:
        return replace(c, text=content)
    reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
    return replace(c, text=content, finish_reason=reason, tool_calls=tuple(
        ToolCall(new_call_id(), call.name, call.arguments) for call in calls))
