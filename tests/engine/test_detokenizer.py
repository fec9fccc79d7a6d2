"""Tests for roseinfer.engine.detokenizer.IncrementalDetokenizer.

Uses the real default SmolLM2 tokenizer (byte-level BPE, the ``tok`` fixture of
tests/engine/conftest.py) plus tiny byte-level BPE tokenizers built with ``tokenizers``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from roseinfer.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

MULTILINGUAL = (
    "Hello 😀 world! 你好世界, café naïve — 日本語のテキスト 🚀🎉 Ünïcödé "
    "Привет мир. Ça va? 한국어 텍스트 👩‍💻 résumé ½ ∑ done END of text.\n"
    "Second line: emojis 🤖🧠✨ and accents àéîõü, then 中文字符 again."
)
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"



def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | int = 1
) -> tuple[list[DetokenizerUpdate], str]:
    """Feed ids in chunks; return (updates, finish() text)."""
    sizes = [chunks] * len(ids) if isinstance(chunks, int) else list(chunks)
    updates, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        updates.append(detok.add_tokens(ids[i : i + n]))
        i, k = i + n, k + 1
    return updates, detok.finish()


def joined(updates: Sequence[DetokenizerUpdate], tail: str = "") -> str:
    return "".join(u.delta for u in updates) + tail


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Truncate the full decode at the first completed stop string."""
    best = None
    for s in stops:
        i = text.find(s) if s else -1
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[: end if include else start], s


def token_index_of(tok, ids: Sequence[int], char_pos: int) -> int:
    """Index of the token whose decode covers character ``char_pos``."""
    for i in range(1, len(ids) + 1):
        if len(tok.decode(ids[:i])) > char_pos:
            return i - 1
    raise AssertionError("char_pos beyond text")


# ----------------------------------------------------------- UTF-8 safety


def test_multibyte_token_by_token(tok):
    ids = enc(tok, MULTILINGUAL)
    # Sanity: some characters really are split over tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, enc(tok, PROMPT))
    updates, tail = stream(detok, ids)
    assert all("\ufffd" not in u.delta for u in updates)
    assert all(u.stop_matched is None for u in updates)
    assert tail == ""
    assert joined(updates) == tok.decode(ids) == MULTILINGUAL
    assert detok.text == MULTILINGUAL
    assert detok.num_generated_tokens == len(ids)


@pytest.mark.parametrize("chunks", [2, 3, 7, [1, 4, 2, 5]])
def test_several_tokens_at_once(tok, chunks):
    ids = enc(tok, MULTILINGUAL)
    updates, tail = stream(IncrementalDetokenizer(tok, enc(tok, PROMPT)), ids, chunks)
    assert all("\ufffd" not in u.delta for u in updates)
    assert joined(updates, tail) == MULTILINGUAL


def test_first_token_leading_space_uses_prompt_context(tok):
    prompt, gen = enc(tok, "Say hi:"), enc(tok, " Hello world")
    detok = IncrementalDetokenizer(tok, prompt)
    first = detok.add_tokens(gen[:1]).delta
    assert first.startswith(" ")
    assert first + detok.add_tokens(gen[1:]).delta + detok.finish() == " Hello world"
    # No prompt at all works too.
    updates, tail = stream(IncrementalDetokenizer(tok, []), gen)
    assert joined(updates, tail) == tok.decode(gen)


def test_incomplete_tail_released_at_finish(tok):
    ids = enc(tok, "ok 😀")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    updates, tail = stream(detok, ids[:cut])
    assert "\ufffd" not in joined(updates)
    assert tail.endswith("\ufffd")
    assert joined(updates, tail) == tok.decode(ids[:cut]) == detok.text
    assert detok.finish() == ""  # idempotent
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[cut:])


def test_special_tokens(tok):
    ids = enc(tok, "Hi there") + [tok.eos_token_id] + enc(tok, " more")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        updates, tail = stream(detok, ids)
        assert joined(updates, tail) == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in detok.text


