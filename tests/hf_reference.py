"""Reference greedy decoding with HF transformers (no EOS handling, no suppression)."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Exactly n argmax tokens from an HF causal LM, using its KV cache."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens
