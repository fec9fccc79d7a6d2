"""Weight formats: swap a loaded model's ``nn.Linear`` layers for faster kernels.

``quantize_model(model, "fp16")`` stores every projection weight (q/k/v, o, gate/up,
down and the LM head, tied or not) in fp16 and computes in fp32:

* on CPU through the C++ kernels' fp16 panel GEMM (``kernels/csrc/panel_gemm.h``: the
  weight is converted to fp32 in registers, one FMA chain per output element for every
  row count, so batch-invariant), or without them through fbgemm's fp16 GEMM
  (``quantized::linear_prepack_fp16`` / ``linear_dynamic_fp16``, not batch-invariant):
  a batch-1 decode step reads half the bytes of fp32 and the math is fp32, close to
  fp32 numerically (the only error is the weight rounding to fp16);
* on other devices as a plain fp16 weight cast to the activation dtype per call
  (``F.linear``), which is what a GPU does well anyway.

``"fp16+bf16"`` is fp16 as above for inputs under ``BF16_MIN_ROWS`` rows (decode
steps of small batches) plus a bf16 copy of each weight for larger inputs (prefill
chunks, big decode batches), which run as a bf16 GEMM with fp32 accumulation through
oneDNN: on CPUs with AVX512-BF16 or AMX that is about twice fbgemm's fp32-math rate
(measured here: 276-363 vs ~190 GFLOP/s at 32-128 rows, 330-400 at 256+).  Inputs and
outputs of those GEMMs are rounded to bf16.  The LM head stays fp16 only: rounding
logits to bf16 costs 2 points of top-1 agreement with fp32 for little time (prefill
computes logits for a few rows).  It costs a second copy of the decoder weights (bf16,
the size of the fp16 one).  Switching kernels by row count makes it the one format
that is not batch-invariant: opt-in only.

``"int8"`` (the CPU default) stores every weight as int8 with one fp32 scale per 32
weights of a row (like llama.cpp's Q8_0) — or, where a weight is exactly Q4_1 (a Q4_1
GGUF's, as the default model's decoder layers are), as those 4-bit values with their
scale and minimum, without requantizing (``kernels/q4_1.py``) — and quantizes each activation row per 32
values to int16 (one scale per block, computed from that row alone): the 32-block dot
products are exact int32 sums (AVX2 ``vpmaddwd``), scaled and summed in fp32 in block
order (``kernels/csrc/q8_gemm.h``).  One kernel for every input size: a row's result
never depends on how many rows share the call (batch invariance, docs/CONTRACTS.md).
1.1 bytes per weight per decode step (Q4_1: 0.625); the fp16 / fp32 copies are dropped.  Where the
kernels are unavailable it falls back to "fp16".

Embeddings and norms stay in the model dtype.  ``"none"`` leaves the model as is.
int16 activations cost nothing measurable in quality (top-1 agreement 98.58% either
way, tests/model/test_quantize.py); 8-bit ones do: fbgemm's dynamic int8 (one
activation scale per tensor) wrecks the default model (BENCHMARKS.md), per-token 8-bit
scales with per-channel weights measured top-1 agreement 91.4% (7-bit: 87.0%), and 8-bit
activations with one scale per 32 values of a row (llama.cpp's Q8_0 x Q8_0) measured
96.5%, below the 98% gate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

QUANTIZATIONS = ("none", "fp16", "fp16+bf16", "int8")
BF16_MIN_ROWS = 32  # below this many input rows fbgemm's fp16 GEMM is as fast or faster


def cpu_has_bf16_gemm() -> bool:
    """True when this CPU runs bf16 GEMMs natively (AVX512-BF16 or AMX) and oneDNN has them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def fbgemm_fp16_available() -> bool:
    """True when PyTorch's fbgemm fp16 linear ops exist in this build (x86 CPU builds)."""
    try:
        w = torch.zeros(8, 8)
        packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, 8), packed)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


class Fp16Linear(nn.Module):
    """y = x @ W^T + b with W stored in fp16 and fp32 (or the input dtype) compute.

    On CPU the weight is prepacked for fbgemm; elsewhere it is an fp16 tensor cast
    per call.  ``weight`` is kept (as fp16) for inspection and for ``.to(device)``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, use_fbgemm: bool,
                 bf16_min_rows: int = 0, int8: bool = False) -> None:
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.register_buffer("weight", weight.detach().to(torch.float16), persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float(), persistent=False
        )
        self._packed = None
        self.kernel: object | None = None  # torch.classes.roseinfer.Linear (threaded fbgemm)
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and _kernels():
            from roseinfer.kernels import make_linear

            self.kernel = make_linear(weight, bias, fp16=True, bf16_min_rows=bf16_min_rows,
                                      int8=int8)
            self.weight = torch.empty(0, dtype=torch.float16)
        elif use_fbgemm and weight.device.type == "cpu" and weight.dtype == torch.float32:
            # fbgemm keeps its own fp16 copy; drop ours to save memory.
            self._packed = torch.ops.quantized.linear_prepack_fp16(
                weight.detach().float().contiguous(),
                None if bias is None else bias.detach().float().contiguous(),
            )
            self.weight = torch.empty(0, dtype=torch.float16)

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        if x.dtype == torch.float32:
            if self.kernel is not None:
                return self.kernel.forward(x)  # type: ignore[attr-defined]
            if self._packed is not None:
                return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        if self.weight.numel() == 0:
            raise RuntimeError("Fp16Linear packed for fp32 activations was fed " + str(x.dtype))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        kind = "kernel" if self.kernel is not None else "fbgemm" if self._packed is not None else "cast"
        return f"in={self.in_features}, out={self.out_features}, fp16 weights ({kind})"


def _kernels() -> bool:
    from roseinfer.kernels import cpu_kernels_available

    return cpu_kernels_available()


def _swap_linears(module: nn.Module, make: Callable[[Tensor, Tensor | None], Fp16Linear],
                  skip: nn.Module | None = None) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if child is skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight, child.bias))
            count += 1
        else:
            count += _swap_linears(child, make, skip)
    return count


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str | None) -> nn.Module:
    """Convert ``model``'s linear layers (and LM head) in place to ``quantization``.

    The model must expose ``lm_head`` (an ``nn.Linear`` or None when tied) and a
    ``tied_embedding()`` returning the embedding weight a tied head reads.
    """
    if quantization in (None, "none"):
        return model
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; supported: {QUANTIZATIONS}")
    use_fbgemm = fbgemm_fp16_available()
    bf16_min_rows = BF16_MIN_ROWS if quantization == "fp16+bf16" else 0
    int8 = quantization == "int8"
    lm_head = getattr(model, "lm_head", None)
    _swap_linears(model, lambda w, b: Fp16Linear(w, b, use_fbgemm, bf16_min_rows, int8),
                  skip=lm_head)
    if lm_head is None:  # tied: the head reads the embedding matrix
        weight, bias = model.tied_embedding(), None  # type: ignore[operator]
    else:
        weight, bias = lm_head.weight, lm_head.bias
    # No bf16 head (see above).
    model.lm_head = Fp16Linear(weight, bias, use_fbgemm, int8=int8)
    model.quantization = quantization  # type: ignore[assignment]
    if hasattr(model, "_stack_state"):  # a decode stack built earlier saw the old weights
        model._stack, model._stack_state = None, "unbuilt"
    return model
