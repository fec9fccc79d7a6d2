"""Shared building blocks: RMSNorm, rotary embedding, activations, paged attention.

``paged_attention`` is the single place that reads and writes the paged KV cache, so
a faster kernel can replace it without touching the model files.

Shape letters: T flat tokens, H query heads, Hkv KV heads, G = H // Hkv, Dh head dim,
D decode sequences, L context length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.model.attention_metadata import AttentionMetadata


def row_kernels_usable(x: Tensor) -> bool:
    """True when the C++ row kernels (``roseinfer.kernels``) can serve ops on x: a float32
    CPU tensor and a loaded kernel library."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    from roseinfer.kernels import cpu_kernels_available

    return cpu_kernels_available()


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        if self.weight.dtype == torch.float32 and row_kernels_usable(x):
            return torch.ops.roseinfer.rms_norm(x, self.weight, self.eps)  # one pass
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, hidden]
        return self.weight * h.to(dtype)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    """Activation function by its Hugging Face ``hidden_act`` name."""
    table: dict[str, Callable[[Tensor], Tensor]] = {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_new": _gelu_tanh,
        "gelu_pytorch_tanh": _gelu_tanh,
        "gelu_fast": _gelu_tanh,
        "relu": F.relu,
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(table)}")
    return table[name]


def compute_inv_freq(
    head_dim: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> Tensor:
    """[head_dim // 2] float32 inverse frequencies, with transformers' rope-scaling math.

    Supported ``rope_type`` values: default, linear, dynamic, llama3.  "dynamic" (NTK)
    only changes frequencies beyond ``max_position_embeddings``; since the cos/sin cache
    stops there, it equals the default rope inside the supported range.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [Dh/2]
    inv_freq = 1.0 / (base**exponents)  # [Dh/2]
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type in ("default", "dynamic"):
        return inv_freq
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
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
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, dynamic, llama3"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin cache.

    ``cos_sin_cache`` is a non-persistent buffer ``[max_positions, Dh]`` (first half cos,
    second half sin) computed in float32 then stored in the module dtype, as
    transformers casts cos/sin to the activation dtype before rotating.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.rope_scaling = rope_scaling
        cache = torch.empty(max_position_embeddings, head_dim)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        if not cache.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin cache in place; call after ``to_empty``."""
        inv_freq = compute_inv_freq(
            self.head_dim, self.base, self.rope_scaling, self.max_position_embeddings
        )  # [Dh/2]
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)  # [P]
        freqs = torch.outer(t, inv_freq)  # [P, Dh/2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, Dh]
        self.cos_sin_cache.copy_(cache)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, Dh] for ``positions`` [T]; compute once per forward."""
        cos_sin = self.cos_sin_cache[positions]  # [T, Dh]
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, Dh/2] each
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, Dh]
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)  # [T, 1, Dh]
        return cos, sin


@dataclass(slots=True)
class RopeInputs:
    """Rotary inputs of one forward: ``positions`` [T] and the ``[P, Dh]`` cos/sin cache,
    plus ``cos``/``sin`` [T, 1, Dh] for the PyTorch path (None when the C++ row kernels
    rotate q/k and write the KV cache in one pass: ``fused``)."""

    positions: Tensor
    cos_sin_cache: Tensor
    cos: Tensor | None
    sin: Tensor | None

    @property
    def fused(self) -> bool:
        return self.cos is None


def rope_inputs(rotary: RotaryEmbedding, positions: Tensor, sample: Tensor) -> RopeInputs:
    """RopeInputs for this step: fused when the row kernels serve ``sample``'s dtype/device
    and the cache is float32, else with cos/sin gathered for the PyTorch path."""
    cache = rotary.cos_sin_cache
    if cache.dtype == torch.float32 and row_kernels_usable(sample):
        return RopeInputs(positions, cache, None, None)
    cos, sin = rotary(positions)
    return RopeInputs(positions, cache, cos, sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin; x [T, heads, Dh], cos/sin [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [T, heads, Dh]
    return x * cos + rotated * sin


def write_kv_cache(kv_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """Store k, v [T, Hkv, Dh] into kv_cache [2, slots, Hkv, Dh] at slot_mapping [T]."""
    kv_cache[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _use_attention_kernel(q: Tensor, kv_cache: Tensor) -> bool:
    """True when the C++ paged-attention kernel can serve this call."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    if kv_cache.dtype not in (torch.float32, torch.float16):
        return False
    from roseinfer.kernels import cpu_kernels_available

    return cpu_kernels_available()


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
) -> Tensor:
    """Causal attention over a paged KV cache; returns [T, H, Dh].

    q [T, H, Dh], k/v [T, Hkv, Dh] are this step's new tokens; kv_cache is
    [2, num_slots, Hkv, Dh].  The new K/V are written to the cache first (unless the
    caller did: ``kv_written``).  With the C++ kernels every row then attends through
    one kernel (batch-invariant); the PyTorch fallback runs decode sequences (tokens
    0..D-1) in one batched SDPA and prefill sequences one at a time with a causal mask
    offset by their cached prefix (fast, but its numerics depend on the batch shape).
    """
    if not kv_written:
        write_kv_cache(kv_cache, meta.slot_mapping, k, v)
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)  # [T, H, Dh]
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [slots, Hkv, Dh] each

    if _use_attention_kernel(q, kv_cache) and meta.token_seq is not None:
        # Every row alike (prefill and decode), straight from the paged cache: a row's
        # result never depends on the rest of the batch (docs/CONTRACTS.md).
        return torch.ops.roseinfer.paged_attention(
            q, kv_cache, meta.block_tables, meta.token_seq, meta.token_context_lens,
            meta.block_size, scale,
        )  # [T, H, Dh]
    d = meta.num_decode_tokens
    if d > 0:
        # GQA without repeating K/V: each KV head is a batch entry with G queries.
        qd = q[:d].view(d, num_kv_heads, group, head_dim)  # [D, Hkv, G, Dh]
        kd = key_cache[meta.decode_slot_indices].to(q.dtype)  # [D, Lmax, Hkv, Dh]
        vd = value_cache[meta.decode_slot_indices].to(q.dtype)  # [D, Lmax, Hkv, Dh]
        kd = kd.transpose(1, 2)  # [D, Hkv, Lmax, Dh]
        vd = vd.transpose(1, 2)  # [D, Hkv, Lmax, Dh]
        mask = meta.decode_mask[:, None, None, :]  # [D, 1, 1, Lmax]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        out[:d] = od.reshape(d, num_heads, head_dim)  # [D, Hkv, G, Dh] -> [D, H, Dh]

    for p in meta.prefills:
        s, e = p.query_start, p.query_end
        qp = q[s:e].transpose(0, 1)  # [H, n, Dh]
        if p.num_computed_tokens == 0:
            kp = k[s:e].transpose(0, 1)  # [Hkv, n, Dh] (context == new tokens)
            vp = v[s:e].transpose(0, 1)  # [Hkv, n, Dh]
        else:
            kp = key_cache[p.context_slot_indices].to(q.dtype).transpose(0, 1)  # [Hkv, L, Dh]
            vp = value_cache[p.context_slot_indices].to(q.dtype).transpose(0, 1)  # [Hkv, L, Dh]
        if group > 1:  # whole heads: SDPA's fused CPU kernel (3-5x its GQA path here)
            kp = kp.repeat_interleave(group, dim=0)  # [H, L, Dh]
            vp = vp.repeat_interleave(group, dim=0)  # [H, L, Dh]
        op = F.scaled_dot_product_attention(
            qp[None],
            kp[None],
            vp[None],
            attn_mask=p.causal_mask,  # [n, L] bool or None
            is_causal=p.causal_mask is None,
            scale=scale,
        )[0]  # [H, n, Dh]
        out[s:e] = op.transpose(0, 1)  # [n, H, Dh]
    return out


