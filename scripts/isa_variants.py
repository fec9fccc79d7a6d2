"""Check that every instruction-set variant of the CPU kernels gives the same bits.

The kernels are built per CPU (``-march=native``): a VNNI / AVX-512 machine runs other
loops than an AVX2 one, and each must give the AVX2 loops' bits (docs/CONTRACTS.md).
The kernel tests compare the GEMMs with their portable kernels on the machine they run
on; the attention kernels have no bitwise portable twin, so this script compares the
variants with each other.  On the machine it runs on it builds each variant that the
CPU can run (``ROSEINFER_KERNEL_CFLAGS``: ``-DROSEINFER_NO_VNNI`` for the AVX2 loops,
``-DROSEINFER_NO_AVX512`` for 256-bit VNNI, ``-mno-avxvnni`` for AVX-512 VNNI's
encoding, ``-DROSEINFER_NO_AMX`` for the vector loops where the native build uses AMX
tiles, ``-march=x86-64-v3`` / ``-v4`` for another CPU's build of the same code: the
compiler's tuning must not change a bit, and the native build), runs a fixed set of kernel calls in a fresh process per
variant (attention over fp32 / fp16 / int8 caches, decode rows and prefill chunks, the int8, Q4_1, act8 and GGUF GEMMs
at 1-83 rows) and prints one digest per variant; exit status 1 if they differ.
A second digest covers the default model end to end (``model_digest``: the logits of
every step of three chat prompts, prefill chunks and decode batches, in the default
format, in exact fp32 and over the int8 KV cache): equal across the variants too, and
the value to compare between machines (docs/performance.md records each CPU's).
A first build of each variant takes about a minute on two cores.

    .venv/bin/python -m scripts.isa_variants
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

# GGUF types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) -> their fp16 scale fields.
HALF_FIELDS = {8: [0], 2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 12: [0, 2], 13: [0, 2], 14: [208]}
VARIANTS = {
    "native": "",
    "avx2": "-DROSEINFER_NO_VNNI",
    "vnni256": "-DROSEINFER_NO_AVX512",
    "vnni-evex": "-mno-avxvnni",
    "no-amx": "-DROSEINFER_NO_AMX",
    # Other CPUs' builds (a later -march wins): their compilers' tuning, vector widths
    # and FMA contraction must not change a bit either.
    "x86-64-v3": "-march=x86-64-v3",
    "x86-64-v4": "-march=x86-64-v4",
}


def _flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line
    return ""


def runnable() -> list[str]:
    """The variants this CPU can run (each differs from the native build only here)."""
    flags = set(_flags().split())
    names = ["native", "avx2", "x86-64-v3"]
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        names.append("x86-64-v4")
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        names.append("vnni256")
    if "avx_vnni" in flags and "avx512_vnni" in flags and "avx512vl" in flags:
        names.append("vnni-evex")
    if "amx_int8" in flags and "avx512_vnni" in flags:
        names.append("no-amx")
    return names


def digest() -> str:
    """sha256 over the outputs of a fixed set of kernel calls (this process's build)."""
    import numpy as np
    import torch

    from roseinfer.kernels import cpu_kernels_available, make_linear, make_q4_linear
    from roseinfer.kernels.gguf import make_gguf_linear
    from roseinfer.kernels.q4_1 import recover_q4_1
    from roseinfer.model import kv_int8

    assert cpu_kernels_available(), "CPU kernels unavailable"
    h = hashlib.sha256()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.int8):
        for head_dim, (heads, hkv) in ((64, (9, 3)), (64, (8, 2)), (128, (4, 4)), (32, (6, 2))):
            d, width, bs = 24, 12, 16
            x = torch.randn(2, d * width * bs, hkv, head_dim, generator=gen)
            cache = kv_int8.to_cache_rows(x, dtype).contiguous()
            tables = torch.randperm(d * width, generator=gen).view(d, width).to(torch.int32)
            q = torch.randn(d, heads, head_dim, generator=gen)
            lens = torch.randint(1, width * bs + 1, (d,), generator=gen, dtype=torch.int32)
            rows = torch.arange(d, dtype=torch.int32)
            out = torch.ops.roseinfer.paged_attention(q, cache, tables, rows, lens, bs,
                                                      head_dim**-0.5)
            h.update(out.numpy().tobytes())
            # Prefill chunks: 13 rows of sequence 0 after 100 positions, 6 of sequence 1
            # from its start (consecutive rows of one sequence: attention_tile.h).
            seq = torch.tensor([0] * 13 + [1] * 6, dtype=torch.int32)
            chunk = torch.cat([torch.arange(101, 114), torch.arange(1, 7)]).to(torch.int32)
            out = torch.ops.roseinfer.paged_attention(q[:19], cache, tables, seq, chunk, bs,
                                                      head_dim**-0.5)
            h.update(out.numpy().tobytes())
    x = torch.randn(83, 256, generator=gen) * 3
    w = torch.randn(80, 256, generator=gen)
    lins = [make_linear(w, None, fp16=True, int8=True)]
    q, d, m = recover_q4_1(_q4_1(w))
    lins += [make_q4_linear(q, d, m, None), make_q4_linear(q, d, m, None, act8=True)]
    import gguf

    rng = np.random.default_rng(0)
    for qtype, halves in HALF_FIELDS.items():  # random blocks, finite fp16 scales
        values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        raw = rng.integers(0, 256, (80, 256 // values, size), dtype=np.uint8)
        for off in halves:
            scale = rng.uniform(0.001, 0.05, (80, 256 // values)) * rng.choice([-1, 1], (80, 256 // values))
            raw[..., off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(80, -1, 2)
        lins.append(make_gguf_linear([(qtype, torch.from_numpy(raw.reshape(80, -1)))], None))
    for lin in lins:
        for rows in (1, 2, 3, 4, 5, 7, 16, 64, 83):
            h.update(lin.forward(x[:rows]).numpy().tobytes())
    return h.hexdigest()[:16]


MODEL_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Translate 'Good morning' into Spanish."]


def step_logits(quantization: str, kv: str, max_tokens: int = 8,
                num_threads: int | None = None) -> list:
    """The logits the default model samples from at every step (the runner's
    ``sample_logits``) of three greedy chat requests run together: prompts in chunks of at
    most 16 tokens, then decode batches."""
    from roseinfer.llm import LLM
    from roseinfer.sampling_params import SamplingParams

    llm = LLM(quantization=quantization, kv_cache_dtype=kv, max_num_batched_tokens=16,
              weight_cache=False, num_threads=num_threads)
    runner = llm.engine.runner
    execute, seen = runner.execute, []

    def recorded(scheduled, greedy=False):  # the step as it was, its logits kept (never
        out = execute(scheduled)  # the tokens alone that a greedy step may take instead)
        seen.append(out.sample_logits.clone())
        return out

    runner.execute = recorded
    llm.chat([[{"role": "user", "content": p}] for p in MODEL_PROMPTS],
             SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return seen


def model_digest() -> str:
    """sha256 over ``step_logits`` in the default format, in exact fp32 and over the int8
    KV cache."""
    h = hashlib.sha256()
    for quantization, kv in (("auto", "auto"), ("none", "auto"), ("auto", "int8")):
        for logits in step_logits(quantization, kv):
            h.update(logits.numpy().tobytes())
    return h.hexdigest()[:16]


def _q4_1(w):
    """w rounded to Q4_1 values (gguf's quantizer), as float32."""
    import gguf
    import torch

    t = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(w.numpy(), t)
    return torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(w.shape).copy())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(f"kernels {digest()} model {model_digest()}")
        return 0
    results = {}
    for name in runnable():
        env = {**os.environ, "ROSEINFER_KERNEL_CFLAGS": VARIANTS[name]}
        proc = subprocess.run([sys.executable, "-m", "scripts.isa_variants", "--worker"], env=env,
                              capture_output=True, text=True)
        results[name] = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else (
            "failed: " + proc.stderr.strip()[-300:])
        print(f"{name:10s} {VARIANTS[name] or '(native)':22s} {results[name]}", flush=True)
    same = len(set(results.values())) == 1 and not any(r.startswith("failed") for r in results.values())
    print("all variants give the same bits" if same else "VARIANTS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
