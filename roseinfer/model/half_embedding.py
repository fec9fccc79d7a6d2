"""Embeddings kept in a 16-bit checkpoint's dtype: a step casts only its tokens' rows.

A bf16 / fp16 safetensors checkpoint run with float32 activations (the CPU default)
would otherwise hold its embedding matrix in fp32, twice its size (a 128k x 2048
vocabulary: 1 GB instead of 0.5 GB). ``HalfEmbedding`` keeps the checkpoint's values
as stored and returns the gathered rows in the activation dtype; bf16 and fp16 widen
to fp32 exactly, so the model is bitwise the one an fp32 copy would give. A tied LM
head is converted from the same 16-bit matrix (``quantize_model``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.model.quantize import set_module


class HalfEmbedding(nn.Embedding):
    """ids [T] -> rows [T, hidden] in ``out_dtype`` of a matrix stored in 16 bits."""

    def __init__(self, weight: Tensor, out_dtype: torch.dtype) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.out_dtype = out_dtype

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stored {self.weight.dtype}, rows as {self.out_dtype}"


def keep_embeddings_in(model: nn.Module, dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Replace every plain ``nn.Embedding`` of ``model`` (meta or real) by a
    ``HalfEmbedding`` storing ``dtype`` and returning ``out_dtype`` rows."""
    for path, module in list(model.named_modules()):
        if type(module) is nn.Embedding:
            set_module(model, path, HalfEmbedding(module.weight.detach().to(dtype), out_dtype))


def match_stored_embeddings(model: nn.Module, params: dict[str, Tensor],
                            out_dtype: torch.dtype) -> None:
    """For a model rebuilt from stored weights (the weight cache): each plain embedding
    whose stored matrix is 16-bit becomes a ``HalfEmbedding`` of that dtype."""
    for path, module in list(model.named_modules()):
        stored = params.get(f"{path}.weight")
        if (type(module) is nn.Embedding and stored is not None
                and stored.dtype in (torch.bfloat16, torch.float16)
                and module.weight.dtype != stored.dtype):
            set_module(model, path, HalfEmbedding(module.weight.detach().to(stored.dtype),
                                                  out_dtype))
