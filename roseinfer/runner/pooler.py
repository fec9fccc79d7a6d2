"""The pooled state of an embedding request after one prefill chunk's final hidden rows.

Mean pooling keeps the running sum of every row of the prompt in float64, folded in
position order (``cumsum`` over the previous sum then the chunk's rows: a sequential
scan on the CPU), so the sum is bitwise the same however the prompt was chunked.
Last-token pooling keeps the prompt's last row: only the chunk that completes the
prompt gives it.
"""

from __future__ import annotations

import torch

from roseinfer.pooling_params import PoolingParams


def pool_chunk(hidden: torch.Tensor, params: PoolingParams, completes: bool,
               previous: torch.Tensor | None) -> torch.Tensor | None:
    """``hidden``: [n, H], the chunk's rows; ``previous``: [H] float64, the sum of the
    prompt's earlier rows (None: this chunk starts the prompt). Returns the new state
    ([H]: float64 sum, or the float32 last row) or None (nothing to keep yet)."""
    if params.pooling == "mean":
        rows = hidden.double()  # [n, H]
        if previous is not None:
            rows = torch.cat([previous[None], rows])  # [1 + n, H]
        return rows.cumsum(dim=0)[-1]  # [H]: ((prev + r0) + r1) + ...
    return hidden[-1].float().clone() if completes else None  # [H]
