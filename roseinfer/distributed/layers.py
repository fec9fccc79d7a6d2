"""The collectives inside a rank's model: row-parallel projections and the vocab-parallel
embedding.  ``parallelize`` swaps them into a loaded (and converted) shard.

A rank's model is the unchanged model class built from its ``rank_config`` (fewer
heads, channels and vocabulary rows), so column-parallel layers need nothing: they
simply have fewer outputs.  What crosses ranks:

* ``RowParallel`` wraps ``o_proj`` / ``down_proj`` (GPT-2: both ``c_proj``): the wrapped
  layer (plain, fp16 or int8 kernel: anything ``quantize_model`` made) computes this
  rank's partial sum over its input shard; one all-reduce per layer adds them (the bias
  is rank 0's alone: ``plan.added_once``).
* ``VocabParallelEmbedding``: ids outside this rank's rows give zeros; the all-reduce
  then holds every id's row exactly (x + 0 == x).
* the LM head is left alone: ``compute_logits`` returns this rank's vocabulary columns
  and the step executor gathers them on rank 0 (``Communicator.gather_columns``).

The model gets ``tensor_parallel = (rank, size)``, which keeps it off the C++ decoder
stack (``fast_path.stack_unsupported_reason``: the stack cannot call collectives); its
layers still run the C++ kernels one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.distributed.comm import Communicator
from roseinfer.distributed.plan import RankShard
from roseinfer.model.quantize import set_module

_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj", "attn.c_proj", "mlp.c_proj")


class RowParallel(nn.Module):
    """A projection over this rank's input shard, partial sums all-reduced."""

    def __init__(self, inner: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.inner = inner
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:  # [T, in / N] -> [T, out]
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + n)`` of the embedding; the full lookup via an all-reduce."""

    def __init__(self, weight: Tensor, start: int, comm: Communicator,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.start = start
        self.comm = comm
        self.out_dtype = out_dtype or weight.dtype  # a 16-bit matrix's rows, widened

    def forward(self, input_ids: Tensor) -> Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.start  # [T]
        inside = (local >= 0) & (local < self.num_embeddings)  # [T]
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # [T, hidden]
        rows = rows.to(self.out_dtype)
        return self.comm.all_reduce(rows.masked_fill(~inside.unsqueeze(1), 0.0))


@torch.no_grad()
def parallelize(model: nn.Module, shard: RankShard, comm: Communicator) -> nn.Module:
    """Swap the collectives into rank ``shard.rank``'s loaded model, in place."""
    for path, module in list(model.named_modules()):
        if path.endswith(_ROW_PARALLEL) and not isinstance(module, RowParallel):
            set_module(model, path, RowParallel(module, comm))
    if hasattr(model, "transformer"):  # GPT-2
        path, embedding = "transformer.wte", model.transformer.wte
    else:
        path, embedding = "model.embed_tokens", model.model.embed_tokens
    set_module(model, path, VocabParallelEmbedding(embedding.weight, shard.vocab[0], comm,
                                                   getattr(embedding, "out_dtype", None)))
    model.tensor_parallel = (comm.rank, comm.size)
    if hasattr(model, "_stack_state"):  # rebuilt on first use, now without the stack
        model._stack, model._stack_state = None, "unbuilt"
    return model
