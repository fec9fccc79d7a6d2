"""Rotary position embedding: rope-scaling math, the cos/sin table and applying it.

Frequencies follow transformers' ``modeling_rope_utils`` bit for bit (same float32
operations in the same order) for the supported ``rope_type`` values:

* ``default``; ``dynamic`` (NTK: only changes frequencies beyond
  ``max_position_embeddings``, where the table stops, so it equals default here);
* ``linear`` (positions divided by ``factor``), ``llama3`` (Llama 3.1+ wavelength bands);
* ``longrope`` (Phi-3 / Phi-4-mini): ``short_factor`` for positions below
  ``original_max_position_embeddings``, ``long_factor`` from there on, cos/sin scaled by
  ``attention_factor`` (default ``sqrt(1 + ln(factor) / ln(original))``).  Transformers
  picks one set per forward from the longest position it sees, so the two agree on any
  sequence whose prompt fits in the original context (a generation that grows past it
  keeps its early keys, exactly as transformers' incremental decoding does); a longer
  prompt is rotated per position here, all-long there.

Anything else (yarn, ...) is refused by :func:`check_rope_scaling` with an error naming
``rope_scaling.rope_type``.  ``partial_rotary_factor`` < 1 rotates only the first
``rotary_dim`` channels of each head (Phi-4-mini), rotate-half style within them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from roseinfer.model.row_kernels import row_kernels_usable

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
_REQUIRED: Mapping[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def rope_type_of(rope_scaling: Mapping[str, Any] | None) -> str:
    """The ``rope_type`` of an HF ``rope_scaling`` dict (old ``type`` key too; ``su`` =
    longrope); ``default`` for None."""
    if not rope_scaling:
        return "default"
    kind = str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))
    return "longrope" if kind == "su" else kind


def check_rope_scaling(rope_scaling: Mapping[str, Any] | None, rotary_dim: int) -> None:
    """Raise ValueError naming the field when ``rope_scaling`` is not supported."""
    kind = rope_type_of(rope_scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling.rope_type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    params = rope_scaling or {}
    for key in _REQUIRED.get(kind, ()):
        if params.get(key) is None:
            raise ValueError(f"rope_scaling.{key} is required for rope_type {kind!r}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != rotary_dim // 2:
                raise ValueError(
                    f"rope_scaling.{key} has {len(params[key])} entries, expected "
                    f"{rotary_dim // 2} (rotary dim {rotary_dim} / 2)"
                )


def compute_inv_freq(
    head_dim: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> Tensor:
    """[head_dim // 2] float32 inverse frequencies (``head_dim`` = the rotary dim).

    For longrope, ``seq_len`` > original context picks ``long_factor`` (as transformers).
    """
    check_rope_scaling(rope_scaling, head_dim)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [Dh/2]
    kind = rope_type_of(rope_scaling)
    if kind == "longrope":
        assert rope_scaling is not None
        orig = int(rope_scaling["original_max_position_embeddings"])
        key = "long_factor" if seq_len is not None and seq_len > orig else "short_factor"
        ext = torch.tensor(rope_scaling[key], dtype=torch.float32)  # [Dh/2]
        return 1.0 / (ext * base**exponents)
    inv_freq = 1.0 / (base**exponents)  # [Dh/2]
    if kind in ("default", "dynamic"):
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low_freq_factor = float(rope_scaling["low_freq_factor"])  # llama3
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_ctx = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [Dh/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [Dh/2]
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def attention_scaling(rope_scaling: Mapping[str, Any] | None, max_position_embeddings: int) -> float:
    """Factor on cos/sin (longrope's ``attention_factor``; 1.0 for every other type)."""
    if rope_type_of(rope_scaling) != "longrope":
        return 1.0
    assert rope_scaling is not None
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    orig = int(rope_scaling["original_max_position_embeddings"])
    factor = rope_scaling.get("factor") or max_position_embeddings / orig
    return math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0


def cos_sin_table(
    rotary_dim: int, base: float, rope_scaling: Mapping[str, Any] | None, max_positions: int
) -> Tensor:
    """float32 ``[max_positions, rotary_dim]``: cos of the half-dim angles, then sin."""
    t = torch.arange(max_positions, dtype=torch.float32)  # [P]
    freqs = torch.outer(t, compute_inv_freq(rotary_dim, base, rope_scaling, max_positions))
    if rope_type_of(rope_scaling) == "longrope":
        assert rope_scaling is not None
        orig = int(rope_scaling["original_max_position_embeddings"])
        long_inv = compute_inv_freq(rotary_dim, base, rope_scaling, max_positions, orig + 1)
        freqs[orig:] = torch.outer(t[orig:], long_inv)  # [P - orig, Dh/2]
    scale = attention_scaling(rope_scaling, max_positions)
    cos, sin = freqs.cos(), freqs.sin()  # [P, Dh/2] each
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, sin], dim=-1)  # [P, rotary_dim]


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin cache.

    ``cos_sin_cache`` is a non-persistent buffer ``[max_positions, rotary_dim]`` (first
    half cos, second half sin) computed in float32 then stored in the module dtype, as
    transformers casts cos/sin to the activation dtype before rotating.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.rope_scaling = rope_scaling
        check_rope_scaling(rope_scaling, self.rotary_dim)
        cache = torch.empty(max_position_embeddings, self.rotary_dim)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        if not cache.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin cache in place; call after ``to_empty``."""
        self.cos_sin_cache.copy_(cos_sin_table(
            self.rotary_dim, self.base, self.rope_scaling, self.max_position_embeddings))

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, rotary_dim] for ``positions`` [T]; compute once per forward."""
        cos_sin = self.cos_sin_cache[positions]  # [T, rd]
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rd/2] each
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, rd]
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)  # [T, 1, rd]
        return cos, sin


@dataclass(slots=True)
class RopeInputs:
    """Rotary inputs of one forward: ``positions`` [T] and the ``[P, rd]`` cos/sin cache,
    plus ``cos``/``sin`` [T, 1, rd] for the PyTorch path (None when the C++ row kernels
    rotate q/k and write the KV cache in one pass: ``fused``)."""

    positions: Tensor
    cos_sin_cache: Tensor
    cos: Tensor | None
    sin: Tensor | None

    @property
    def fused(self) -> bool:
        return self.cos is None


def rope_inputs(rotary: RotaryEmbedding, positions: Tensor, sample: Tensor) -> RopeInputs:
    """RopeInputs for this step: fused when the row kernels serve ``sample``'s dtype/device,
    the cache is float32 and covers the whole head, else with cos/sin gathered for the
    PyTorch path."""
    cache = rotary.cos_sin_cache
    if (cache.dtype == torch.float32 and rotary.rotary_dim == rotary.head_dim
            and row_kernels_usable(sample)):
        return RopeInputs(positions, cache, None, None)
    cos, sin = rotary(positions)
    return RopeInputs(positions, cache, cos, sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin on the first rd channels; x [T, heads, Dh],
    cos/sin [T, 1, rd] (rd <= Dh: the rest pass through, as transformers' partial rotary)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = rd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [T, heads, Dh]
    return x * cos + rotated * sin
