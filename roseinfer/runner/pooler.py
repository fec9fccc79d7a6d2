"""The pooled part of one prefill chunk's final hidden rows (embedding requests).

Mean pooling needs the sum of every row of the prompt: each chunk contributes the sum
of its own rows (float32). Last-token pooling needs the prompt's last row: only the
chunk that completes the prompt contributes it.
"""

from __future__ import annotations

import torch

from roseinfer.pooling_params import PoolingParams


def pool_chunk(hidden: torch.Tensor, params: PoolingParams, completes: bool
               ) -> torch.Tensor | None:
    """``hidden``: [n, H], the chunk's rows. Returns [H] float32 or None (nothing to add)."""
    if params.pooling == "mean":
        return hidden.float().sum(dim=0)  # [H]
    return hidden[-1].float().clone() if completes else None  # [H]
