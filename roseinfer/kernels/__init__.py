"""Optional C++ CPU kernels (``csrc/*.cpp``), built on first use and cached.

``cpu_kernels_available()`` builds (once, see ``build.py``) and loads the library and
says whether it works; every caller falls back to plain PyTorch when it does not
(no compiler, unsupported platform, or ``ROSEINFER_CPU_KERNELS=0``).  What it adds:

* ``torch.classes.roseinfer.Linear``: int8-weight x int16-activation GEMM (exact
  integer block dots, every input size), fp16-weight panel GEMM, or the fp32 weight
  (all three batch-invariant, output columns split over the intra-op threads);
  optionally a bf16 copy for large inputs (oneDNN's bf16 GEMM, not invariant);
* ``torch.ops.roseinfer.paged_attention``: attention of every row (decode or prefill)
  straight from the paged KV cache, one arithmetic per row (batch invariance);
* ``torch.classes.roseinfer.LlamaStack``: all decoder layers of a step in one call
  (norms, rotary, KV writes, attention, MLP), so no Python runs per layer;
* ``roseinfer.kernels.gguf``: a GGUF file's stored tensors used as they are
  (``make_gguf_linear``, ``gguf_rows``; csrc/gguf_gemm.h).
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger("roseinfer.kernels")
PACK_WEIGHTS_PER_THREAD = 16 << 20  # see _pack
_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_kernels_available() -> bool:
    """Build (first time) and load the kernels; False, with a logged reason, if they cannot."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if os.environ.get("ROSEINFER_CPU_KERNELS", "1") == "0":
            _state["reason"] = "disabled by ROSEINFER_CPU_KERNELS=0"
        elif platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            _state["reason"] = f"unsupported platform {platform.system()}/{platform.machine()}"
        else:
            try:
                from roseinfer.kernels.build import build

                torch.ops.load_library(str(build()))
                ok = True
            except Exception as exc:  # noqa: BLE001 - any failure means: use PyTorch
                _state["reason"] = str(exc).splitlines()[0]
                logger.warning("roseinfer CPU kernels unavailable, using PyTorch: %s", exc)
        _state["ok"] = ok
        return ok


def unavailable_reason() -> str | None:
    return _state.get("reason")  # type: ignore[return-value]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fp16: bool,
                bf16_min_rows: int = 0, int8: bool = False) -> object:
    """A ``torch.classes.roseinfer.Linear`` over ``weight`` [N, K] (kernels must be loaded).

    ``int8``: int8 weights with one scale per 32 (``quantize_int8_blocks``), or a Q4_1
    GGUF's 4-bit weights as they are (``q4_1.recover_q4_1``), against activations
    quantized per row and 32-block to int16, for every input size (needs K % 32 == 0; else the fp16 / fp32 weight is
    kept).  Otherwise fp16 (fbgemm) or the fp32 weight, plus, with ``bf16_min_rows`` > 0,
    a bf16 copy for inputs of at least that many rows (not batch-invariant)."""
    w = weight.detach().float().contiguous()
    b = None if bias is None else bias.detach().float()
    if int8 and w.shape[1] % 32 == 0:
        from roseinfer.kernels.q4_1 import recover_q4_1

        q4 = recover_q4_1(w)  # a Q4_1 GGUF's weights: kept exactly, 4 bits each
        if q4 is not None:
            return make_q4_linear(*q4, b)
        return make_int8_linear(*quantize_int8_blocks(w), b)
    linear = torch.classes.roseinfer.Linear(w, b, fp16)
    if bf16_min_rows > 0:
        linear.set_bf16_weight(w.to(torch.bfloat16).contiguous(), bf16_min_rows)
    return linear


def make_int8_linear(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> object:
    """A ``torch.classes.roseinfer.Linear`` over int8 weights already quantized by
    ``quantize_int8_blocks``: q int8 [N, K] (K % 32 == 0), scales float32 [N, K / 32].

    The kernel ``make_linear(w, b, fp16, int8=True)`` builds from a (non-Q4_1) ``w``,
    without the fp32 weight (the weight cache hands its stored q / scales straight here)."""
    linear = _bare_linear(q, bias)
    _pack(q, lambda: linear.set_int8_weight(q, scales))
    return linear


def make_q4_linear(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   bias: torch.Tensor | None, act8: bool = False) -> object:
    """A ``torch.classes.roseinfer.Linear`` over Q4_1 weights as ``q4_1.recover_q4_1``
    gives them: q int8 [N, K] in [0, 15], scales and mins float32 [N, K / 32]; the kernel
    ``make_linear(w, b, fp16, int8=True)`` builds from a Q4_1 ``w``.  ``act8``: against
    activations quantized to int8 (csrc/q4_act8.h) instead of int16."""
    linear = _bare_linear(q, bias)
    _pack(q, lambda: linear.set_q4_weight(q, scales, mins, act8))
    return linear


def _bare_linear(q: torch.Tensor, bias: torch.Tensor | None) -> object:
    """A Linear of q's shape whose weight is set next: the constructor only records the
    fp32 weight, which set_int8_weight / set_q4_weight drop, so an uninitialised one is
    never read (nor, being untouched, paged in)."""
    n, k = q.shape
    return torch.classes.roseinfer.Linear(torch.empty(n, k), None if bias is None
                                          else bias.detach().float(), False)


def _pack(q: torch.Tensor, pack: Callable[[], None]) -> None:
    """Run a weight packing call (a byte shuffle of a few ms, in parallel regions) on one
    thread per PACK_WEIGHTS_PER_THREAD weights: on a busy machine the regions' fork/join
    costs more than the work (warm start of the default model, 2 cores under load: 4-5 s
    with 2 threads, 1.3-2.4 s with 1)."""
    threads = torch.get_num_threads()
    wanted = max(1, min(threads, q.numel() // PACK_WEIGHTS_PER_THREAD))
    if wanted != threads:
        torch.set_num_threads(wanted)
    try:
        pack()
    finally:
        if wanted != threads:
            torch.set_num_threads(threads)


# Values quantized at a time (rows of a weight): the fp32 temporaries of a conversion stay
# ~64 MB each, whatever the matrix (a vocabulary-sized LM head would need GBs at once).
QUANTIZE_CHUNK_VALUES = 16 << 20


def quantize_int8_blocks(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of ``block`` weights along a row: weight [N, K] ->
    (q int8 [N, K], scales float32 [N, K / block]), weight ~= q * scale per block.

    ``Q8Gemm`` (csrc/q8_gemm.h) multiplies each 32-block's exact integer dot product by
    this scale times the activation block's."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, k // block, dtype=torch.float32, device=weight.device)
    step = max(1, QUANTIZE_CHUNK_VALUES // max(1, k))  # rows at a time: bounded temporaries
    for r in range(0, n, step):
        groups = weight[r:r + step].float().reshape(-1, k // block, block)
        s = (groups.abs().amax(-1) / 127.0).clamp(min=1e-30)  # [rows, K / block]
        q[r:r + step] = torch.round(groups / s.unsqueeze(-1)).clamp_(-127, 127).to(
            torch.int8).reshape(-1, k)
        scales[r:r + step] = s
    return q, scales
