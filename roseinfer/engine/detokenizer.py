"""Incremental detokenization of one generated sequence, with stop strings.

:class:`IncrementalDetokenizer` turns generated token ids into text deltas as
they arrive. It works in two layers:

1. **UTF-8 safe decoding** (the prefix-offset / read-offset technique). Byte
   level BPE tokenizers split multibyte characters (emoji, CJK, accents) over
   several tokens and decoding a partial character yields ``'\\ufffd'``. We keep
   a small window of recent token ids ``ids[prefix_offset:]``; the tokens in
   ``ids[prefix_offset:read_offset]`` have already been emitted and only serve
   as left context (so merge / leading-space effects decode exactly as in a
   full decode). For every new token we decode the window with and without the
   unread tokens and emit the difference, unless it ends in ``'\\ufffd'`` (an
   incomplete character: wait for more tokens). Each step costs O(window), not
   O(sequence length). The window is seeded with the prompt's last few tokens
   so the first generated token's leading space is right.

2. **Stop strings.** The decoded text is scanned for stop strings; only the
   new text plus the held-back tail (at most ``max_stop_len - 1`` characters)
   is searched. The longest tail that is a prefix of some stop string is held
   back, so no part of a stop string ever leaks into a delta; it is released
   when later text rules the stop out, or by :meth:`IncrementalDetokenizer.finish`.
   When several stop strings occur, the one whose occurrence *completes* first
   wins (ties: the one starting first) -- this is exactly what token-by-token
   streaming observes, so the result does not depend on how tokens are grouped
   into :meth:`IncrementalDetokenizer.add_tokens` calls.

The tokenizer only needs ``decode(ids, skip_special_tokens=...) -> str`` (our
``roseinfer.tokenizer.Tokenizer`` wrapper and transformers tokenizers both
qualify).

Invariant: the concatenation of every delta (plus :meth:`finish`) equals
``text``, which equals ``tokenizer.decode(generated_ids)`` truncated at the
matched stop string (before it, or after it with
``include_stop_str_in_output``). A window decode can only diverge from the
full decode for tokenizers whose decode is not a concatenation of per-token
bytes (e.g. sentencepiece stripping a leading space, where the window version
is the desired one). Tokens that decode to nothing (skipped special tokens)
are kept as context for at most ``_MAX_PENDING_TOKENS`` tokens; after that
many tokens that all end mid-character (possible with merges that cross
character boundaries) the complete part is emitted early while the window
keeps growing until it ends cleanly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

# Prompt tokens used as left context for the first generated token.
_PROMPT_CONTEXT_TOKENS = 5
# Unread tokens held back whole (incomplete character / empty decode) before
# complete text is emitted anyway; a character needs at most 4 byte tokens.
_MAX_PENDING_TOKENS = 8
# Drop consumed ids once this many accumulate before the window.
_TRIM_THRESHOLD = 256
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """Result of :meth:`IncrementalDetokenizer.add_tokens`.

    ``delta`` is the newly emitted text (possibly empty); ``stop_matched`` is
    the stop string that ended the sequence, or None while it goes on.
    """

    delta: str
    stop_matched: str | None = None


class IncrementalDetokenizer:
    """Streams the text of one generated sequence, delta by delta.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_token_ids: the prompt; its last few tokens seed the window.
        stop: stop strings (empty strings are ignored).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: passed through to ``decode``.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output

        # De-duplicated, non-empty stop strings in their given order.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Every proper prefix of every stop string (hold-back candidates).
        self._stop_prefixes: frozenset[str] = frozenset(
            s[:i] for s in self._stops for i in range(1, len(s))
        )

        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes must not merge
            # with the generated ones (the full decode of the output would
            # not see them either), so start without context.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Cached decode of ids[prefix_offset:read_offset].
        self._prefix_text = context_text
        # Chars of the unread part already emitted (only after a long run of
        # tokens ending mid-character, see _decode_step).
        self._emitted_unread = 0

        self._pending = ""  # decoded text held back as a possible stop prefix
        self._stop_matched: str | None = None
        self._finished = False
        self.text = ""
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------ API

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the sequence, if any."""
        return self._stop_matched

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`finish` was called."""
        return self._finished or self._stop_matched is not None

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Append generated tokens; return the newly emitted text.

        After a stop string matched, further tokens are ignored and the update
        keeps reporting the matched stop string with an empty delta.
        """
        if self._stop_matched is not None:
            return DetokenizerUpdate("", self._stop_matched)
        if self._finished:
            raise RuntimeError("add_tokens() called after finish()")
        chunks: list[str] = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            self.num_generated_tokens += 1
            chunks.append(self._decode_step(force=False))
        delta = self._apply_stops("".join(chunks))
        self.text += delta
        return DetokenizerUpdate(delta, self._stop_matched)

    def finish(self) -> str:
        """End the sequence (eos / length / abort) and return held-back text.

        Releases an incomplete UTF-8 tail (as the tokenizer decodes it) and
        any tail held back as a possible stop-string prefix. Idempotent.
        """
        if self.finished:
            self._finished = True
            return ""
        self._finished = True
        delta = self._apply_stops(self._decode_step(force=True))
        if self._stop_matched is None:
            delta += self._pending
            self._pending = ""
        self.text += delta
        return delta

    # ------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, force: bool) -> str:
        """Decode the unread tokens; return newly complete text ('' to wait)."""
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        start = len(self._prefix_text) + self._emitted_unread
        if not force and len(self._ids) - self._read_offset <= _MAX_PENDING_TOKENS:
            if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= start:
                # Incomplete character, or nothing visible yet (e.g. a skipped
                # special token): keep the context and wait for more tokens.
                return ""
        elif not force and new_text.endswith(_REPLACEMENT_CHAR):
            # Long run of tokens that all end inside a character: emit what
            # is complete (the text before the trailing replacement run is
            # stable) but keep the offsets until the window ends cleanly.
            end = len(new_text.rstrip(_REPLACEMENT_CHAR))
            chunk = new_text[start:end] if end > start else ""
            self._emitted_unread += len(chunk)
            return chunk
        chunk = new_text[start:]
        # The emitted tokens become the left context of the next window.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted_unread = 0
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return chunk

    def _apply_stops(self, chunk: str) -> str:
        """Feed newly decoded text through stop matching; return what to emit."""
        if not self._stops:
            return chunk
        # Invariant: ``_pending`` (< max_stop_len chars) holds no complete
        # stop string and no emitted suffix extends it into a stop prefix, so
        # any match starts inside ``buf`` and ends inside ``chunk``.
        buf = self._pending + chunk
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, stop = best
            self._stop_matched = stop
            self._pending = ""
            return buf[: end if self._include_stop else start]
        hold = 0
        for k in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                hold = k
                break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]
