"""GGUF LoRA adapters (llama.cpp's convert_lora_to_gguf layout, written here with the
gguf package): the same logits as the PEFT adapter they were converted from, and a
base model mismatch refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.lora import LoRARequest
from tests.engine.invariance_helpers import cpu_kernels, make_engine, tiny_gqa_llama
from tests.lora.lora_helpers import make_adapter, run_jobs

gguf = pytest.importorskip("gguf")
PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
HEADS, KV_HEADS = 4, 2


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of Q/K rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def peft_to_gguf(peft_dir: Path, out: Path, alpha: float, arch: str = "llama") -> str:
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")  # base_model.model.model.layers.N.block.module.lora_X.weight
        layer, module, which = parts[4], parts[6], parts[7][-1].lower()
        values = tensor.float().numpy()
        if which == "b" and module in ("q_proj", "k_proj"):
            values = permute(values, HEADS if module == "q_proj" else KV_HEADS)
        writer.add_tensor(f"blk.{layer}.{PARTS[module]}.weight.lora_{which}",
                          np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)


def test_gguf_adapter_equals_its_peft_source(tmp_path: Path) -> None:
    make_adapter(tmp_path / "peft", seed=5, r=8, alpha=16)
    path = peft_to_gguf(tmp_path / "peft", tmp_path / "lora.gguf", alpha=16)
    with cpu_kernels(True):
        engine = make_engine(tiny_gqa_llama(0), "none", enable_lora=True)
        prompt = list(range(7, 40))
        peft = run_jobs(engine, [("p", prompt, 4, LoRARequest("p", 1, str(tmp_path / "peft")))])
        from_gguf = run_jobs(engine, [("g", prompt, 4, LoRARequest("g", 2, path))])
        base = run_jobs(engine, [("b", prompt, 4, None)])
    assert from_gguf[0]["g"] == peft[0]["p"]
    for w, g in zip(peft[1]["p"], from_gguf[1]["g"], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert not torch.equal(base[1]["b"][0], peft[1]["p"][0])


def test_gguf_adapter_of_another_architecture_refused(tmp_path: Path) -> None:
    make_adapter(tmp_path / "peft", seed=6, r=8, alpha=16)
    path = peft_to_gguf(tmp_path / "peft", tmp_path / "qwen.gguf", alpha=16, arch="qwen2")
    engine = make_engine(tiny_gqa_llama(0), "none", enable_lora=True)
    with pytest.raises(InvalidRequestError, match="base model mismatch"):
        engine.add_request("x", [5, 6, 7], lora_request=LoRARequest("q", 1, path))
