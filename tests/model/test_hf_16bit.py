"""A bf16 / fp16 safetensors checkpoint converted to the default int8 format keeps its
linear weights in their dtype until each layer is converted (``factory._linear_storage``):
no fp32 copy of the model, and bitwise the model an fp32 copy of the same values gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest_loader import tiny_llama  # noqa: E402
from family_helpers import random_tokens, run_schedule, schedule_for  # noqa: E402

from roseinfer.kernels import cpu_kernels_available  # noqa: E402
from roseinfer.model import factory  # noqa: E402
from roseinfer.model.loader import load_checkpoint  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.skipif(not cpu_kernels_available(), reason="int8 layers need the C++ kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_linears_stay_16bit_and_convert_as_fp32_would(tmp_path: Path,
                                                             dtype: torch.dtype) -> None:
    hf = tiny_llama(tie=False, hidden_size=128, intermediate_size=256)
    hf.to(dtype).save_pretrained(tmp_path / "half")
    hf.float().save_pretrained(tmp_path / "full")  # the same (16-bit) values in fp32
    ckpt, linear_dtype = factory._linear_storage(load_checkpoint(tmp_path / "half"),
                                                 torch.float32, CPU, "int8")
    assert linear_dtype == dtype
    loaded = factory._load(ckpt, torch.float32, CPU, linear_dtype)
    assert loaded.model.layers[0].mlp.gate_up_proj.weight.dtype == dtype
    assert loaded.model.norm.weight.dtype == torch.float32
    assert loaded.model.embed_tokens.weight.dtype == dtype  # no fp32 copy of the vocabulary
    assert factory._linear_storage(load_checkpoint(tmp_path / "full"), torch.float32, CPU,
                                   "int8")[1] is None
    assert factory._linear_storage(load_checkpoint(tmp_path / "half"), torch.float32, CPU,
                                   "fp16")[1] is None
    half = factory.load_model(tmp_path / "half", torch.float32, CPU, "int8", False)[0]
    full = factory.load_model(tmp_path / "full", torch.float32, CPU, "int8", False)[0]
    tokens = random_tokens(256, [11, 7])
    schedule = schedule_for([[6, 4, 1], [6, 1]], [0, 1])
    for a, b in zip(run_schedule(half, tokens, schedule), run_schedule(full, tokens, schedule),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not cpu_kernels_available(), reason="int8 layers need the C++ kernels")
@pytest.mark.usefixtures("private_cache_dir")  # tests/conftest.py
def test_16bit_embedding_stays_16bit_through_the_weight_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tiny_llama(tie=True, hidden_size=128, intermediate_size=256)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "half")
    first = factory.load_model(tmp_path / "half", torch.float32, CPU, "int8", True)[0]

    def no_conversion(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the warm start converted again: the cache entry was refused")

    monkeypatch.setattr(factory, "_load", no_conversion)
    warm = factory.load_model(tmp_path / "half", torch.float32, CPU, "int8", True)[0]
    for model in (first, warm):
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    tokens = random_tokens(256, [9, 5])
    schedule = schedule_for([[5, 4], [5]], [0, 1])
    for a, b in zip(run_schedule(first, tokens, schedule), run_schedule(warm, tokens, schedule),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not cpu_kernels_available(), reason="int8 layers need the C++ kernels")
@pytest.mark.parametrize("quantization", ["int8", "q4_0"])
def test_layers_convert_as_they_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     quantization: str) -> None:
    """Each linear layer is converted as soon as the checkpoint filled it (not after the
    whole model is in memory), giving bitwise the model that converting after the load
    gives."""
    from roseinfer.model.quantize import quantize_model

    tiny_llama(tie=False, hidden_size=128, intermediate_size=256).to(
        torch.bfloat16).save_pretrained(tmp_path / "half")
    ckpt, linear_dtype = factory._linear_storage(load_checkpoint(tmp_path / "half"),
                                                 torch.float32, CPU, quantization)
    after = quantize_model(factory._load(ckpt, torch.float32, CPU, linear_dtype), quantization)
    events: list[str] = []
    real = factory.converter_as_loaded

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        convert = real(*args, **kwargs)
        return lambda path: events.append(f"convert {path}") or convert(path)

    def counted(weights):  # noqa: ANN001, ANN202
        for item in weights:
            events.append("tensor")
            yield item

    monkeypatch.setattr(factory, "converter_as_loaded", recording)
    monkeypatch.setattr(factory, "progress", lambda items, label, *a, **k:
                        counted(items) if label.startswith("loading") else iter(items))
    streamed = factory.load_model(tmp_path / "half", torch.float32, CPU, quantization, False)[0]
    first = events.index("convert model.layers.0.self_attn.qkv_proj")
    assert "tensor" in events[first:] and events.count("convert lm_head") == 1
    tokens = random_tokens(256, [9])
    schedule = schedule_for([[9]], [0])
    assert torch.equal(run_schedule(streamed, tokens, schedule)[0],
                       run_schedule(after, tokens, schedule)[0])


def test_safetensors_pages_go_with_each_tensor(tmp_path: Path) -> None:
    """The loader reads every tensor through a handle of its own, so the file pages of the
    tensors already handed on are unmapped (one handle for the file kept every page read
    so far in RSS until the file's end: a 1B bf16 checkpoint's 2.1 GB)."""
    from safetensors.torch import save_file

    from roseinfer.model.loader import _iter_safetensors

    tensors = {f"t{i}": torch.full((1024, 1024), float(i)) for i in range(6)}  # 4 MiB each
    save_file(tensors, str(tmp_path / "m.safetensors"))

    def rss_file_mib() -> float:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("RssFile:"))
        return int(line.split()[1]) / 1024

    base = rss_file_mib()
    grown = []
    for name, tensor in _iter_safetensors([(tmp_path / "m.safetensors", None)]):
        assert torch.equal(tensor, tensors[name])  # touches every page
        grown.append(rss_file_mib() - base)
    assert len(grown) == 6
    assert grown[-1] < 12, grown  # about one tensor's 4 MiB mapped, not all 24