class WeightLoadTracker:
    """Copies checkpoint tensors into a model's parameters and records what was filled.

    A parameter may be filled whole (shard ``""``) or in named row slices (fused
    ``qkv_proj`` / ``gate_up_proj``); ``finish`` raises naming every parameter (or
    shard) that was never loaded and every checkpoint name that matched nothing.
    """

    def __init__(self, model: nn.Module, shards: dict[str, set[str]] | None = None) -> None:
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        shards = shards or {}
        self.expected: dict[str, set[str]] = {n: shards.get(n, {""}) for n in self.params}
        self.loaded: dict[str, set[str]] = {n: set() for n in self.params}
        self.unknown: list[str] = []

    def has(self, name: str) -> bool:
        return name in self.params

    @torch.no_grad()
    def load(
        self,
        name: str,
        tensor: Tensor,
        shard: str = "",
        rows: tuple[int, int] | None = None,
        source: str | None = None,
    ) -> None:
        """Copy ``tensor`` into parameter ``name`` (rows ``[a, b)`` of dim 0 if given)."""
        source = source or name
        if name not in self.params:
            self.unknown.append(source)
            return
        param = self.params[name]
        target = param.data if rows is None else param.data[rows[0] : rows[1]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)} for {name!r}"
            )
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.loaded[name].add(shard)

    def finish(self) -> None:
        """Raise ValueError on unknown checkpoint names or never-loaded parameters."""
        if self.unknown:
            raise ValueError(f"unknown checkpoint tensors: {sorted(self.unknown)}")
        missing = []
        for name, want in self.expected.items():
            lacking = want - self.loaded[name]
            if lacking:
                missing.append(name if lacking == {""} else f"{name} (shards {sorted(lacking)})")
        if missing:
            raise ValueError(f"parameters never loaded from the checkpoint: {missing}")
