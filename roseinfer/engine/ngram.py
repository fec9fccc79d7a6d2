"""N-gram (prompt lookup) drafting: guess a sequence's next tokens from its own past.

``NgramIndex`` belongs to one sequence (prompt + output so far). It remembers, for every
n in [min_n, max_n], where each n-gram of the sequence last occurred (the position right
after it); ``propose`` looks up the sequence's last n tokens, longest n first, and drafts
the k tokens that followed their latest earlier occurrence. A continuation that runs into
the end of the sequence goes on periodically (the drafted tokens themselves continue it),
so a sequence that repeats itself gets full drafts. No match: no draft.

The index is built incrementally: each new token adds (max_n - min_n + 1) dict entries,
so a lookup costs O(max_n - min_n + 1) whatever the sequence's length (the prompt is
indexed once, on the first call). Tokens may only be appended between calls.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    __slots__ = ("min_n", "max_n", "_last", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # _last[n - min_n][ngram] = j: the latest j with tokens[j - n:j] == ngram and j < len.
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0  # every end position j <= _indexed is in _last

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` ([] when no n-gram matches)."""
        length = len(tokens)
        self._extend(tokens, length - 1)  # n-grams that have a next token
        if k <= 0:
            return []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            j = self._last[n - self.min_n].get(tuple(tokens[length - n:]))
            if j is not None:
                return _continuation(tokens, j, k)
        return []

    def _extend(self, tokens: Sequence[int], last_end: int) -> None:
        lo = self.min_n
        for j in range(self._indexed + 1, last_end + 1):
            for n in range(lo, min(self.max_n, j) + 1):
                self._last[n - lo][tuple(tokens[j - n:j])] = j
        self._indexed = max(self._indexed, last_end)


def _continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """tokens[start:start + k], continued by the drafts themselves past the end:
    s[L + i] = s[start + i] for the extended sequence s (start < L = len(tokens))."""
    length = len(tokens)
    out: list[int] = []
    for i in range(k):
        p = start + i
        out.append(tokens[p] if p < length else out[p - length])
    return out
