"""The C++ segmented LoRA kernel (csrc/lora.h): deltas equal the PyTorch path's, the
AVX2 and portable paths are bitwise equal, a row's result depends only on its own
adapter and values (not on its segment's size or place), and ``lora_fill`` lays an
adapter out bitwise as the PyTorch fill does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from roseinfer.lora import LoRARequest
from roseinfer.lora.weights import FUSED, LINEAR_INDEX, build_adapter
from tests.engine.invariance_helpers import cpu_kernels, make_engine, tiny_gqa_llama

PREFIX = "base_model.model.model.layers"
PARTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
         "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _step(segments: list[tuple[int, int, object]], portable: bool) -> object:
    step = torch.classes.roseinfer.LoraStep(portable)
    for start, end, kernel in segments:
        step.add(start, end, kernel)
    return step


def _apply(segments: list[tuple[int, int, object]], layer: int, which: int, x: torch.Tensor,
           y0: torch.Tensor, portable: bool = False) -> torch.Tensor:
    y = y0.clone()
    _step(segments, portable).apply(layer, which, x, y)
    return y


def _check_rows_alone(segments: list[tuple[int, int, object]], layer: int, which: int,
                      x: torch.Tensor, y0: torch.Tensor, mixed: torch.Tensor) -> None:
    """Each adapted row alone (one-row step) and each segment alone at row 0: bitwise
    the mixed step's rows."""
    for start, end, kernel in segments:
        alone = _apply([(0, end - start, kernel)], layer, which, x[start:end], y0[start:end])
        assert torch.equal(alone, mixed[start:end])
        for row in range(start, end):
            one = _apply([(0, 1, kernel)], layer, which, x[row:row + 1], y0[row:row + 1])
            assert torch.equal(one[0], mixed[row])


@pytest.mark.parametrize("k, n", [(45, 37), (64, 40)])
def test_kernel_odd_shapes(k: int, n: int) -> None:
    """Hand-made plans whose K and part widths hit every tail (K % 32, K % 8, 16/8/1
    columns): the kernel equals the float64 reference, SIMD == portable bitwise, rows
    are invariant to their segment."""
    with cpu_kernels(True):
        gen = torch.Generator().manual_seed(k)
        kernels = []
        refs = []
        for rank in (3, 9):  # two parts: columns [0, 13) and [13, n), ranks 1 + (rank - 1)
            r = rank
            a = torch.randn(r, k, generator=gen)
            bt0 = torch.randn(1, 13, generator=gen)
            bt1 = torch.randn(r - 1, n - 13, generator=gen)
            buffer = torch.cat([a.flatten(), bt0.flatten(), bt1.flatten()])
            b0, b1 = r * k, r * k + 13
            plan = torch.tensor([[0, 1, 0, r, k, n, 0, 1, 0, 13, b0],
                                 [0, 1, 0, r, k, n, 1, r, 13, n, b1]])
            kernels.append(torch.classes.roseinfer.LoraAdapter(buffer, plan, 1))
            refs.append((a, bt0, bt1))
        x = torch.randn(11, k, generator=gen)
        y0 = torch.randn(11, n, generator=gen)
        segments = [(2, 7, kernels[0]), (7, 8, kernels[1]), (8, 11, kernels[0])]
        mixed = _apply(segments, 0, 1, x, y0)
        assert torch.equal(mixed, _apply(segments, 0, 1, x, y0, portable=True))
        assert torch.equal(mixed[:2], y0[:2])  # base rows untouched
        want = y0.double().clone()
        for (start, end, _), i in zip(segments, (0, 1, 0), strict=True):
            a, bt0, bt1 = (t.double() for t in refs[i])
            t = x[start:end].double() @ a.T
            want[start:end, :13] += t[:, :1] @ bt0
            want[start:end, 13:] += t[:, 1:] @ bt1
        torch.testing.assert_close(mixed.double(), want, atol=1e-4, rtol=1e-5)
        _check_rows_alone(segments, 0, 1, x, y0, mixed)


def _write(path: Path, seed: int, r: int, targets: list[str], dtype: torch.dtype) -> None:
    """A random PEFT adapter over tiny_gqa_llama (hidden 256, q 256, k/v 128, inter 512)."""
    shapes = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256),
              "o_proj": (256, 256), "gate_proj": (512, 256), "up_proj": (512, 256),
              "down_proj": (256, 512)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for m in targets:
            out_f, in_f = shapes[m]
            key = f"{PREFIX}.{layer}.{PARTS[m]}.{m}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, in_f, generator=gen) * 0.1).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, r, generator=gen) * 0.1).to(dtype)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 3 * r, "target_modules": targets,
        "base_model_name_or_path": "tiny"}))


def test_kernel_matches_pytorch_path(tmp_path: Path) -> None:
    """Real adapters (all modules r 8 fp32; q/v/down r 4 fp16: parts with gaps):
    lora_fill == the PyTorch fill bitwise, the kernel's deltas == the PyTorch path's
    within fp32 tolerance, SIMD == portable, rows invariant, base rows untouched."""
    with cpu_kernels(True):
        engine = make_engine(tiny_gqa_llama(0), "none", enable_lora=True)
        manager = engine.lora.manager
        _write(tmp_path / "all", 1, 8, list(PARTS), torch.float32)
        _write(tmp_path / "qvd", 2, 4, ["q_proj", "v_proj", "down_proj"], torch.float16)
        kern, ref = [], []
        for i, name in enumerate(("all", "qvd"), start=1):
            spec = manager.check(LoRARequest(name, i, str(tmp_path / name)))
            kern.append(build_adapter(i, name, spec, manager.config, True))
            ref.append(build_adapter(i, name, spec, manager.config, False))
            assert torch.equal(kern[-1].buffer, ref[-1].buffer)
        gen = torch.Generator().manual_seed(0)
        widths = {"qkv": (256, 512), "o": (256, 256), "gate_up": (256, 1024), "down": (512, 256)}
        segments = [(1, 4, kern[0].kernel), (4, 9, kern[1].kernel), (9, 10, kern[0].kernel)]
        for layer in range(2):
            for name in FUSED:
                k, n = widths[name]
                x = torch.randn(10, k, generator=gen)
                y0 = torch.randn(10, n, generator=gen)
                which = LINEAR_INDEX[name]
                mixed = _apply(segments, layer, which, x, y0)
                assert torch.equal(mixed, _apply(segments, layer, which, x, y0, portable=True))
                want = y0.clone()
                for (start, end, _), i in zip(segments, (0, 1, 0), strict=True):
                    low_rank = ref[i].layers[layer].get(name)
                    if low_rank is not None:
                        low_rank.add_delta(x[start:end], want[start:end])
                torch.testing.assert_close(mixed, want, atol=1e-5, rtol=1e-5)
                assert torch.equal(mixed[:1], y0[:1])
                _check_rows_alone(segments, layer, which, x, y0, mixed)
