"""load_model: checkpoint on disk -> ready model on the chosen device and dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from roseinfer.model.config import ModelConfig
from roseinfer.model.loader import load_checkpoint
from roseinfer.model.registry import create_model


def load_model(
    model: str | Path | None, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, ModelConfig, Path]:
    """Load weights (HF dir, GGUF or .pt; None = default model); return (model, config, source)."""
    ckpt = load_checkpoint(model)
    net = create_model(ckpt.config, dtype, device)
    net.load_weights(ckpt.weights)
    net.eval()
    return net, ckpt.config, ckpt.source
