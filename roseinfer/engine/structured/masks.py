"""MaskBuilder: the allowed-token masks of a batch of grammar matchers.

``fill`` asks llguidance for one bitmask per matcher (bit ``t`` of row ``i`` set = token
``t`` allowed) with the GIL released, into a reused int32 buffer: row by row on the
calling thread, or with ``num_threads`` > 1 all rows at once on llguidance's pool. It
touches no torch / OpenMP state, so it may run on a worker thread while the engine
thread runs the forward. ``to_allowed`` unpacks the bits into a
``[B, V]`` bool tensor over the MODEL's vocabulary: ids the tokenizer does not have
(a model vocabulary wider than the tokenizer's) are never allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from roseinfer.engine.structured.matcher import GrammarMatcher


class MaskBuilder:
    def __init__(self, ll_vocab_size: int, vocab_size: int, num_threads: int) -> None:
        import llguidance

        self.ll_vocab_size = ll_vocab_size
        self.vocab_size = vocab_size
        self.words = (ll_vocab_size + 31) // 32  # int32 words per row
        self._bits = np.zeros((0, self.words), dtype=np.int32)
        self._executor = llguidance.LLExecutor(num_threads=num_threads) if num_threads > 1 else None

    def fill(self, matchers: Sequence[GrammarMatcher]) -> np.ndarray:
        """[B, words] int32 bitmasks of ``matchers`` (a view of a buffer reused by the next
        call: unpack it first)."""
        b = len(matchers)
        if self._bits.shape[0] < b:
            self._bits = np.zeros((max(b, 2 * self._bits.shape[0]), self.words), dtype=np.int32)
        bits = self._bits[:b]
        if self._executor is None:
            base, row_bytes = bits.ctypes.data, self.words * 4
            for i, m in enumerate(matchers):
                m.ll.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr(
                [(m.ll, i) for i, m in enumerate(matchers)], bits.ctypes.data, self.words * 4, b)
        return bits

    def to_allowed(self, bits: np.ndarray, device: torch.device) -> torch.Tensor:
        """[B, V] bool (True = allowed) from [B, words] bitmasks; V = the model's vocab."""
        as_bytes = np.ascontiguousarray(bits, dtype="<i4").view(np.uint8)
        unpacked = np.unpackbits(as_bytes, axis=1, bitorder="little")  # [B, 32 * words]
        v, known = self.vocab_size, min(self.ll_vocab_size, self.vocab_size)
        if unpacked.shape[1] > known:
            unpacked[:, known:] = 0  # beyond the tokenizer (or the model): never allowed
        if unpacked.shape[1] >= v:
            unpacked = unpacked[:, :v]
        else:
            unpacked = np.pad(unpacked, ((0, 0), (0, v - unpacked.shape[1])))
        allowed = torch.from_numpy(np.ascontiguousarray(unpacked)).view(torch.bool)
        return allowed if device.type == "cpu" else allowed.to(device)
