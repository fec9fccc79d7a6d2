"""GGUF LoRA adapters: llama.cpp's ``convert_lora_to_gguf.py`` output, read with the
``gguf`` package and turned into what a PEFT adapter gives (``adapter.AdapterSpec`` +
``(A [r, in], B [out, r], scaling)`` per module).

The file says ``general.type = "adapter"``, ``adapter.type = "lora"``,
``adapter.lora.alpha``; its tensors are ``blk.N.<part>.weight.lora_a`` ([r, in]) and
``.lora_b`` ([out, r]) for the parts ``attn_q attn_k attn_v attn_output ffn_gate ffn_up
ffn_down``, of any type ``gguf`` dequantizes.  Scaling is llama.cpp's: ``alpha / r``
(1 when alpha is 0).  llama.cpp permutes a ``llama`` model's Q/K rows, so the B of
``attn_q`` / ``attn_k`` is unpermuted as the model loader does.  ``general.architecture``
must match the base model's (else a "base model mismatch" ``ValueError``); every other
check is the PEFT one (shapes, layers, rank).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from roseinfer.lora.adapter import AdapterSpec, ModuleSpec, module_shapes
from roseinfer.model.config import ModelConfig
from roseinfer.model.gguf_arch import unpermute_qk

PARTS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
         "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# HF architecture -> the general.architecture names llama.cpp writes for it.
GGUF_ARCHS = {"LlamaForCausalLM": ("llama",), "MistralForCausalLM": ("llama",),
              "Qwen2ForCausalLM": ("qwen2",), "Qwen3ForCausalLM": ("qwen3",)}


def _field(reader: object, key: str) -> object:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return None if field is None else field.contents()


def _open(path: str) -> object:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same answer
        raise ValueError(f"LoRA adapter {path!r}: not a readable GGUF file: {exc}") from None


def _tensors(path: str, reader: object) -> dict[tuple[int, str, str], object]:
    out = {}
    for t in reader.tensors:  # type: ignore[attr-defined]
        parts = t.name.split(".")
        if (len(parts) != 5 or parts[0] != "blk" or not parts[1].isdigit()
                or parts[3] != "weight" or parts[4] not in ("lora_a", "lora_b")):
            raise ValueError(f"LoRA adapter {path!r}: tensor {t.name!r} is not a LoRA A/B "
                             f"weight of a decoder layer's {sorted(PARTS)}")
        if parts[2] not in PARTS:
            raise ValueError(f"LoRA adapter {path!r}: tensor {t.name!r}: target module "
                             f"{parts[2]} is not in the model (adaptable: {sorted(PARTS)})")
        out[(int(parts[1]), PARTS[parts[2]], parts[4][-1].upper())] = t
    return out


def inspect_gguf_adapter(path: str, config: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Check a GGUF LoRA against the base model (see the module docstring)."""
    if not os.path.isfile(path):
        raise ValueError(f"LoRA adapter {path!r}: no such file")
    reader = _open(path)

    def bad(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {path!r}: {why}")

    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise bad("not a GGUF LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    arch = _field(reader, "general.architecture")
    allowed = GGUF_ARCHS.get(config.architecture, ())
    if arch not in allowed:
        raise bad(f"general.architecture {arch!r} is not the base model's "
                  f"({config.architecture}: {list(allowed)}): base model mismatch")
    alpha = _field(reader, "adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or alpha < 0:
        raise bad(f"adapter.lora.alpha must be a number >= 0, got {alpha!r}")
    tensors = _tensors(path, reader)
    expected = module_shapes(config)
    modules = []
    for (layer, module, which) in sorted(tensors):
        if which != "A":
            continue
        b = tensors.get((layer, module, "B"))
        name = f"blk.{layer}.{module}"
        if b is None:
            raise bad(f"{name}: lora_b weight is missing")
        if layer >= config.num_layers:
            raise bad(f"{name}: layer {layer} is beyond the base model's {config.num_layers} "
                      "layers (base model mismatch?)")
        (ra, ka) = tuple(int(d) for d in reversed(tensors[(layer, module, "A")].shape))
        (nb, rb) = tuple(int(d) for d in reversed(b.shape))
        out_f, in_f = expected[module]
        if ka != in_f or nb != out_f or ra != rb:
            raise bad(f"{name}: lora_a [{ra}, {ka}] / lora_b [{nb}, {rb}] do not fit the base "
                      f"model's {module} ({out_f} x {in_f}): base model mismatch")
        if ra > max_lora_rank:
            raise bad(f"{name}: rank {ra} is above max_lora_rank {max_lora_rank}")
        modules.append(ModuleSpec(layer, module, ra, float(alpha) / ra if alpha else 1.0))
    if len(modules) * 2 != len(tensors):
        raise bad("a lora_b weight has no lora_a")
    if not modules:
        raise bad("holds no LoRA weights")
    return AdapterSpec(path, path, tuple(modules), max(m.rank for m in modules),
                       _field(reader, "general.name"))  # type: ignore[arg-type]


def read_gguf_adapter(spec: AdapterSpec, config: ModelConfig
                      ) -> dict[tuple[int, str], tuple[Tensor, Tensor, float]]:
    """The checked GGUF adapter's (layer, module) -> (A, B, scaling) in HF orientation."""
    from gguf.quants import dequantize

    reader = _open(spec.path)
    tensors = _tensors(spec.path, reader)
    permuted = _field(reader, "general.architecture") == "llama"
    out = {}
    for m in spec.modules:
        pair = []
        for which in ("A", "B"):
            t = tensors[(m.layer, m.module, which)]
            values = dequantize(t.data, t.tensor_type)
            pair.append(torch.from_numpy(values.reshape(tuple(reversed(
                [int(d) for d in t.shape]))).astype("float32", copy=True)))
        a, b = pair
        if permuted and m.module in ("q_proj", "k_proj"):
            b = unpermute_qk(b, config.num_heads if m.module == "q_proj" else config.num_kv_heads)
        out[(m.layer, m.module)] = (a, b, m.scaling)
    return out
