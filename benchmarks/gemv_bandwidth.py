"""Read rate (GB/s) of 1-row GGUF GEMVs as decode sees them: weights from DRAM.

A decode step reads every layer's weights once, far more than L3 holds, so each GEMV
streams its weights from memory.  Timing one matrix again and again instead measures
L3 (a 1B layer's matrices fit).  Here each shape gets enough copies (same bytes, distinct
buffers) to pass ``--working-set-mb``, called in turn; the best of ``--rounds`` passes,
stored bytes / seconds per call, next to ``roseinfer.bench.bandwidth.read_bandwidth_gbs``
with the same threads.  ``--l3``: one copy instead (the kernel's compute ceiling).

    python benchmarks/gemv_bandwidth.py --types Q4_0 --threads 2
    python benchmarks/gemv_bandwidth.py --types Q4_0,Q4_K,Q6_K --threads 1 --cpu-time
    python benchmarks/gemv_bandwidth.py --types Q4_0 --rows 16   # a batch-16 step's GEMMs
    python benchmarks/gemv_bandwidth.py --types Q4_0 --shapes 3072x5120,8192x3072  # other shapes
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
from gguf_gemm import random_raw  # this folder (run as a script)

from roseinfer.bench.bandwidth import read_bandwidth_gbs
from roseinfer.kernels import cpu_kernels_available
from roseinfer.kernels.gguf import make_gguf_linear
from roseinfer.model.quantize import ACT8_LAYERS

# (K, N, layer): the 1B model's qkv, o, gate_up, down and LM head; a layer named in
# quantize.ACT8_LAYERS (gate/up) runs with int8 activations, as in the model.
SHAPES = [(2048, 3072, "qkv_proj"), (2048, 2048, "o_proj"), (2048, 16384, "gate_up_proj"),
          (8192, 2048, "down_proj"), (2048, 49152, "lm_head")]
ACT8_TYPES = ("Q4_0", "Q4_1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time (needs --threads 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--working-set-mb", type=float, default=160.0)
    ap.add_argument("--l3", action="store_true", help="one copy per shape (cache resident)")
    ap.add_argument("--rows", type=int, default=1, help="rows per call (decode batch size)")
    ap.add_argument("--shapes", default="", help="KxN,KxN instead of the 1B's (e.g. the 3B's "
                    "3072x5120,3072x3072,3072x16384,8192x3072,3072x49152)")
    args = ap.parse_args()
    assert cpu_kernels_available()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures the calling thread: use --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"threads={args.threads} read bandwidth {read_bandwidth_gbs():.1f} GB/s; "
          f"GEMV GB/s ({'thread CPU time' if args.cpu_time else 'wall clock'}, best of "
          f"{args.rounds}, {'one copy' if args.l3 else f'>= {args.working_set_mb:.0f} MB rotated'}, "
          f"{args.rows} row{'s' if args.rows > 1 else ''})")
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qtype = gguf.GGMLQuantizationType[name]
        cells = []
        shapes = SHAPES if not args.shapes else [
            (*(int(v) for v in sh.split("x")), "") for sh in args.shapes.split(",")]
        for k, n, layer in shapes:
            act8 = layer in ACT8_LAYERS and name in ACT8_TYPES
            raw = torch.from_numpy(random_raw(qtype, n, k, rng))
            copies = 1 if args.l3 else max(2, int(args.working_set_mb * 1e6 / raw.nbytes) + 1)
            lins = [make_gguf_linear([(int(qtype), raw)], None, act8=act8) for _ in range(copies)]
            x = torch.randn(args.rows, k)
            calls = max(copies, 8)
            for i in range(calls):
                lins[i % copies].forward(x)
            best = float("inf")
            for _ in range(args.rounds):
                t0 = clock()
                for i in range(calls):
                    lins[i % copies].forward(x)
                best = min(best, (clock() - t0) / calls)
            cells.append(f"{k}x{n}{' act8' if act8 else ''}: {raw.nbytes / best / 1e9:5.1f}")
            del lins
        print(f"{name:5s} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