def test_window_stays_small(tok):
    """Each step decodes O(window) tokens, not the whole sequence."""

    class Spy:
        max_len = 0

        def decode(self, ids, skip_special_tokens=True):
            Spy.max_len = max(Spy.max_len, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = enc(tok, MULTILINGUAL * 6)
    detok = IncrementalDetokenizer(Spy(), enc(tok, PROMPT))
    updates, tail = stream(detok, ids)
    assert joined(updates, tail) == tok.decode(ids)
    assert len(ids) > 300 and Spy.max_len <= 12


# ----------------------------------------------------------- stop strings


def test_stop_spanning_tokens(tok):
    text = "The answer is forty-two. Goodbye and more text"
    ids = enc(tok, text)
    for stop in ("swer is fo", "y-two. Good"):
        pos = text.index(stop)
        first, last = token_index_of(tok, ids, pos), token_index_of(tok, ids, pos + len(stop) - 1)
        assert last - first >= 1  # really spans tokens
        detok = IncrementalDetokenizer(tok, [], stop=[stop])
        updates = [detok.add_tokens([t]) for t in ids]
        hit = [i for i, u in enumerate(updates) if u.stop_matched]
        assert hit and hit[0] == last and updates[last].stop_matched == stop
        assert joined(updates) == detok.text == text[:pos]
        assert detok.finish() == ""


def test_stop_inside_single_token(tok):
    text = "Hello wonderful world again"
    ids = enc(tok, text)
    idx = token_index_of(tok, ids, text.index("wonderful"))
    assert tok.decode([ids[idx]]).strip() == "wonderful"
    for include, expected in ((False, "Hello wo"), (True, "Hello wonde")):
        detok = IncrementalDetokenizer(tok, [], stop=["nde"], include_stop_str_in_output=include)
        updates, tail = stream(detok, ids)
        assert updates[idx].stop_matched == "nde" and tail == ""
        assert joined(updates) == expected
        # Tokens after the stop are ignored.
        late = detok.add_tokens(enc(tok, " nde nde"))
        assert late == DetokenizerUpdate("", "nde") and detok.text == expected


def test_partial_match_held_then_released(tok):
    text = "the END is near END"
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["END!"])
    emitted, held_seen = "", []
    for i, t in enumerate(ids):
        u = detok.add_tokens([t])
        assert u.stop_matched is None
        emitted += u.delta
        whole = tok.decode(ids[: i + 1])
        assert whole.startswith(emitted)
        # What is held back is the longest tail that could start "END!".
        held_seen.append(whole[len(emitted) :])
        assert held_seen[-1] in ("", "E", "EN", "END")
    assert "END" in held_seen[:-1]  # the first "END" was held, then released
    assert emitted == "the END is near "
    assert detok.finish() == "END"
    assert detok.text == text and detok.stop_matched is None


def test_finish_releases_held_prefix(tok):
    ids = enc(tok, "stop at STO")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP", "\n\n"])
    updates = [detok.add_tokens([t]) for t in ids]
    assert joined(updates) == "stop at "
    assert detok.finish() == "STO"
    assert detok.text == "stop at STO" and detok.stop_matched is None


def test_include_stop_str(tok):
    text = "Question: why?\nAnswer: because.\nQuestion: next"
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["\nQuestion:"], include_stop_str_in_output=True)
    updates, tail = stream(detok, ids, 3)
    assert detok.stop_matched == "\nQuestion:" and tail == ""
    assert joined(updates, tail) == "Question: why?\nAnswer: because.\nQuestion:"


def test_multiple_stops_earliest_wins(tok):
    text = "alpha beta gamma delta"
    ids = enc(tok, text)
    for stops in (["delta", "beta", "gamma"], ["gamma", "beta"]):
        for chunks in (1, len(ids)):
            detok = IncrementalDetokenizer(tok, [], stop=stops)
            updates, tail = stream(detok, ids, chunks)
            assert joined(updates, tail) == "alpha "
            assert detok.stop_matched == "beta"


