"""Tests for roseinfer.stop_strings (compiled stop strings + streaming matcher)."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.engine.detokenizer import IncrementalDetokenizer
from roseinfer.stop_strings import StopMatcher, StopStrings, _failure_table


def all_matches(matcher: StopMatcher, text: str) -> list[tuple[int, str]]:
    """Scan all of ``text``, ignoring every match; return (end, stop) pairs."""
    hits, pos = [], 0
    while (hit := matcher.scan(text, pos)) is not None:
        hits.append(hit)
        pos = hit[0]
    return hits


def ref_step(text: str, stops: Sequence[str]) -> tuple[str | None, int]:
    """Brute force after consuming ``text``: (longest stop ending here, hold length)."""
    ending = [s for s in stops if s and text.endswith(s)]
    hold = max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0
    )
    return max(ending, key=len, default=None), hold


# ------------------------------------------------------------- unit tests


def test_failure_table():
    assert list(_failure_table("abab")) == [0, 0, 1, 2]
    assert list(_failure_table("aaaa")) == [0, 1, 2, 3]
    assert list(_failure_table("aabaaab")) == [0, 1, 0, 1, 2, 2, 3]
    assert list(_failure_table("x")) == [0]
    assert _failure_table("abc").typecode == "i"


def test_compile_dedupes_and_drops_empty():
    comp = StopStrings.compile(["b", "", "abc", "b", "abc"])
    assert comp.stops == ("b", "abc") and len(comp) == 2 and comp.max_len == 3
    assert StopStrings.compile(comp) is comp
    assert not StopStrings.compile([]) and not StopStrings.compile(["", ""])
    assert StopStrings.compile().max_len == 0
    with pytest.raises(TypeError):
        StopStrings.compile("abc")  # type: ignore[arg-type]


def test_single_pattern():
    m = StopStrings.compile(["END"]).matcher()
    assert m.scan("the EN") is None and m.hold == 2
    assert m.scan("D of it") == (1, "END") and m.hold == 0
    assert m.scan("of it") is None and m.chars_consumed == 6 + 1 + 5


def test_feed_char_by_char():
    m = StopStrings.compile(["ab", "b"]).matcher()
    assert [m.feed(c) for c in "xabb"] == [None, None, "ab", "b"]


def test_overlapping_patterns():
    comp = StopStrings.compile(["aa", "aab"])
    m = comp.matcher()
    # "aa" completes at index 1 and again at 2, "aab" at 3.
    assert all_matches(m, "aaab") == [(2, "aa"), (3, "aa"), (4, "aab")]
    m = comp.matcher()
    assert m.scan("a") is None and m.hold == 1
    assert m.scan("a") == (1, "aa") and m.hold == 2  # "aa" is still a prefix of "aab"
    assert m.scan("c") is None and m.hold == 0


def test_prefix_of_other_pattern_longest_wins_on_tie():
    # "bc" and "abc" both complete at the same character: the longer one
    # started first and wins; "b"/"ab" likewise.
    comp = StopStrings.compile(["bc", "abc", "c"])
    assert comp.matcher().scan("xabcd") == (4, "abc")
    assert StopStrings.compile(["b", "ab"]).matcher().scan("ab") == (2, "ab")
    # Completing earlier beats being longer.
    assert StopStrings.compile(["abcd", "bc"]).matcher().scan("abcd") == (3, "bc")
    # A stop that is a prefix of another completes first.
    assert StopStrings.compile(["abc", "ab"]).matcher().scan("abc") == (2, "ab")


def test_repeated_chars_and_hold():
    m = StopStrings.compile(["aaa"]).matcher()
    holds = []
    for c in "aaaaba":
        m.feed(c)
        holds.append(m.hold)
    assert holds == [1, 2, 2, 2, 0, 1]
    assert all_matches(StopStrings.compile(["aaa"]).matcher(), "aaaaa") == [
        (3, "aaa"), (4, "aaa"), (5, "aaa")
    ]


def test_hold_is_longest_partial_over_all_patterns():
    m = StopStrings.compile(["xyz", "abcd", "cde"]).matcher()
    assert m.scan("..abc") is None
    assert m.hold == 3 and m.partial_matches() == {"abcd": 3, "cde": 1}
    assert m.scan("x") is None and m.hold == 1 and m.partial_matches() == {"xyz": 1}


def test_compiled_is_shared_state_is_not():
    comp = StopStrings.compile(["stop", "halt"])
    m1, m2 = comp.matcher(), comp.matcher()
    assert m1.compiled is comp is m2.compiled
    assert m1.scan("sto") is None and m2.scan("hal") is None
    assert m1.scan("p") == (1, "stop")
    assert m2.scan("t") == (1, "halt")


def test_scan_start_offset():
    m = StopStrings.compile(["ab"]).matcher()
    assert m.scan("abab", 2) == (4, "ab")
    assert m.scan("abab", 4) is None and m.chars_consumed == 2


# ---------------------------------------------------------- property tests

ALPHABETS = st.sampled_from(["ab", "abc", "a😀", "xy\n"])


@st.composite
def texts_and_stops(draw):
    alphabet = draw(ALPHABETS)
    text = draw(st.text(alphabet=alphabet, max_size=40))
    stops = draw(st.lists(st.text(alphabet=alphabet, max_size=6), max_size=5))
    return text, stops


@settings(max_examples=300, deadline=None)
@given(texts_and_stops(), st.lists(st.integers(1, 7), min_size=1, max_size=5))
def test_matcher_against_brute_force(case, pieces):
    text, stops = case
    comp = StopStrings.compile(stops)
    # Character by character: the reported match and the hold after each one.
    m = comp.matcher()
    for i, ch in enumerate(text):
        expected, hold = ref_step(text[: i + 1], stops)
        assert (m.feed(ch), m.hold) == (expected, hold)
    # In arbitrary pieces, scanning past every match: the same matches.
    m = comp.matcher()
    pos, k = 0, 0
    while pos < len(text):
        piece = text[pos : pos + pieces[k % len(pieces)]]
        k += 1
        expected_hits = []
        for j in range(len(piece)):
            expected = ref_step(text[: pos + j + 1], stops)[0]
            if expected is not None:
                expected_hits.append((j + 1, expected))
        assert all_matches(m, piece) == expected_hits
        pos += len(piece)
        assert m.hold == ref_step(text[:pos], stops)[1]
    assert m.chars_consumed == len(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=30))
def test_failure_table_against_brute_force(pattern):
    def border(s: str) -> int:
        return max((k for k in range(len(s)) if s[:k] == s[len(s) - k :]), default=0)

    assert list(_failure_table(pattern)) == [border(pattern[: i + 1]) for i in range(len(pattern))]


# ------------------------------------------------------------ bounded cost


class CountingStr(str):
    """A str that counts indexing operations (character comparisons)."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[override]
        CountingStr.reads += 1
        return str.__getitem__(self, key)


