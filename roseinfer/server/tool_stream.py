"""ToolCallParser: splits generated text into content and ``<tool_call>`` blocks, as it comes.

One parser serves both the streamed and the whole response, so assembling the stream's
deltas gives exactly the non-streamed message. Text outside blocks is content, released
as soon as it cannot be the start of ``<tool_call>``; a block is held until it closes,
then becomes one call. Whitespace after a call is held back and dropped if nothing but
whitespace and calls follows. A block that never closes (``max_tokens``) or does not
hold a call is given back as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.server.protocol import CalledFunction, ToolCall
from roseinfer.server.responses import AssistantMessage, DeltaFunction, DeltaMessage, DeltaToolCall
from roseinfer.server.tools import CLOSE, OPEN, ParsedCall, new_call_id, parse_call


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

    def finish(self) -> str:
        """The content still held when generation ends."""
        rest = (OPEN + self.pending) if self.inside else self.pending
        self.pending, self.inside = "", False
        return "" if self.calls and not rest.strip() else rest


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``OPEN``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def tool_message(text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The whole response's message and finish reason (``tool_calls`` when it stopped
    after making calls)."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    content += parser.finish()
    tool_calls = [ToolCall(id=new_call_id(), function=CalledFunction(name=c.name,
                                                                     arguments=c.arguments))
                  for c in calls]
    return (AssistantMessage(content=content or None, tool_calls=tool_calls or None),
            finish_reason(reason, bool(calls)))


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if made_calls else "stop"


def call_deltas(calls: list[ParsedCall], first_index: int) -> list[DeltaMessage]:
    """The stream's deltas of completed calls: id, type and name, then the arguments."""
    out = []
    for k, call in enumerate(calls, first_index):
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(
            index=k, id=new_call_id(), type="function",
            function=DeltaFunction(name=call.name, arguments=""))]))
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(
            index=k, function=DeltaFunction(arguments=call.arguments))]))
    return out
