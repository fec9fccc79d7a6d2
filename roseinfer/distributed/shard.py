"""Load one rank's shard of a checkpoint: its parts of the tensors, never the whole model.

The rank's model is the registry's class built from ``plan.rank_config(rank)``; the
checkpoint is read through ``plan.part`` (safetensors: only those slices are read;
GGUF and ``.pt``: one tensor at a time, cut), row-parallel biases are zeroed off rank 0,
then ``load_weights`` fuses q/k/v and gate/up as usual and ``quantize_model`` converts
the shard (int8 blocks and Q4_1 recovery see exactly the whole model's blocks: the
plan keeps row-parallel boundaries on multiples of 32).  The weight cache is not used:
every rank converts its shard at each start (the default model: ~2 s).
"""

from __future__ import annotations

import torch
from torch import nn

from roseinfer.distributed.plan import TensorParallelPlan
from roseinfer.model.loader import load_checkpoint
from roseinfer.model.quantize import quantize_model
from roseinfer.model.registry import create_model


def load_shard(model: str | None, plan: TensorParallelPlan, rank: int, dtype: torch.dtype,
               device: torch.device, quantization: str) -> nn.Module:
    """Rank ``rank``'s model (eval mode, converted to ``quantization``), without the
    collectives yet (``layers.parallelize`` adds them once the group exists)."""
    ckpt = load_checkpoint(model, lambda name, shape: plan.part(rank, name, shape))
    net = create_model(plan.rank_config(rank), dtype, device)
    net.load_weights(plan.rank_weights(rank, ckpt.weights))
    quantize_model(net, quantization)
    return net.eval()
