"""build_runner: an ``EngineConfig`` (or a given model) -> the runner that executes steps.

One process (``tensor_parallel_size`` 1): the model is loaded through the weight cache
and converted (``model.factory.load_model``), or a given model object is converted,
and a ``ModelRunner`` owns it with the KV pool.  Several: a ``TensorParallelRunner``
(``roseinfer.distributed``) loads shard 0, spawns the other ranks and owns them; each
rank reads its own shard of ``config.model``, so a model object cannot be given.
Either way the runner has ``execute``, ``num_blocks``, ``failure`` and ``shutdown``.
With ``kv_cache_dir`` the weights' identity is returned too (``Weights``: the
checkpoint's path, or a digest of a given model's tensors taken before conversion),
for the disk cache's model identity (``roseinfer.kvcache.identity``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from roseinfer.config import EngineConfig
from roseinfer.kvcache.identity import weights_digest
from roseinfer.model.config import ModelConfig
from roseinfer.runner.model_runner import ModelRunner, num_kv_blocks
from roseinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from roseinfer.distributed.runner import TensorParallelRunner

Weights = Path | str | None  # checkpoint path, digest of a given model, or None (unknown)


def build_runner(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, quantization: str,
    kv_dtype: torch.dtype, model: nn.Module | None, model_config: ModelConfig | None,
    tokenizer: Tokenizer | None,
) -> tuple[ModelRunner | TensorParallelRunner, ModelConfig, Tokenizer | None, Weights]:
    """(runner, the whole model's config, tokenizer: the given one or the model's, the
    weights' identity: only with ``kv_cache_dir``)."""
    if config.tensor_parallel_size > 1:
        if model is not None:
            raise ValueError("tensor_parallel_size > 1 loads each rank's shard from "
                             "EngineConfig.model: a model object cannot be given")
        from roseinfer.distributed.runner import TensorParallelRunner

        runner = TensorParallelRunner.start(config, device, dtype, quantization, kv_dtype)
        try:
            tokenizer = tokenizer or Tokenizer.from_model_path(runner.source,
                                                               config.weight_cache)
        except BaseException:
            runner.shutdown()
            raise
        return runner, runner.config, tokenizer, None
    weights: Weights = None
    if model is None:
        from roseinfer.model.factory import load_model

        # Converted to ``quantization``, through the weight cache (docs/performance.md, Startup).
        model, model_config, source = load_model(
            config.model, dtype, device, quantization, config.weight_cache,
            requantize_16bit=config.requantize_16bit_gguf())
        tokenizer = tokenizer or Tokenizer.from_model_path(source, config.weight_cache)
        weights = Path(source)
    elif model_config is None:
        raise ValueError("model_config is required when a model object is given")
    elif config.kv_cache_dir is not None:
        weights = weights_digest(model)  # before any conversion: the given weights
    assert model_config is not None
    if quantization != "none":
        from roseinfer.model.quantize import quantize_model

        quantize_model(model, quantization)  # no-op when load_model converted it
    num_blocks = num_kv_blocks(config, model_config, kv_dtype, device=device)
    runner = ModelRunner(model, model_config, num_blocks, config.block_size, kv_dtype, device)
    return runner, model_config, tokenizer, weights
