"""A token embedding kept in its GGUF storage format: each step dequantizes its tokens' rows.

``GGUFEmbedding(raw, qtype)`` holds the embedding matrix as the file stores it (raw
uint8 ``[vocab, row bytes]``, usually a read-only view of the memory-mapped GGUF) and
``forward(ids)`` returns the fp32 rows of those ids (``kernels.gguf.gguf_rows``,
bitwise ``gguf.quants.dequantize``): a step touches T rows, never the whole matrix in
fp32.  A tied LM head is a kernel over the same ``raw`` tensor (no second copy).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class GGUFEmbedding(nn.Module):
    """ids [T] -> fp32 rows [T, hidden] of a quantized (or F16 / BF16) GGUF matrix."""

    def __init__(self, raw: Tensor, qtype: int, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.raw = raw  # uint8 [vocab, row bytes]; a plain attribute: never moved or saved
        self.qtype = int(qtype)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def forward(self, input_ids: Tensor) -> Tensor:  # [T] -> [T, hidden] float32
        from roseinfer.kernels.gguf import gguf_rows

        return gguf_rows(self.raw, self.qtype, input_ids.to(torch.long))

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType

        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"{GGMLQuantizationType(self.qtype).name} as stored")
