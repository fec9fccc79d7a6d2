"""GrammarMatcher: one sequence's state in its grammar (an llguidance ``LLMatcher``).

Owned by the ``Request`` (``Request.grammar``); each of the n sequences of a request has
its own. It advances only by tokens the engine samples for that sequence — never by
prompt tokens, so prefix-cache hits, chunked prefill and the recompute after a
preemption leave it untouched (a recomputed sequence resumes exactly where it was).

llguidance never raises for grammar-level problems: a matcher that consumed a token its
grammar forbids, or ran out of its per-step budget, enters an error state for good;
``error()`` reports it and the engine fails that request alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

MAX_ERROR_CHARS = 500  # of a matcher error, in Request.error


class GrammarMatcher:
    __slots__ = ("ll", "num_tokens", "terminated")

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self.ll = ll
        self.num_tokens = 0  # sampled tokens consumed
        self.terminated = False  # the grammar is complete and admits nothing more

    def error(self) -> str | None:
        """Why the matcher cannot go on (None while it can)."""
        if not self.ll.is_error():
            return None
        return _first_line(self.ll.get_error())

    def accept(self, token: int) -> str | None:
        """Advance by one sampled token; the error (None on success)."""
        if not self.ll.consume_token(token):
            return self.error() or f"token {token} is not allowed by the grammar"
        self.num_tokens += 1
        if self.ll.is_stopped():
            if not self.ll.is_accepting():
                return f"the grammar cannot be completed (stop reason {self.ll.stop_reason()})"
            self.terminated = True
        return None


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "grammar matcher error"
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."
