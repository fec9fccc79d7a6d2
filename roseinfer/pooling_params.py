"""PoolingParams: how an embedding request turns its prompt's hidden states into a vector.

An embedding request only prefills: the model's final hidden states (after the final
norm) of every prompt position are pooled — ``"mean"`` over all positions or the
``"last"`` position's row — and L2-normalized unless ``normalize`` is off.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("mean", "last")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    pooling: str = "mean"  # "mean" | "last"
    normalize: bool = True  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be a bool")
