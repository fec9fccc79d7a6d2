"""Random draws of the sampler: one U[0, 1) value per row (seeded rows from their own
generator) and the token whose CDF interval holds it (``sample_inverse_cdf``), so a
seeded row's token never depends on the batch around it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def uniform_draws(
    probs: Tensor,
    generators: Sequence[torch.Generator | None],
    seeded_rows: Sequence[int],
    default_generator: torch.Generator | None = None,
) -> Tensor:
    """One U[0, 1) draw per row of probs [B, V] -> [B] float64.

    Unseeded rows share one draw of B values from ``default_generator`` (torch's
    default RNG when None); each row in ``seeded_rows`` draws from
    ``generators[row]``, so a seeded row's token depends only on its generator,
    never on the batch around it (greedy rows are left out of ``seeded_rows`` and
    leave their generator untouched).
    """
    b = probs.shape[0]
    u = torch.empty(b, dtype=torch.float64, device=probs.device)
    if len(seeded_rows) < b:
        u.uniform_(generator=default_generator)
    for i in seeded_rows:
        u[i : i + 1].uniform_(generator=generators[i])
    return u


def sample_inverse_cdf(probs: Tensor, u: Tensor, chunk: int = 1024,
                       with_validity: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Token per row whose CDF interval holds u: probs [B, V] (rows sum to ~1), u [B].

    Picks the first index whose running sum exceeds u * total, in two levels: the
    chunk (of ``chunk`` tokens) from the running sum of chunk sums, then the token
    from the running sum inside that one chunk.  A full [B, V] cumsum is a serial
    pass (~1 ns per element); this reads probs once with a vectorised sum.  A
    zero-probability token (masked by top-k/top-p/min-p, or padding) has an empty
    interval and is never picked, rounding included.  One uniform per row replaces
    V exponential draws (~1 ms per row at V = 49k).

    A row whose total is not a positive finite number (all zero, NaN, inf) cannot
    be sampled: its id is still clamped into ``[0, V)``, and ``with_validity=True``
    also returns the [B] bool mask of rows that were sampled properly.
    """
    b, v = probs.shape
    n = -(-v // chunk)
    if n * chunk != v:
        probs = F.pad(probs, (0, n * chunk - v))
    blocks = probs.view(b, n, chunk)  # [B, n, C]
    sums = blocks.sum(-1).double()  # [B, n]
    cdf = sums.cumsum(-1)  # [B, n]
    target = u * cdf[:, -1]  # [B], below the row total
    k = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [B]
    k = torch.minimum(k, _last_nonzero(sums))  # rounding at the very top
    rows = torch.arange(b, device=probs.device)
    before = torch.where(k > 0, cdf[rows, (k - 1).clamp(min=0)], 0.0)  # [B]
    block = blocks[rows, k]  # [B, C]
    inner = block.cumsum(-1, dtype=torch.float64)  # [B, C]
    rest = (target - before).clamp(min=0.0).unsqueeze(1)  # [B, 1]
    j = torch.searchsorted(inner, rest, right=True).squeeze(1)  # [B]
    j = torch.minimum(j, _last_nonzero(block))  # rounding past the chunk's own sum
    ids = (k * chunk + j).clamp_(0, v - 1)
    if not with_validity:
        return ids
    total = cdf[:, -1]
    return ids, torch.isfinite(total) & (total > 0)


def _last_nonzero(x: Tensor) -> Tensor:
    """Index of the last entry > 0 in each row of x [B, N] (0 for an all-zero row)."""
    n = x.shape[1]
    return (n - 1 - (x > 0).flip(-1).to(torch.uint8).argmax(-1)).clamp(min=0)
