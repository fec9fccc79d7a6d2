"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder with fused checkpoints.

Differences from Llama, all but the first config-driven:

* the checkpoint stores ``self_attn.qkv_proj`` (q, k, v rows) and ``mlp.gate_up_proj``
  (gate rows, then up) already fused — our own layout, loaded as is;
* ``longrope`` rope scaling (short/long factors, attention factor; see ``rope``);
* ``partial_rotary_factor`` (Phi-4-mini: 0.75 of each head is rotated), which the C++
  decoder stack and fused rotary do not do: such models rotate in PyTorch;
* ``sliding_window`` (Phi-3-mini-4k: 2047) on every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import Tensor

from roseinfer.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family causal LM (fused ``qkv_proj`` / ``gate_up_proj`` checkpoints)."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]],
                     on_module_loaded: Callable[[str], bool] | None = None) -> None:
        """Load Hugging Face Phi-3 tensors (fused or, as other loaders give, split)."""
        super().load_weights(self._split_fused(weights), on_module_loaded)

    def _split_fused(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Fused checkpoint tensors as the q/k/v and gate/up pieces the loader fuses."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, tensor in weights:
            stem, _, kind = name.rpartition(".")
            if stem.endswith(".qkv_proj"):
                base = stem.removesuffix("qkv_proj")
                q_t, k_t, v_t = tensor.split([q, kv, kv], dim=0)
                yield f"{base}q_proj.{kind}", q_t
                yield f"{base}k_proj.{kind}", k_t
                yield f"{base}v_proj.{kind}", v_t
            elif stem.endswith(".gate_up_proj"):
                base = stem.removesuffix("gate_up_proj")
                gate, up = tensor.chunk(2, dim=0)
                yield f"{base}gate_proj.{kind}", gate
                yield f"{base}up_proj.{kind}", up
            else:
                yield name, tensor