def _byte_bpe(merges: Sequence[tuple[bytes, bytes]] = ()):
    """A tiny byte-level BPE: 256 byte tokens plus the given merges."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    b2u = dict(zip(range(256), _bytes_to_unicode(), strict=True))

    def u(bs: bytes) -> str:
        return "".join(b2u[b] for b in bs)

    vocab = {u(bytes([b])): b for b in range(256)}
    merge_list = []
    for a, b in merges:
        merge_list.append((u(a), u(b)))
        vocab.setdefault(u(a + b), len(vocab))
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merge_list))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return t


def _bytes_to_unicode() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    # GPT-2 byte -> unicode table (printable bytes map to themselves).
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    assert set(table.values()) == set(ByteLevel.alphabet())
    return [table[b] for b in range(256)]


def test_byte_tokenizer_split_characters():
    t = _byte_bpe()
    text = "a😀b你好é🚀"
    ids = t.encode(text).ids
    assert len(ids) == len(text.encode())  # one token per byte
    updates, tail = stream(IncrementalDetokenizer(t, []), ids)
    assert [u.delta for u in updates if u.delta] == list(text)
    assert tail == "" and joined(updates) == text == t.decode(ids)


def test_byte_tokenizer_merges_across_characters():
    # "\x80\xf0" ends one emoji and starts the next: every prefix of the token
    # stream ends mid-character until the last token (longer than the cap).
    t = _byte_bpe(merges=[(b"\x80", b"\xf0")])
    text = "😀" * 8 + "!"
    ids = t.encode(text).ids
    assert len(ids) < len(text.encode())
    detok = IncrementalDetokenizer(t, [], stop=["😀!"])
    updates, tail = stream(detok, ids)
    assert all(not u.delta.endswith("\ufffd") and "\ufffd" not in u.delta for u in updates)
    assert joined(updates, tail) == "😀" * 7 and detok.stop_matched == "😀!"
    detok = IncrementalDetokenizer(t, [])
    updates, tail = stream(detok, ids)
    assert "\ufffd" not in joined(updates) and joined(updates, tail) == text


def test_overlapping_stops_do_not_depend_on_chunking():
    t = _byte_bpe()
    ids = t.encode("xabcd").ids
    for chunks in (1, 2, 5):
        detok = IncrementalDetokenizer(t, [], stop=["abcd", "bc"])
        updates, tail = stream(detok, ids, chunks)
        # "bc" completes before "abcd": streaming sees it first.
        assert (joined(updates, tail), detok.stop_matched) == ("xa", "bc")


# ---------------------------------------------------------- property test


def test_random_slices_and_stops(tok):
    rng = random.Random(1234)
    ids_all = enc(tok, MULTILINGUAL)
    pool = ["END", "!", "\n", " 你", "é", "🚀", "zzz", "mir.", "e ", "ü, "]
    checked_cases = 0
    for _ in range(120):
        a = rng.randrange(0, len(ids_all) - 1)
        b = rng.randrange(a + 1, min(len(ids_all), a + 40) + 1)
        gen = ids_all[a:b]
        full = tok.decode(gen)
        stops = rng.sample(pool, rng.randrange(0, 3))
        for _ in range(rng.randrange(0, 3)):
            i = rng.randrange(len(full))
            stops.append(full[i : i + rng.randrange(1, 6)])
        include = rng.random() < 0.5
        chunks = [rng.randrange(1, 5) for _ in range(4)]
        detok = IncrementalDetokenizer(
            tok, ids_all[:a], stop=stops, include_stop_str_in_output=include
        )
        updates, tail = stream(detok, gen, chunks)
        expected, matched = reference(full, stops, include)
        assert joined(updates, tail) == expected == detok.text, (a, b, stops, chunks)
        assert detok.stop_matched == matched
        # A slice may start inside a character (real U+FFFD text); one that
        # ends inside one only gets its U+FFFD from finish().
        if "\ufffd" not in full.rstrip("\ufffd"):
            assert all("\ufffd" not in u.delta for u in updates)
            checked_cases += 1
    assert checked_cases > 40
