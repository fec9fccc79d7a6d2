"""One choice's generated text, as it comes, split into reasoning, content and tool calls.

With ``reasoning``, a ``<think>...</think>`` block opening the output (Qwen3,
DeepSeek-R1 style; or already open when the prompt ended inside one) is reasoning, and
the whitespace after its close is dropped. The rest is content; with ``tools`` it goes
through ``ToolCallParser`` (``roseinfer.tool_calls``), which holds ``<tool_call>``
blocks until they close and gives them back as calls. Text that might still turn out to
be markup (a partial ``<think>`` or ``</think>``) is held until it is known. The same
reader serves streams (many ``feed`` calls) and whole results (one), so both agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from roseinfer.tool_calls import ParsedCall, ToolCallParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinking_start(tokenizer: Any, prompt_text: str) -> tuple[bool, bool]:
    """(reasoning, inside) of a chat whose prompt is ``prompt_text``: a model reasons
    when ``<think>`` and ``</think>`` are tokens of its own (Qwen3, DeepSeek-R1 and
    their kind); ``inside`` when the prompt ended inside an open ``<think>`` block (a
    template that opens it for the model)."""
    if tokenizer is None:
        return False, False
    for tag in (THINK_OPEN, THINK_CLOSE):
        if len(tokenizer.encode(tag, add_special_tokens=False)) != 1:
            return False, False
    return True, prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def reasoning_token_count(tokenizer: Any, token_ids: Sequence[int], inside: bool) -> int:
    """How many of a choice's generated ``token_ids`` are its reasoning, read as
    ``ChoiceReader`` reads their text: a block the prompt left open (``inside``) or one
    opening the output after whitespace-only tokens, up to its ``</think>`` (or the end:
    a block cut by ``max_tokens``); the tag tokens themselves are not counted. Exact
    where the tags are the model's own tag tokens, as thinking models emit them (see
    ``thinking_start``)."""
    (open_id,) = tokenizer.encode(THINK_OPEN, add_special_tokens=False)
    (close_id,) = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    start = 0
    if not inside:
        while start < len(token_ids) and not tokenizer.decode([token_ids[start]]).strip():
            start += 1
        if start == len(token_ids) or token_ids[start] != open_id:
            return 0
        start += 1
    count = 0
    for token in token_ids[start:]:
        if token == close_id:
            break
        count += 1
    return count


@dataclass
class Piece:
    """What one ``feed`` released."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    reasoned: bool = False  # the choice has had a reasoning block so far

    @property
    def reasoning_or_none(self) -> str | None:
        return self.reasoning if self.reasoned else None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ChoiceReader:
    tools: bool = False
    reasoning: bool = False  # look for a <think> block at the start
    inside: bool = False  # the prompt ended inside a <think> block
    parser: ToolCallParser = field(default_factory=ToolCallParser)
    _state: str = field(init=False)  # "head" | "inside" | "gap" | "content"
    _held: str = ""
    reasoned: bool = False

    def __post_init__(self) -> None:
        if self.inside:
            self._state, self.reasoned = "inside", True
        else:
            self._state = "head" if self.reasoning else "content"

    @property
    def calls(self) -> list[ParsedCall]:
        return self.parser.calls

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Piece:
        """What ``text`` (the next piece of output) releases; ``final``: nothing follows;
        ``cut``: it ended at ``max_tokens`` (an unfinished call block is dropped)."""
        reasoning, content = self._split(text, final)
        piece = Piece(reasoning=reasoning)
        if self.tools:
            piece.content, piece.calls = self.parser.feed(content)
            if final:
                piece.content += self.parser.finish(cut)
        else:
            piece.content = content
        piece.reasoned = self.reasoned
        return piece

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) released by ``text``."""
        if self._state == "content":
            return "", text
        self._held += text
        reasoning = ""
        if self._state == "head":
            stripped = self._held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._state, self.reasoned = "inside", True
                self._held = stripped[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(stripped) and not final:
                return "", ""  # may still open a block
            else:
                self._state = "content"
                out, self._held = self._held, ""
                return "", out
        if self._state == "inside":
            end = self._held.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else _partial_suffix(self._held, THINK_CLOSE)
                reasoning = self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning = self._held[:end]
            self._held = self._held[end + len(THINK_CLOSE):]
            self._state = "gap"
        # "gap": whitespace after the block is dropped
        rest = self._held.lstrip()
        if not rest and not final:
            self._held = ""
            return reasoning, ""
        self._state, self._held = "content", ""
        return reasoning, rest