@pytest.mark.parametrize(
    "pattern, text",
    [
        ("a" * 2000 + "b", "a" * 6000),
        ("ab" * 1000 + "c", "ab" * 3000),
        ("aab" * 700, "aabaaab" * 900),
        ("abacabad" * 250, "abacabac" * 750),
    ],
)
def test_operation_count_is_linear(pattern, text):
    CountingStr.reads = 0
    comp = StopStrings.compile([CountingStr(pattern)])
    assert CountingStr.reads <= 4 * len(pattern)
    CountingStr.reads = 0
    m = comp.matcher()
    for i in range(0, len(text), 3):
        all_matches(m, text[i : i + 3])
    assert CountingStr.reads <= 4 * len(text)


def _feed(stop: str, text: str) -> StopMatcher:
    m = StopStrings.compile([stop, "\n\n"]).matcher()
    for i in range(0, len(text), 4):
        assert m.scan(text[i : i + 4]) is None
    return m


def _peak_memory(stop: str, text: str) -> tuple[int, StopMatcher]:
    tracemalloc.start()
    try:
        m = _feed(stop, text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, m


@pytest.mark.parametrize(
    "stop",
    [
        "".join(chr(ord("a") + (i * 7919) % 26) for i in range(60_000)),
        "x" * 60_000,
        "😀" * 166_666,
    ],
    ids=["60k-mixed", "60k-repeated", "166k-emoji"],
)
def test_huge_stop_string_is_cheap(stop):
    # Worst case for hold-back: the text is a long prefix of the stop string.
    text = stop[:4000]
    peak, m = _peak_memory(stop, text)
    assert m.hold == 4000
    # The failure table costs 4 bytes per pattern char; the old prefix set
    # needed O(len^2) memory (GBs).
    assert peak < 4 * len(stop) + 2_000_000
    assert peak < 20_000_000
    # Unrelated text is cheap too.
    peak, m = _peak_memory(stop, "Hello, world! " * 300)
    assert peak < 20_000_000 and m.hold == 0
    t0 = time.perf_counter()
    _feed(stop, text)
    assert time.perf_counter() - t0 < 5.0  # generous: ~0.1 s; the old code took seconds


class CharTokenizer:
    """Token id = code point; enough for IncrementalDetokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize("stop", ["x" * 60_000, "😀" * 166_666], ids=["60k", "166k-emoji"])
def test_detokenizer_with_huge_stop_string(stop):
    ids = [ord(c) for c in stop[:3000]]
    tracemalloc.start()
    try:
        detok = IncrementalDetokenizer(CharTokenizer(), [], stop=[stop])
        deltas = [detok.add_tokens(ids[i : i + 3]).delta for i in range(0, len(ids), 3)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000
    assert "".join(deltas) == "" and detok.held_back == 3000
    # A mismatch releases everything held; the stop string can start again.
    assert detok.add_tokens([ord("!"), ord(stop[0])]).delta == stop[:3000] + "!"
    assert detok.held_back == 1 and detok.finish() == stop[0]
    assert detok.text == stop[:3000] + "!" + stop[0] and detok.stop_matched is None
