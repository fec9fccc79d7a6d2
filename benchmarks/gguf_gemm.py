"""GEMM throughput of GGUF weights used as stored (kernels/gguf.py) vs the old path (the
same weights dequantized, then requantized to Q8_0 through make_int8_linear), per
format at 1B shapes and M = 1, 16, 64 (--rows); interleaved runs, medians.

    python benchmarks/gguf_gemm.py [--threads 2] [--types Q4_K,Q6_K] [--reps 15]
    python benchmarks/gguf_gemm.py --threads 1 --cpu-time   # steadier on a busy machine
    python benchmarks/gguf_gemm.py --act8 --types Q4_0,Q4_1  # int16 -> int8 activations (gate/up)
    python benchmarks/gguf_gemm.py --rows 1 --gbs --types Q4_0 --shapes 2048x3072  # GEMV read GB/s

--gbs: each cell also gives the new path's weight read rate (stored bytes / median time,
GB/s) next to ``roseinfer.bench.bandwidth.read_bandwidth_gbs`` (printed once): a 1-row
GEMV is bound by it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

SHAPES = [(2048, 8192), (8192, 2048), (2048, 2048)]  # (K, N)


def random_raw(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Stored rows [n, row_bytes] from the gguf package's quantizer where it has one,
    else random bytes with finite fp16 scales (K-quants)."""
    import gguf

    t = gguf.GGMLQuantizationType
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    if qtype in (t.F16, t.BF16, t.Q8_0, t.Q4_0, t.Q4_1, t.Q5_0, t.Q5_1):
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype).view(np.uint8).reshape(n, -1))
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    offs = [208] if qtype == t.Q6_K else [0, 2]
    for off in offs:
        raw[..., off:off + 2] = np.full((n, k // values), 1e-3, np.float16).view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def timed(fn, x: torch.Tensor, cpu: bool) -> float:
    """Seconds of one call: wall clock, or with ``cpu`` this thread's CPU time (1 thread:
    the kernel runs on the calling thread; immune to being descheduled on a busy machine)."""
    clock = time.thread_time if cpu else time.perf_counter
    t0 = clock()
    fn(x)
    return clock() - t0


def main() -> None:
    import gguf

    from roseinfer.kernels import cpu_kernels_available, make_int8_linear, quantize_int8_blocks
    from roseinfer.kernels.gguf import make_gguf_linear

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q4_0,Q8_0,Q5_K,Q5_0,Q5_1,Q4_1,F16,BF16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default="", help="KxN,KxN (default: the 1B shapes)")
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time (needs --threads 1)")
    ap.add_argument("--rows", default="1,16,64", help="M values (rows per step), comma separated")
    ap.add_argument("--extra-copy", action="store_true",
                    help="with --act8: Q4_1 parts keep the int8 copy for steps of 5+ rows")
    ap.add_argument("--act8", action="store_true",
                    help="old: the stored format with int16 activations; new: act8 (int8 ones)")
    ap.add_argument("--gbs", action="store_true",
                    help="also the new path's weight bytes read per second (GB/s) and the read bandwidth")
    args = ap.parse_args()
    assert cpu_kernels_available()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures the calling thread: use --threads 1")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    clock = "thread CPU time" if args.cpu_time else "wall clock"
    old_label = "int16 activations -> act8" if args.act8 else "old Q8_0 path -> new"
    print(f"threads={args.threads} reps={args.reps} {clock}; GFLOP/s ({old_label}), speedup")
    if args.gbs:
        from roseinfer.bench.bandwidth import read_bandwidth_gbs

        print(f"read bandwidth ({args.threads} threads): {read_bandwidth_gbs():.1f} GB/s", flush=True)
    for name in args.types.split(","):
        qtype = gguf.GGMLQuantizationType[name]
        for k, n in shapes:
            raw = random_raw(qtype, n, k, rng)
            new = make_gguf_linear([(int(qtype), torch.from_numpy(raw))], None, act8=args.act8,
                                   extra_copy=args.extra_copy)
            if args.act8:
                old = make_gguf_linear([(int(qtype), torch.from_numpy(raw))], None)
            else:
                w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))
                old = make_int8_linear(*quantize_int8_blocks(w), None)
                del w
            cells = []
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k)
                old.forward(x), new.forward(x)  # warm up
                t_old, t_new = [], []
                for _ in range(args.reps):
                    t_old.append(timed(old.forward, x, args.cpu_time))
                    t_new.append(timed(new.forward, x, args.cpu_time))
                flop = 2.0 * m * n * k
                g_old = flop / statistics.median(t_old) / 1e9
                g_new = flop / statistics.median(t_new) / 1e9
                cell = f"M={m}: {g_old:6.1f} -> {g_new:6.1f} ({g_new / g_old:4.2f}x)"
                if args.gbs:
                    gbs = raw.nbytes / statistics.median(t_new) / 1e9
                    cell += f" {gbs:5.1f} GB/s {statistics.median(t_new) * 1e3:6.3f} ms"
                cells.append(cell)
            print(f"{name:5s} K={k:5d} N={n:5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
