"""probe_first_step: run a freshly compiled grammar's first decode step on a throwaway copy.

A grammar can compile and still be one llguidance cannot run: a regex or Lark lexeme
that repeats a literal a million times (``(a{1000}){1000}``, ``"x"{1000000}``) builds
its lexer lazily and runs out of lexer fuel or Earley items only when the first token
is computed or consumed. Found by the engine, that fails the request after it was
queued (a 500); found here, on the caller's thread before queueing, it is a 400.

The probe is what the engine's first step does to a sequence: compute the allowed-token
mask, then consume one allowed token (the lowest id that is not EOS, since EOS would
only stop it). Its cost is bounded by the limits the matcher was built with
(``GRAMMAR_LIMITS`` in ``compiler.py``; worst measured: ~1 s for ``(a{1000}){1000}``
over the default model's 49k-token vocabulary). Later steps may still hit a limit;
the engine then fails that request alone, as before.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import llguidance


def probe_first_step(prototype: llguidance.LLMatcher, vocab_size: int,
                     eos_token_ids: Collection[int]) -> str | None:
    """Why the grammar cannot run its first step (None when it can). ``prototype`` is
    left untouched: the probe runs on a copy."""
    matcher = prototype.deep_copy()
    words = (vocab_size + 31) // 32
    bits = np.zeros(words, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if matcher.is_error():
        return matcher.get_error()
    allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    token = next((int(t) for t in allowed if int(t) not in eos_token_ids), None)
    if token is not None and not matcher.consume_token(token):
        return matcher.get_error() or f"its first allowed token {token} cannot be consumed"
    return matcher.get_error() if matcher.is_error() else None
