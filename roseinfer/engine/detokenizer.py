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

2. **Stop strings** (:mod:`roseinfer.stop_strings`). Every newly
   decoded character is fed once to a streaming KMP matcher (amortised
   O(#stop strings) per character; compiling the stop strings is linear in
   their total length and the compiled :class:`StopStrings` can be shared by
   all sequences of a request). The longest tail that is a proper prefix of
   some stop string (the longest current partial match) is held back, so no
   part of a stop string ever leaks into a delta; it is released when later
   text rules the stop out, or by :meth:`IncrementalDetokenizer.finish`.
   When several stop strings occur, the one whose occurrence *completes* first
   wins (ties: the one starting first) -- this is exactly what token-by-token
   streaming observes, so the result does not depend on how tokens are grouped
   into :meth:`IncrementalDetokenizer.add_tokens` calls.

   ``min_tokens`` (vLLM semantics): an occurrence only counts if its last
   character was produced while adding generated token number k (1-based,
   each id passed to ``add_tokens`` counts one) with ``k > min_tokens``;
   text released by :meth:`IncrementalDetokenizer.finish` counts as produced
   by the last token added. Earlier occurrences are ignored and emitted as
   normal text; a stop string that starts within the first ``min_tokens``
   tokens and completes later does count (hold-back runs from the start).

The tokenizer only needs ``decode(ids, skip_special_tokens=...) -> str`` (our
``roseinfer.tokenizer.Tokenizer`` wrapper and transformers tokenizers both
qualify).

Invariant: the concatenation of every delta (plus :meth:`finish`) equals
``text``, which equals ``tokenizer.decode(generated_ids)`` truncated at the
first qualifying stop string occurrence (before it, or after it with
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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from roseinfer.stop_strings import StopMatcher, StopStrings

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
        stop: stop strings (empty strings are ignored), or a compiled
            :class:`StopStrings` (may be shared between sequences).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: passed through to ``decode``.
        min_tokens: stop strings completing within the first ``min_tokens``
            generated tokens are ignored (see the module docstring).
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] | StopStrings = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens

        self._stops = StopStrings.compile(stop)
        self._matcher: StopMatcher | None = self._stops.matcher() if self._stops else None
        # Decoded text held back as a possible stop prefix: chunks, of which
        # the first ``_held_off`` chars of ``_held[0]`` are already released.
        self._held: deque[str] = deque()
        self._held_off = 0
        self._held_len = 0

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

        self._stop_matched: str | None = None
        self._finished = False
        self._text_parts: list[str] = []
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------ API

    @property
    def text(self) -> str:
        """Everything emitted so far (the concatenation of all deltas)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def held_back(self) -> int:
        """Number of decoded characters currently held back as a stop prefix."""
        return self._held_len

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

        After a stop string matched, further tokens (including the rest of
        this call's) are ignored and not counted; the update keeps reporting
        the matched stop string with an empty delta.
        """
        if self._stop_matched is not None:
            return DetokenizerUpdate("", self._stop_matched)
        if self._finished:
            raise RuntimeError("add_tokens() called after finish()")
        out: list[str] = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            self.num_generated_tokens += 1
            chunk = self._decode_step(force=False)
            if chunk and self._consume(chunk, out):
                break
        else:
            if self._matcher is not None:
                out.append(self._release(self._held_len - self._matcher.hold))
        return DetokenizerUpdate(self._emit(out), self._stop_matched)

    def finish(self) -> str:
        """End the sequence (eos / length / abort) and return held-back text.

        Releases an incomplete UTF-8 tail (as the tokenizer decodes it) and
        any tail held back as a possible stop-string prefix. The released
        text counts as produced by the last token added, so it can still
        complete a stop string (then :attr:`stop_matched` is set and only the
        text before it -- or through it -- is returned). Idempotent.
        """
        if self.finished:
            self._finished = True
            return ""
        self._finished = True
        out: list[str] = []
        chunk = self._decode_step(force=True)
        if not (chunk and self._consume(chunk, out)):
            out.append(self._release(self._held_len))
        return self._emit(out)

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

    def _emit(self, out: list[str]) -> str:
        delta = "".join(out)
        if delta:
            self._text_parts.append(delta)
        return delta

    def _consume(self, chunk: str, out: list[str]) -> bool:
        """Feed the text produced by the latest token; True if a stop matched.

        Without stop strings the chunk goes straight to ``out``; otherwise it
        is held and the caller releases what the matcher no longer holds.
        """
        matcher = self._matcher
        if matcher is None:
            out.append(chunk)
            return False
        self._held.append(chunk)
        self._held_len += len(chunk)
        qualifies = self.num_generated_tokens > self._min_tokens
        pos = 0
        while (hit := matcher.scan(chunk, pos)) is not None:
            end, stop = hit
            if qualifies:
                # The occurrence starts inside the held text (its partial
                # match never exceeded the hold) and ends at chunk[end - 1].
                keep = self._held_len - len(chunk) + end
                if not self._include_stop:
                    keep -= len(stop)
                out.append(self._release(keep))
                self._held.clear()
                self._held_off = self._held_len = 0
                self._stop_matched = stop
                return True
            pos = end  # within the first min_tokens tokens: ignore it
        return False

    def _release(self, n: int) -> str:
        """Remove and return the first ``n`` held characters."""
        parts: list[str] = []
        held = self._held
        while n > 0:
            head, off = held[0], self._held_off
            avail = len(head) - off
            if avail <= n:
                parts.append(head[off:] if off else head)
                held.popleft()
                self._held_off = 0
                self._held_len -= avail
                n -= avail
            else:
                parts.append(head[off : off + n])
                self._held_off = off + n
                self._held_len -= n
                n = 0
        return "".join(parts)
