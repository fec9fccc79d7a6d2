"""IncrementalDetokenizer with ``min_tokens``: stop strings only count once more than
min_tokens tokens were generated (vLLM), checked against a brute-force reference that
knows which token released each character."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from roseinfer.stop_strings import StopStrings
from tests.engine.test_detokenizer import (
    _byte_bpe,
    enc,
    joined,
    stream,
)

# -------------------------------------------------------------- min_tokens


def test_min_tokens_ignores_early_stops():
    t = _byte_bpe()  # one token per byte, so token k produces character k
    ids = t.encode("xENDyyEND").ids
    for min_tokens, expected, matched in ((0, "x", "END"), (3, "x", "END"), (4, "xENDyy", "END"),
                                          (8, "xENDyy", "END"), (9, "xENDyyEND", None)):
        for chunks in (1, 4, len(ids)):
            detok = IncrementalDetokenizer(t, [], stop=["END"], min_tokens=min_tokens)
            updates, tail = stream(detok, ids, chunks)
            assert (joined(updates, tail), detok.stop_matched) == (expected, matched), min_tokens
    # A stop starting inside the first min_tokens tokens but completing later counts,
    # and is held back while min_tokens is not reached yet.
    detok = IncrementalDetokenizer(t, [], stop=["END"], min_tokens=2)
    assert [detok.add_tokens([i]).delta for i in ids[:3]] == ["x", "", ""]
    assert detok.add_tokens(ids[3:4]) == DetokenizerUpdate("", "END")
    with pytest.raises(ValueError):
        IncrementalDetokenizer(t, [], min_tokens=-1)


def test_min_tokens_finish_counts_as_last_token():
    t = _byte_bpe()
    ids = t.encode("ok 😀").ids[:5]  # ends inside the emoji: finish() releases U+FFFD
    full = t.decode(ids)
    assert full.startswith("ok \ufffd")
    for min_tokens, expected in ((4, "o"), (5, full)):
        detok = IncrementalDetokenizer(t, [], stop=["k \ufffd"], min_tokens=min_tokens)
        updates = [detok.add_tokens([i]) for i in ids]
        assert joined(updates) == "o"  # "k " is held back either way
        assert joined(updates, detok.finish()) == expected == detok.text


def test_compiled_stop_strings_shared_between_sequences(tok):
    stops = StopStrings.compile(["END", "\n"])
    texts = ["one END two", "three\nfour", "no stop here"]
    detoks = [IncrementalDetokenizer(tok, [], stop=stops) for _ in texts]
    for detok, text in zip(detoks, texts, strict=True):
        stream(detok, enc(tok, text), 2)
    assert [d.text for d in detoks] == ["one ", "three", "no stop here"]
    assert [d.stop_matched for d in detoks] == ["END", "\n", None]


def owners(decode: Callable[[list[int]], str], ids: list[int]) -> list[int]:
    """For each character of decode(ids): the 1-based token whose addition releases it.

    A character is released once the decoded prefix ends on a complete
    character; what only finish() releases belongs to the last token.
    """
    out: list[int] = []
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if not text.endswith("\ufffd"):
            assert len(text) >= len(out)
            out += [k] * (len(text) - len(out))
    return out + [len(ids)] * (len(decode(ids)) - len(out))


def reference_min_tokens(decoder, ids: list[int], stops: Sequence[str], include: bool,
                         min_tokens: int) -> tuple[str, str | None]:
    def decode(x: list[int]) -> str:
        return decoder.decode(x, skip_special_tokens=True)

    full, owner, best = decode(ids), owners(decode, ids), None
    for s in {s for s in stops if s}:
        starts = (i for i in range(len(full) - len(s) + 1) if full.startswith(s, i))
        # Owners never decrease, so the first qualifying occurrence ends first.
        i = next((i for i in starts if owner[i + len(s) - 1] > min_tokens), None)
        if i is not None and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return full, None
    return full[: best[0] if include else best[1]], best[2]


@st.composite
def min_tokens_cases(draw, decoder, encode: Callable[[str], list[int]], alphabet: str):
    """(ids possibly ending mid-character, stops, min_tokens, include, add_tokens sizes)."""
    ids = encode(draw(st.text(alphabet=alphabet, max_size=24)))
    ids = ids[: draw(st.integers(0, len(ids)))]
    text = decoder.decode(ids)
    stops = draw(st.lists(st.text(alphabet=alphabet, min_size=1, max_size=4), max_size=2))
    for _ in range(draw(st.integers(0, 2)) if text else 0):
        i = draw(st.integers(0, len(text) - 1))
        stops.append(text[i : i + draw(st.integers(1, 5))])
    return (ids, stops, draw(st.integers(0, len(ids) + 1)), draw(st.booleans()),
            draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))


def check_min_tokens(decoder, case) -> None:
    ids, stops, min_tokens, include, chunks = case
    detok = IncrementalDetokenizer(decoder, [], stop=stops, include_stop_str_in_output=include,
                                   min_tokens=min_tokens)
    updates, tail = stream(detok, ids, chunks)
    expected, matched = reference_min_tokens(decoder, ids, stops, include, min_tokens)
    assert joined(updates, tail) == expected == detok.text
    assert detok.stop_matched == matched
    if "\ufffd" not in decoder.decode(ids):
        assert all("\ufffd" not in u.delta for u in updates)


# Merges inside multibyte characters and from ASCII into their first bytes,
# so characters are split over tokens and tokens end mid-character.
BPE_MERGES = [(b"\xf0", b"\x9f"), (b"\x98", b"\x80"), (b"\xe4", b"\xbd"), (b" ", b"\xe4"),
              (b"a", b"\xf0"), (b"a", b"b"), (b"b", b" "), (b"\xc3", b"\xa9")]


@pytest.fixture(scope="module")
def merged_bpe():
    return _byte_bpe(BPE_MERGES)


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_min_tokens_property_byte_bpe(merged_bpe, data):
    def encode(s: str) -> list[int]:
        return merged_bpe.encode(s).ids

    check_min_tokens(merged_bpe, data.draw(min_tokens_cases(merged_bpe, encode, "ab é你😀\n")))


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_min_tokens_property_real_tokenizer(tok, data):
    case = data.draw(min_tokens_cases(tok, lambda s: enc(tok, s), "ab END你好😀🚀é \n"))
    check_min_tokens(tok, case)
