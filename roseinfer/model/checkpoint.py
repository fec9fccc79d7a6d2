"""Checkpoint: what every loader returns (a ModelConfig plus lazily produced HF-named
weights), and the selector type of tensor parallelism. Below ``loader`` (which picks a
loader by path) and every format's loader (``gguf_loader``, ...), so they share it
without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from roseinfer.model.config import ModelConfig

# A part of a checkpoint tensor: (dim, ((start, stop), ...)) = those ranges along dim,
# concatenated in order.  A selector maps (HF name, full shape) to a part, or None for
# the whole tensor.
TensorPart = tuple[int, tuple[tuple[int, int], ...]]
Selector = Callable[[str, tuple[int, ...]], TensorPart | None]


@dataclass
class Checkpoint:
    """A model checkpoint: config, lazily produced (HF name, tensor) pairs, tokenizer source."""

    config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]]
    source: Path  # the file/dir the tokenizer should load from
    num_tensors: int | None = None  # how many pairs ``weights`` yields, when known cheaply
