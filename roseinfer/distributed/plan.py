"""How a model splits over N tensor-parallel ranks (Megatron-style), and each rank's part.

``make_plan(config, size, quantization)`` decides, before any process starts, what
each rank holds, or raises ``ValueError`` saying why the model cannot be split:

* attention: whole KV heads per rank, as evenly as possible, earlier ranks taking the
  extra ones (SmolLM2's 3 KV heads on 2 ranks: 2 + 1), each with the query heads of its
  group; with fewer KV heads than ranks (N a multiple of them) each KV head is
  replicated on N / Hkv ranks that share its group's query heads.  q/k/v (and their
  biases) are column-parallel; ``o_proj`` (GPT-2 ``attn.c_proj``) row-parallel on the
  same heads.
* MLP: gate/up (GPT-2 ``c_fc``) column-parallel, down (``mlp.c_proj``) row-parallel,
  over intermediate channels in units of 32 with int8 weights (their blocks run along
  the input dim: every row-parallel shard boundary stays on a multiple of 32, so each
  rank quantizes, or recovers Q4_1 from, exactly the blocks of the whole model).
* vocabulary: embedding rows and LM head rows (tied or not) split evenly.
* row-parallel biases: rank 0 holds them, the other ranks zeros (added once).

``RankShard`` is one rank's ranges; ``TensorParallelPlan.rank_config(r)`` the
``ModelConfig`` its model is built from (its heads, channels and vocabulary, the
unchanged model classes); ``part(r, name, shape)`` what it reads of a Hugging Face
checkpoint tensor (``loader.TensorPart``).  Supported: Llama, Mistral, Qwen2, Qwen3
(SmolLM is Llama) and GPT-2.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from roseinfer.model.config import ModelConfig
from roseinfer.model.loader import TensorPart

TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "GPT2LMHeadModel")
BLOCK = 32  # int8 / Q4_1 weights: one scale per 32 inputs of a row

Range = tuple[int, int]
_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.(.+)$")
_GPT2_LAYER = re.compile(r"^(?:transformer\.)?h\.\d+\.(.+)$")


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: [start, stop) ranges of the full model's dimensions."""

    rank: int
    q_heads: Range
    kv_heads: Range
    inter: Range  # intermediate (MLP) channels
    vocab: Range  # vocabulary rows of the embedding and LM head


