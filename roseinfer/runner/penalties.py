"""Repetition, presence and frequency penalties over a batch of logits (the sampler's
step 2-3: ``sampler.py`` has the whole order)."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_penalties(
    logits: Tensor,
    seen_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """Repetition (HF, prompt+output) then presence/frequency (OpenAI, output).

    logits [B, V]; seen_mask [B, V] bool; output_counts [B, V] float;
    penalties [B]. Returns a new [B, V] tensor.
    """
    rep = torch.where(seen_mask, repetition_penalty.unsqueeze(1), 1.0)  # [B, V]
    x = torch.where(logits > 0, logits / rep, logits * rep)
    x = x - frequency_penalty.unsqueeze(1) * output_counts
    return x - presence_penalty.unsqueeze(1) * (output_counts > 0).to(x.dtype)
