"""Whether the C++ row kernels (``roseinfer.kernels``: norms, rotary, attention) can
serve a tensor. Shared by ``layers``, ``rope`` and the model files, below all of them."""

from __future__ import annotations

import torch
from torch import Tensor

from roseinfer import kernels


def row_kernels_usable(x: Tensor) -> bool:
    """True when the C++ row kernels (``roseinfer.kernels``) can serve ops on x: a float32
    CPU tensor and a loaded kernel library."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    return kernels.cpu_kernels_available()  # looked up per call: tests may turn it off