def split_even(total: int, parts: int, unit: int = 1) -> list[Range]:
    """``total`` (a multiple of ``unit``) in ``parts`` contiguous ranges of whole units,
    as even as possible, earlier ranges one unit longer."""
    units = total // unit
    base, extra = divmod(units, parts)
    out, start = [], 0
    for i in range(parts):
        n = (base + (i < extra)) * unit
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class TensorParallelPlan:
    config: ModelConfig  # the whole model's
    size: int
    shards: tuple[RankShard, ...]

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        return tuple(s.vocab[1] - s.vocab[0] for s in self.shards)

    def rank_config(self, rank: int) -> ModelConfig:
        """The ``ModelConfig`` of rank ``rank``'s model."""
        s = self.shards[rank]
        return dataclasses.replace(
            self.config, num_heads=s.q_heads[1] - s.q_heads[0],
            num_kv_heads=s.kv_heads[1] - s.kv_heads[0],
            intermediate_size=s.inter[1] - s.inter[0], vocab_size=s.vocab[1] - s.vocab[0])

    def part(self, rank: int, name: str, shape: tuple[int, ...]) -> TensorPart | None:
        """Rank ``rank``'s part of checkpoint tensor ``name`` (None: all of it)."""
        s, dh = self.shards[rank], self.config.head_dim
        q = ((s.q_heads[0] * dh, s.q_heads[1] * dh),)
        kv = ((s.kv_heads[0] * dh, s.kv_heads[1] * dh),)
        if name in ("model.embed_tokens.weight", "lm_head.weight", "wte.weight",
                    "transformer.wte.weight"):
            return 0, (s.vocab,)
        if self.config.architecture == "GPT2LMHeadModel":
            layer = _GPT2_LAYER.match(name)
            if layer is None:
                return None
            hidden = self.config.hidden_size
            qkv = q + tuple((a + hidden, b + hidden) for a, b in kv) + tuple(
                (a + 2 * hidden, b + 2 * hidden) for a, b in kv)
            return {  # Conv1D weights are [in, out]
                "attn.c_attn.weight": (1, qkv), "attn.c_attn.bias": (0, qkv),
                "attn.c_proj.weight": (0, q),
                "mlp.c_fc.weight": (1, (s.inter,)), "mlp.c_fc.bias": (0, (s.inter,)),
                "mlp.c_proj.weight": (0, (s.inter,)),
            }.get(layer.group(1))
        layer = _LAYER.match(name)
        if layer is None:
            return None
        local = layer.group(1)
        module, _, kind = local.rpartition(".")
        if module == "self_attn.q_proj":
            return 0, q
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            return 0, kv
        if local == "self_attn.o_proj.weight":
            return 1, q
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return 0, (s.inter,)
        if local == "mlp.down_proj.weight":
            return 1, (s.inter,)
        return None

    def added_once(self, name: str) -> bool:
        """Whether ``name`` is a row-parallel bias (rank 0 adds it, the others zeros)."""
        return name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias",
                              "attn.c_proj.bias", "mlp.c_proj.bias"))

    def rank_weights(self, rank: int, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` (already cut by ``part``) with row-parallel biases zeroed off rank 0."""
        for name, tensor in weights:
            yield name, (torch.zeros_like(tensor) if rank and self.added_once(name) else tensor)


def make_plan(config: ModelConfig, size: int, quantization: str) -> TensorParallelPlan:
    """The split of ``config``'s model over ``size`` ranks; ``ValueError`` naming why not.

    ``quantization``: the resolved weight format; with ``"int8"`` every row-parallel
    shard must start and end on a multiple of 32 inputs."""
    why = f"tensor_parallel_size={size} cannot split {config.architecture}"
    if config.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor parallelism does not support {config.architecture} "
                         f"(supported: {', '.join(TP_ARCHITECTURES)})")
    unit = BLOCK if quantization == "int8" else 1
    kv_heads, q_heads = _head_split(config, size, why)
    dh = config.head_dim
    if unit > 1:
        for a, b in q_heads:
            if (a * dh) % unit or (b * dh) % unit:
                raise ValueError(
                    f"{why}: o_proj's input shard [{a * dh}, {b * dh}) (query heads "
                    f"{a}..{b - 1} x head_dim {dh}) is not on multiples of {unit}, which "
                    "int8 weights need (their blocks run along the input); use "
                    "quantization 'none' or 'fp16', or another tensor_parallel_size")
    inter = config.intermediate_size
    if inter % unit:
        raise ValueError(f"{why}: intermediate_size {inter} is not a multiple of {unit}, "
                         "which int8 weights need for down_proj's input shards")
    if inter // unit < size:
        raise ValueError(f"{why}: intermediate_size {inter} has fewer than {size} "
                         f"units of {unit} to share")
    if config.vocab_size < size:
        raise ValueError(f"{why}: vocab_size {config.vocab_size} < {size}")
    inters = split_even(inter, size, unit)
    vocabs = split_even(config.vocab_size, size)
    shards = tuple(RankShard(r, q_heads[r], kv_heads[r], inters[r], vocabs[r])
                   for r in range(size))
    return TensorParallelPlan(config, size, shards)


def _head_split(config: ModelConfig, size: int, why: str) -> tuple[list[Range], list[Range]]:
    """(KV head range, query head range) of every rank."""
    hkv, group = config.num_kv_heads, config.num_heads // config.num_kv_heads
    if hkv >= size:
        kv = split_even(hkv, size)
        return kv, [(a * group, b * group) for a, b in kv]
    if size % hkv:
        raise ValueError(f"{why}: it has {hkv} KV heads, fewer than the ranks, so each KV "
                         f"head must be replicated on the same number of ranks "
                         f"(tensor_parallel_size a multiple of {hkv})")
    replicas = size // hkv
    if group < replicas:
        raise ValueError(f"{why}: each of its {hkv} KV heads has {group} query heads, "
                         f"fewer than the {replicas} ranks that would share it")
    kv_ranges, q_ranges = [], []
    for r in range(size):
        head, j = divmod(r, replicas)
        a, b = split_even(group, replicas)[j]
        kv_ranges.append((head, head + 1))
        q_ranges.append((head * group + a, head * group + b))
    return kv_ranges, q_ranges
