"""Streaming multi-pattern matcher for stop strings, linear in the pattern sizes.

:class:`StopStrings` is the compiled, immutable part: the de-duplicated,
non-empty stop strings, and per stop string a KMP failure table stored in an
``array('i')`` (4 bytes per pattern character), plus an index from first
character to the stop strings starting with it. Compiling costs O(total stop
length) time and memory, so it is cheap even for huge patterns, and one
compiled object can be shared by every sequence of a request (and built before
the request is queued).

:class:`StopMatcher` is the small per-sequence state: for every stop string
with a non-empty partial match, the length of the longest suffix of the text
consumed so far that is a proper prefix of it (the KMP state). Each consumed
character advances the active states; by the usual KMP argument (a state grows
by at most one per character and every failure step shrinks it) this costs
amortised O(number of stop strings) per character, and usually much less since
only stop strings with a partial match, or starting with the character, are
touched.

:attr:`StopMatcher.hold` -- the longest current partial match -- is exactly
how many trailing characters could still turn into a stop string, i.e. what a
streaming detokenizer must hold back.

When several stop strings complete at the same character, the longest one
(the one starting first) is reported. A reported match is consumed: the
matcher continues as if it had not been accepted (overlapping occurrences are
still found), so a caller may ignore a match and keep scanning.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

__all__ = ["StopMatcher", "StopStrings"]


def _failure_table(pattern: str) -> array:
    """KMP failure table: ``fail[i]`` is the longest proper border of ``pattern[:i + 1]``."""
    fail = array("i", [0]) * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        ch = pattern[i]
        while k and pattern[k] != ch:
            k = fail[k - 1]
        if pattern[k] == ch:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """Compiled, immutable set of stop strings (build with :meth:`compile`).

    ``stops`` keeps the given order with empty strings and duplicates removed.
    """

    __slots__ = ("_fails", "_starts", "max_len", "stops")

    stops: tuple[str, ...]
    max_len: int
    _fails: tuple[array, ...]
    _starts: dict[str, tuple[int, ...]]

    def __init__(self, stops: tuple[str, ...], fails: tuple[array, ...],
                 starts: dict[str, tuple[int, ...]]) -> None:
        """Internal; use :meth:`compile`."""
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        self._fails = fails
        self._starts = starts

    @classmethod
    def compile(cls, stops: Iterable[str] | StopStrings = ()) -> StopStrings:
        """Compile stop strings in O(total length); a compiled object is returned as is."""
        if isinstance(stops, StopStrings):
            return stops
        if isinstance(stops, str):
            raise TypeError("stop must be a sequence of strings, not a single str")
        uniq = tuple(dict.fromkeys(s for s in stops if s))
        starts: dict[str, list[int]] = {}
        for i, s in enumerate(uniq):
            starts.setdefault(s[0], []).append(i)
        return cls(
            uniq,
            tuple(_failure_table(s) for s in uniq),
            {ch: tuple(idx) for ch, idx in starts.items()},
        )

    def __len__(self) -> int:
        return len(self.stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def __repr__(self) -> str:
        return f"StopStrings({len(self.stops)} stops, max_len={self.max_len})"

    def matcher(self) -> StopMatcher:
        """A fresh per-sequence matcher (nothing consumed yet)."""
        return StopMatcher(self)


class StopMatcher:
    """Per-sequence matching state over a shared :class:`StopStrings`."""

    __slots__ = ("_active", "_compiled", "chars_consumed")

    def __init__(self, compiled: StopStrings) -> None:
        self._compiled = compiled
        # stop index -> current partial match length (always 0 < len < len(stop)).
        self._active: dict[int, int] = {}
        self.chars_consumed = 0

    @property
    def compiled(self) -> StopStrings:
        return self._compiled

    @property
    def hold(self) -> int:
        """Longest suffix of the consumed text that is a proper prefix of a stop string."""
        return max(self._active.values(), default=0)

    def partial_matches(self) -> dict[str, int]:
        """Current partial match length per stop string (only non-zero ones)."""
        stops = self._compiled.stops
        return {stops[i]: q for i, q in self._active.items()}

    def feed(self, ch: str) -> str | None:
        """Consume one character; return the stop string completed by it, if any."""
        hit = self.scan(ch)
        return None if hit is None else hit[1]

    def scan(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """Consume ``text[start:]`` up to and including the first character completing a stop.

        Returns ``(end, stop)`` with ``text[end - len(stop):end] == stop`` (the
        match may begin in earlier text), or None after consuming everything.
        Call again with ``start=end`` to keep scanning past an ignored match.
        """
        comp = self._compiled
        stops, fails, starts = comp.stops, comp._fails, comp._starts
        active = self._active
        for pos in range(start, len(text)):
            ch = text[pos]
            best = -1  # index of the longest stop completed at this character
            nxt: dict[int, int] = {}
            for i, q in active.items():
                pat = stops[i]
                fail = fails[i]
                while q and pat[q] != ch:
                    q = fail[q - 1]
                if pat[q] == ch:
                    q += 1
                if q == len(pat):
                    if best < 0 or q > len(stops[best]):
                        best = i
                    q = fail[q - 1]
                if q:
                    nxt[i] = q
            for i in starts.get(ch, ()):
                if i in active:
                    continue  # already advanced above (state 0 then re-checked pat[0])
                if len(stops[i]) == 1:
                    if best < 0:  # a 1-char stop is never longer than another completion
                        best = i
                else:
                    nxt[i] = 1
            self._active = active = nxt
            if best >= 0:
                self.chars_consumed += pos + 1 - start
                return pos + 1, stops[best]
        self.chars_consumed += max(0, len(text) - start)
        return None
