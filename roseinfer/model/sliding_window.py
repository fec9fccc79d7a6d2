"""Sliding-window attention over the paged KV cache: which keys each token may see.

A token at position ``p`` of a layer with window ``W`` attends to positions
``max(0, p - W + 1) .. p`` (transformers' ``kv_idx > q_idx - W``).  The cache itself is
untouched: every position keeps its slot, so chunked prefill, prefix caching and
preemption work as for full attention; only the set of keys read changes.  Blocks that
fall wholly outside every running request's window are *not* freed (that would be a
block-manager change): memory use is that of full attention.

:func:`sliding_window_view` describes one step for one window, built once per forward
and shared by every windowed layer; it is None when no token of the step reaches past
the window, where full attention is already exact.  It serves both attention paths:

* the C++ ``paged_attention`` op: each token gets its own row of KV slots
  (``kernel_tables``: ``[T, Wmax]`` slots, read with ``block_size`` 1, so a row lists
  exactly the positions in its window).  The kernel's arithmetic depends on block
  size only for addressing, so a windowed row is computed exactly like a full one
  that happens to have those keys: batch-invariant as ever;
* the PyTorch fallback: the decode mask and each prefill's causal mask, narrowed to
  the window (``decode_mask`` / ``prefill_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from roseinfer.model.attention_metadata import AttentionMetadata, PrefillMetadata


@dataclass(slots=True)
class WindowView:
    """One step's attention metadata seen through a sliding window of ``window`` keys."""

    window: int
    meta: AttentionMetadata
    _kernel: tuple[Tensor, Tensor, Tensor] | None = None
    _decode_mask: Tensor | None = None
    _prefill_masks: dict[int, Tensor | None] = field(default_factory=dict)

    def kernel_tables(self) -> tuple[Tensor, Tensor, Tensor]:
        """(slot table [T, Wmax] int32, token row [T] int32, keys per token [T] int32) for
        ``torch.ops.roseinfer.paged_attention(..., block_size=1)``."""
        if self._kernel is None:
            meta = self.meta
            assert meta.block_tables is not None and meta.token_seq is not None
            pos = meta.positions  # [T]
            lens = torch.clamp(pos + 1, max=self.window)  # [T] keys in each window
            start = pos + 1 - lens  # [T] first visible position
            cols = torch.arange(int(lens.max()), device=pos.device)  # [Wmax]
            # Padding columns repeat the last visible position (never read: lens).
            key_pos = start[:, None] + torch.minimum(cols[None, :], (lens - 1)[:, None])  # [T, Wmax]
            bs = meta.block_size
            rows = meta.token_seq.long()[:, None]  # [T, 1]
            blocks = meta.block_tables.long()[rows, torch.div(key_pos, bs, rounding_mode="floor")]
            slots = (blocks * bs + key_pos % bs).to(torch.int32)  # [T, Wmax]
            token_rows = torch.arange(pos.shape[0], dtype=torch.int32, device=pos.device)  # [T]
            self._kernel = (slots.contiguous(), token_rows, lens.to(torch.int32))
        return self._kernel

    def decode_mask(self) -> Tensor:
        """[D, Lmax] bool: ``meta.decode_mask`` limited to each decode's last ``window`` keys."""
        if self._decode_mask is None:
            meta = self.meta
            cols = torch.arange(meta.max_decode_context_len, device=meta.decode_mask.device)
            first = (meta.decode_context_lens - self.window)[:, None]  # [D, 1]
            self._decode_mask = meta.decode_mask & (cols[None, :] >= first)  # [D, Lmax]
        return self._decode_mask

    def prefill_mask(self, index: int, p: PrefillMetadata) -> Tensor | None:
        """[n, c + n] bool mask of prefill ``index`` (query i sees keys ``c + i - W < k <=
        c + i``); its plain causal mask (None = causal) when the window never binds."""
        if index not in self._prefill_masks:
            c, n = p.num_computed_tokens, p.query_end - p.query_start
            if c + n <= self.window:
                self._prefill_masks[index] = p.causal_mask
            else:
                device = p.context_slot_indices.device
                keys = torch.arange(c + n, device=device)[None, :]  # [1, c+n]
                queries = c + torch.arange(n, device=device)[:, None]  # [n, 1]
                self._prefill_masks[index] = (keys <= queries) & (keys > queries - self.window)
        return self._prefill_masks[index]


def sliding_window_view(meta: AttentionMetadata, window: int | None) -> WindowView | None:
    """The step's :class:`WindowView`, or None when ``window`` is None or no token's
    position reaches it (every key is then inside every window)."""
    if window is None or int(meta.positions.max()) < window:
        return None
    return WindowView(window, meta)
