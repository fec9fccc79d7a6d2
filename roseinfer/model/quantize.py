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

``"q4_0"`` (opt-in) is ``"int8"`` with every float weight but the LM head's quantized to
GGUF Q4_0 instead (``kernels/q4_0.py``: llama.cpp's quantizer, bit for bit; 0.56 bytes
per weight) and run by the GGUF Q4_0 kernel (``kernels.gguf.make_gguf_linear``), int8
activations in front of gate/up as a stored Q4_0 part; lossy (docs/performance.md).

Embeddings and norms stay in the model dtype.  ``"none"`` leaves the model as is.
int16 activations cost nothing measurable in quality (top-1 agreement 98.58% either
way, tests/model/test_quantize.py); 8-bit ones do: fbgemm's dynamic int8 (one
activation scale per tensor) wrecks the default model (BENCHMARKS.md), per-token 8-bit
scales with per-channel weights measured top-1 agreement 91.4% (7-bit: 87.0%), and 8-bit
activations with one scale per 32 values of a row (llama.cpp's Q8_0 x Q8_0) measured
96.5%, below the 98% gate.  int8 activations in front of gate/up alone, where their
weights are Q4_1 (or a GGUF's Q4_0 parts), with one scale per 16 values of a row
(``kernels/csrc/q4_act8.h``, twice the multiply-adds per instruction, ``ACT8_LAYERS``)
measure 98.94% top-1 and -0.11% perplexity on the default model, and 13 of the 14
everyday chat answers as fp32's, Paris named (with one scale per 32 values they lost
Paris: docs/performance.md, "8-bit activations in front of gate/up again").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Layers whose Q4_1 (or GGUF Q4_0) weights meet int8 activations (``act8_layer``), one
# scale per 16 of a row's values: gate/up, 40% of a SmolLM2 token's multiply-adds, where
# they make prefill and batched decode 10-30% faster on AVX-512 VNNI (docs/performance.md,
# "8-bit activations in front of gate/up again").  The quality gate passes with them on
# every x86 CPU alike (the same bits everywhere since 11-29): top-1 98.94%, perplexity
# -0.11%, 13 of 14 everyday answers as fp32's, Paris named.  From 11-28 to 11-29 none
# took them: with one scale per 32 values, and rms_norm's bits then depending on the
# CPU, a Zen 4 answered the Paris question "L'Étoile, la Marseillaise, ...".
ACT8_LAYERS: frozenset[str] = frozenset({"gate_up_proj"})

QUANTIZATIONS = ("none", "fp16", "fp16+bf16", "int8", "q4_0")
# Formats whose layers are the C++ kernels' integer ones (int8 / Q4_1 / GGUF parts;
# "q4_0": "int8" with float weights requantized to Q4_0).
INT_FORMATS = frozenset({"int8", "q4_0"})
# Weight dtypes the int8 conversion takes (a 16-bit checkpoint's linears stay 16-bit
# until converted: factory.load_model).
_INT8_SOURCES = (torch.float32, torch.bfloat16, torch.float16)
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
    ``Fp16Linear.from_kernel`` wraps a kernel built from already quantized weights.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, use_fbgemm: bool,
                 bf16_min_rows: int = 0, int8: bool = False) -> None:
        super().__init__()
        self._setup(int(weight.shape[0]), int(weight.shape[1]), bias)
        self.register_buffer("weight", weight.detach().to(torch.float16), persistent=False)
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

    @classmethod
    def from_kernel(cls, kernel: object, out_features: int, in_features: int,
                    bias: Tensor | None) -> Fp16Linear:
        """A layer over an already built ``torch.classes.roseinfer.Linear`` (int8 or Q4_1
        weights from ``kernels.make_int8_linear`` / ``make_q4_linear``)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(out_features, in_features, bias)
        self.register_buffer("weight", torch.empty(0, dtype=torch.float16), persistent=False)
        self.kernel = kernel
        return self

    def _setup(self, out_features: int, in_features: int, bias: Tensor | None) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float(), persistent=False
        )
        self._packed = None
        self.kernel: object | None = None  # torch.classes.roseinfer.Linear (threaded fbgemm)

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


@dataclass(frozen=True)
class LinearFormat:
    """How ``quantize_model`` builds each layer of one weight format (``linear_format``)."""

    use_fbgemm: bool
    bf16_min_rows: int  # > 0: fp16+bf16
    int8: bool
    kernels: bool  # the C++ kernels are loaded (int8 weights need them)
    q4_0: bool = False  # "q4_0": float weights but the LM head's to Q4_0 (kernels/q4_0.py)


def linear_format(quantization: str) -> LinearFormat:
    """The layer recipe of a (non-"none") ``quantization``; ValueError for unknown ones."""
    if quantization not in QUANTIZATIONS or quantization == "none":
        raise ValueError(f"unsupported quantization {quantization!r}; supported: {QUANTIZATIONS}")
    return LinearFormat(use_fbgemm=fbgemm_fp16_available(),
                        bf16_min_rows=BF16_MIN_ROWS if quantization == "fp16+bf16" else 0,
                        int8=quantization in INT_FORMATS, kernels=_kernels(),
                        q4_0=quantization == "q4_0")


def act8_layer(path: str) -> bool:
    """Whether the layer at ``path`` takes int8 activations when its weights are Q4_1 (or,
    in a GGUF used as stored, Q4_0 parts): its name in ``ACT8_LAYERS`` (gate/up).  With
    gate/up (csrc/q4_act8.h: twice the multiply-adds per instruction, on 40% of a SmolLM2
    token's) the default model passes the quality gate (98.94% top-1, perplexity -0.11%,
    13 of 14 chat answers, Paris); adding o measured 12 of 14 in the kernel path, q/k/v
    failed top-1 (97.78% with 32-value scales: docs/performance.md)."""
    return path.rsplit(".", 1)[-1] in ACT8_LAYERS


def convert_linear(weight: Tensor, bias: Tensor | None, fmt: LinearFormat, head: bool = False,
                   act8: bool = False) -> tuple[Fp16Linear, dict[str, Tensor]]:
    """One layer in format ``fmt`` plus the record it can be rebuilt from bitwise
    (``rebuild_linear``): int8 weights as ``{"qweight", "scales"}``, a Q4_1 GGUF's
    weights as ``{"q4weight", "q4scales", "q4mins"}`` (``kernels.q4_1``), ``"q4_0"``'s
    as ``{"q4_0"}`` (its GGUF Q4_0 blocks, ``kernels.q4_0``: all but the LM head, which is
    int8), anything else as ``{"weight"}`` (the original weight); plus ``"bias"`` when
    there is one.
    ``head``: the LM head (never bf16, see the module docstring); ``act8``: Q4_1 weights
    meet int8 activations (``act8_layer``)."""
    record = {} if bias is None else {"bias": bias.detach()}
    if (fmt.int8 and fmt.kernels and weight.device.type == "cpu"
            and weight.dtype in _INT8_SOURCES and weight.shape[1] % 32 == 0):
        from roseinfer.kernels import quantize_int8_blocks
        from roseinfer.kernels.q4_1 import recover_q4_1

        # A 16-bit weight (safetensors kept in its dtype) is widened one layer at a time.
        w = weight.detach().float().contiguous()
        if fmt.q4_0 and not head:
            from roseinfer.kernels.q4_0 import quantize_q4_0

            record["q4_0"] = quantize_q4_0(w)
            return rebuild_linear(record, fmt, head, act8), record
        # as make_linear(int8=True): Q4_1 kept exactly (only fp32 can be), else Q8_0
        q4 = recover_q4_1(w) if weight.dtype == torch.float32 else None
        if q4 is not None:
            record.update(q4weight=q4[0], q4scales=q4[1], q4mins=q4[2])
        else:
            q, scales = quantize_int8_blocks(w)
            record.update(qweight=q, scales=scales)
        return rebuild_linear(record, fmt, head, act8), record
    record["weight"] = weight.detach()
    bf16_min_rows = 0 if head else fmt.bf16_min_rows
    return Fp16Linear(weight, bias, fmt.use_fbgemm, bf16_min_rows, fmt.int8), record


def rebuild_linear(record: dict[str, Tensor], fmt: LinearFormat, head: bool = False,
                   act8: bool = False) -> Fp16Linear:
    """The layer ``convert_linear`` built, from its record (e.g. read back from the
    weight cache)."""
    bias = record.get("bias")
    if "q4_0" in record:
        if not fmt.kernels:
            raise ValueError("Q4_0 weights need the C++ kernels, which are not loaded")
        from roseinfer.kernels.gguf import make_gguf_linear
        from roseinfer.kernels.q4_0 import BLOCK, Q4_0_BLOCK_BYTES, Q4_0_TYPE

        raw = record["q4_0"]
        kernel = make_gguf_linear([(Q4_0_TYPE, raw)], bias, act8=act8)
        in_features = int(raw.shape[1]) // Q4_0_BLOCK_BYTES * BLOCK
        return Fp16Linear.from_kernel(kernel, int(raw.shape[0]), in_features, bias)
    if "qweight" in record or "q4weight" in record:
        if not fmt.kernels:
            raise ValueError("int8 / Q4_1 weights need the C++ kernels, which are not loaded")
        from roseinfer.kernels import make_int8_linear, make_q4_linear

        if "q4weight" in record:
            q = record["q4weight"]
            kernel = make_q4_linear(q, record["q4scales"], record["q4mins"], bias, act8)
        else:
            q = record["qweight"]
            kernel = make_int8_linear(q, record["scales"], bias)
        return Fp16Linear.from_kernel(kernel, int(q.shape[0]), int(q.shape[1]), bias)
    bf16_min_rows = 0 if head else fmt.bf16_min_rows
    return Fp16Linear(record["weight"], bias, fmt.use_fbgemm, bf16_min_rows, fmt.int8)


def linear_paths(model: nn.Module) -> list[str]:
    """Module paths ``quantize_model`` converts: every ``nn.Linear`` but the LM head,
    then ``"lm_head"`` (an ``nn.Linear``, or None when tied to the embedding)."""
    lm_head = getattr(model, "lm_head", None)
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not lm_head] + ["lm_head"]


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at ``path`` (dotted) with ``module``."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def mark_quantized(model: nn.Module, quantization: str) -> None:
    """Record that ``model``'s layers are in ``quantization`` (a decode stack built
    before is dropped: it saw the old layers)."""
    model.quantization = quantization  # type: ignore[assignment]
    if hasattr(model, "_stack_state"):  # a decode stack built earlier saw the old weights
        model._stack, model._stack_state = None, "unbuilt"


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str | None,
                   records: dict[str, dict[str, Tensor]] | None = None,
                   track: Callable[[list[str]], Iterable[str]] = iter) -> nn.Module:
    """Convert ``model``'s linear layers (and LM head) in place to ``quantization``.

    The model must expose ``lm_head`` (an ``nn.Linear`` or None when tied) and a
    ``tied_embedding()`` returning the embedding weight a tied head reads.  A model
    already in ``quantization`` (e.g. loaded from the weight cache) is left as is.
    ``records``: filled with each converted layer's record (``convert_linear``) by path,
    what the weight cache stores.  ``track`` wraps the list of layer paths (progress).
    """
    if quantization in (None, "none") or getattr(model, "quantization", None) == quantization:
        return model
    fmt = linear_format(quantization)
    paths = [p for p in linear_paths(model)  # (an LM head converted as loaded is done)
             if p != "lm_head" or not isinstance(getattr(model, "lm_head", None), Fp16Linear)]
    for path in track(paths):
        _convert_path(model, path, fmt, records)
    mark_quantized(model, quantization)
    return model


def _convert_path(model: nn.Module, path: str, fmt: LinearFormat,
                  records: dict[str, dict[str, Tensor]] | None) -> None:
    """Convert the layer at ``path`` (``"lm_head"``: the head, tied or not) in place."""
    if path == "lm_head":
        head = getattr(model, "lm_head", None)
        if head is None:  # tied: the head reads the embedding matrix
            weight, bias = model.tied_embedding(), None  # type: ignore[operator]
        else:
            weight, bias = head.weight, head.bias
        module, record = convert_linear(weight, bias, fmt, head=True)
    else:
        linear = model.get_submodule(path)
        module, record = convert_linear(linear.weight, linear.bias, fmt, act8=act8_layer(path))
    set_module(model, path, module)  # the source layer goes now, not after the loop
    if records is not None:
        records[path] = record


def converter_as_loaded(model: nn.Module, quantization: str,
                        records: dict[str, dict[str, Tensor]] | None
                        ) -> Callable[[str], bool]:
    """``load_weights``' ``on_module_loaded`` for a model about to be ``quantize_model``-ed
    to ``quantization``: each linear layer (an untied LM head too) is converted as soon as
    the checkpoint filled it, so the source weights of at most one layer are held beside
    the converted ones (a 16-bit checkpoint's first start: no copy of all its linears);
    ``quantize_model`` afterwards converts the rest (a tied head) and marks the model.
    The same conversion per layer as ``quantize_model``'s: the same model, bitwise."""
    fmt = linear_format(quantization)

    def on_module_loaded(path: str) -> bool:
        if not isinstance(model.get_submodule(path), nn.Linear):
            return False
        _convert_path(model, path, fmt, records)
        return True

    return on_module_loaded


def apply_linear_records(model: nn.Module, quantization: str,
                         records: dict[str, dict[str, Tensor]]) -> nn.Module:
    """``quantize_model`` from the records it produced (the weight cache's warm start):
    the layers are rebuilt from them, the model's own linear weights are never read
    (they may be on the meta device).  KeyError if a layer has no record."""
    fmt = linear_format(quantization)
    for path in linear_paths(model):
        set_module(model, path, rebuild_linear(records[path], fmt, head=path == "lm_head",
                                               act8=act8_layer(path)))
    mark_quantized(model, quantization)
    return model
