"""Shared building blocks: RMSNorm, activations, paged attention, weight loading.

``paged_attention`` is the single place that reads and writes the paged KV cache, so
a faster kernel can replace it without touching the model files.  Rotary embedding
lives in ``rope``; which keys a sliding-window layer sees, in ``sliding_window``.

Shape letters: T flat tokens, H query heads, Hkv KV heads, G = H // Hkv, Dh head dim,
D decode sequences, L context length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.model import kv_int8
from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.rope import compute_inv_freq as compute_inv_freq  # re-export
from roseinfer.model.row_kernels import row_kernels_usable as row_kernels_usable  # re-export
from roseinfer.model.sliding_window import WindowView


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


def write_kv_cache(kv_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """Store k, v [T, Hkv, Dh] into kv_cache [2, slots, Hkv, row] at slot_mapping [T]
    (an int8 cache: quantized rows with their scales, ``kv_int8``)."""
    kv_cache[0].index_copy_(0, slot_mapping, kv_int8.to_cache_rows(k, kv_cache.dtype))
    kv_cache[1].index_copy_(0, slot_mapping, kv_int8.to_cache_rows(v, kv_cache.dtype))


def _use_attention_kernel(q: Tensor, kv_cache: Tensor, softcap: float | None = None) -> bool:
    """True when the C++ paged-attention kernel can serve this call (not with a logit
    soft-cap, which it does not implement: those layers take the PyTorch path)."""
    if softcap is not None:
        return False
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.int8):
        return False
    from roseinfer.kernels import cpu_kernels_available

    return cpu_kernels_available()


def _attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None
) -> Tensor:
    """softmax(q k^T * scale [soft-capped], masked) v over the last two dims; mask is
    bool (True = visible) broadcastable to the scores, None = causal (square)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., n, L]
    scores = torch.tanh(scores / softcap) * softcap  # transformers' order (Gemma 2)
    if mask is None:
        n, keys = scores.shape[-2:]
        mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)  # [..., n, Dh]


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
    window: WindowView | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention over a paged KV cache; returns [T, H, Dh].

    q [T, H, Dh], k/v [T, Hkv, Dh] are this step's new tokens; kv_cache is
    [2, num_slots, Hkv, Dh] (int8: [2, num_slots, Hkv, Dh + 4], ``kv_int8``).  The new
    K/V are written to the cache first (unless the caller did: ``kv_written``).
    ``window``: a sliding-window layer's view of the step (None = full attention, or a
    window no token reaches); ``softcap``: attention-logit
    soft-capping ``tanh(s / cap) * cap`` (Gemma 2).  With the C++ kernels every row then
    attends through one kernel (batch-invariant; windows included, soft-capping not);
    the PyTorch fallback runs decode sequences (tokens 0..D-1) in one batched attention
    and prefill sequences one at a time with a causal mask offset by their cached
    prefix (fast, but its numerics depend on the batch shape).  An int8 cache is read
    back dequantized, the new tokens' K/V included, and the queries are quantized like
    its rows (``kv_int8.quantize_queries``), so every path attends to the same values.
    """
    if not kv_written:
        write_kv_cache(kv_cache, meta.slot_mapping, k, v)
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)  # [T, H, Dh]
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [slots, Hkv, Dh] each

    if _use_attention_kernel(q, kv_cache, softcap) and meta.token_seq is not None:
        # Every row alike (prefill and decode), straight from the paged cache: a row's
        # result never depends on the rest of the batch (docs/CONTRACTS.md).
        if window is not None:  # one row of window slots per token, read with block size 1
            slots, rows, lens = window.kernel_tables()
            return torch.ops.roseinfer.paged_attention(q, kv_cache, slots, rows, lens, 1, scale)
        return torch.ops.roseinfer.paged_attention(
            q, kv_cache, meta.block_tables, meta.token_seq, meta.token_context_lens,
            meta.block_size, scale,
        )  # [T, H, Dh]
    if kv_int8.is_int8(kv_cache):
        q = kv_int8.quantize_queries(q)  # [T, H, Dh]: int8 queries, as the kernels use
    d = meta.num_decode_tokens
    if d > 0:
        # GQA without repeating K/V: each KV head is a batch entry with G queries.
        qd = q[:d].view(d, num_kv_heads, group, head_dim)  # [D, Hkv, G, Dh]
        slots = meta.decode_slot_indices
        kd = kv_int8.read_rows(key_cache, slots, q.dtype)  # [D, Lmax, Hkv, Dh]
        vd = kv_int8.read_rows(value_cache, slots, q.dtype)  # [D, Lmax, Hkv, Dh]
        kd = kd.transpose(1, 2)  # [D, Hkv, Lmax, Dh]
        vd = vd.transpose(1, 2)  # [D, Hkv, Lmax, Dh]
        valid = meta.decode_mask if window is None else window.decode_mask()  # [D, Lmax]
        od = _attend(qd, kd, vd, valid[:, None, None, :], scale, softcap)  # [D, Hkv, G, Dh]
        out[:d] = od.reshape(d, num_heads, head_dim)  # [D, Hkv, G, Dh] -> [D, H, Dh]

    for j, p in enumerate(meta.prefills):
        s, e = p.query_start, p.query_end
        qp = q[s:e].transpose(0, 1)  # [H, n, Dh]
        if p.num_computed_tokens == 0 and not kv_int8.is_int8(kv_cache):
            kp = k[s:e].transpose(0, 1)  # [Hkv, n, Dh] (context == new tokens)
            vp = v[s:e].transpose(0, 1)  # [Hkv, n, Dh]
        else:
            slots = p.context_slot_indices
            kp = kv_int8.read_rows(key_cache, slots, q.dtype).transpose(0, 1)  # [Hkv, L, Dh]
            vp = kv_int8.read_rows(value_cache, slots, q.dtype).transpose(0, 1)  # [Hkv, L, Dh]
        if group > 1:  # whole heads: SDPA's fused CPU kernel (3-5x its GQA path here)
            kp = kp.repeat_interleave(group, dim=0)  # [H, L, Dh]
            vp = vp.repeat_interleave(group, dim=0)  # [H, L, Dh]
        mask = p.causal_mask if window is None else window.prefill_mask(j, p)  # [n, L] or None
        op = _attend(qp[None], kp[None], vp[None], mask, scale, softcap)[0]  # [H, n, Dh]
        out[s:e] = op.transpose(0, 1)  # [n, H, Dh]
    return out


class WeightLoadTracker:
    """Copies checkpoint tensors into a model's parameters and records what was filled.

    A parameter may be filled whole (shard ``""``) or in named row slices (fused
    ``qkv_proj`` / ``gate_up_proj``); ``finish`` raises naming every parameter (or
    shard) that was never loaded and every checkpoint name that matched nothing.
    ``on_module_loaded(path)``, when given, is called as soon as every parameter of the
    module at ``path`` is filled; when it returns True (it took the module, e.g. converted
    it to another format) the tracker drops its references to those parameters, so their
    memory can go before the rest of the checkpoint is read.
    """

    def __init__(self, model: nn.Module, shards: dict[str, set[str]] | None = None,
                 on_module_loaded: Callable[[str], bool] | None = None) -> None:
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        shards = shards or {}
        self.expected: dict[str, set[str]] = {n: shards.get(n, {""}) for n in self.params}
        self.loaded: dict[str, set[str]] = {n: set() for n in self.params}
        self.unknown: list[str] = []
        self.on_module_loaded = on_module_loaded
        self.module_params: dict[str, list[str]] = {}
        for name in self.params:
            self.module_params.setdefault(name.rpartition(".")[0], []).append(name)

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
        if self.on_module_loaded is not None:
            module = name.rpartition(".")[0]
            names = self.module_params[module]
            if (all(self.loaded[n] == self.expected[n] for n in names)
                    and self.on_module_loaded(module)):
                for n in names:
                    del self.params[n]

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
