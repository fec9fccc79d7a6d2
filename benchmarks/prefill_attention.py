"""The paged-attention op on one prefill chunk (issue #25): ``--rows`` consecutive rows of
one sequence after ``--base`` cached positions (row r attends to base + r + 1 positions),
the default model's heads (9 query, 3 KV, head dim 64), an fp16 (or ``--dtype``) cache
of random K/V in cache; milliseconds a call, median of ``--reps``.

    PYTHONPATH=. python benchmarks/prefill_attention.py [--threads 2] [--base 256] [--rows 256]

Run two trees' copies in alternation to compare them (the op's name is the same in both).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roseinfer.kernels import cpu_kernels_available
from roseinfer.model import kv_int8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dtype", choices=["float16", "float32", "int8"], default="float16")
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "HKV", "DH"))
    args = ap.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels are not available")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h, hkv, dh = args.heads
    bs, length = 16, args.base + args.rows
    nb = -(-length // bs)
    tables = torch.randperm(nb, generator=gen).view(1, nb).to(torch.int32)
    x = torch.randn(2, nb * bs, hkv, dh, generator=gen)
    cache = kv_int8.to_cache_rows(x, getattr(torch, args.dtype)).contiguous()
    q = torch.randn(args.rows, h, dh, generator=gen)
    seq = torch.zeros(args.rows, dtype=torch.int32)
    lens = torch.arange(args.base + 1, length + 1, dtype=torch.int32)
    call = (q, cache, tables, seq, lens, bs, dh**-0.5)
    for _ in range(3):
        torch.ops.roseinfer.paged_attention(*call)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        torch.ops.roseinfer.paged_attention(*call)
        times.append(time.perf_counter() - t0)
    print(f"{args.dtype} cache, {args.rows} rows after {args.base} positions, heads {h}/{hkv}x{dh}, "
          f"{args.threads} threads: {statistics.median(times) * 1e3:.2f} ms a call")


if __name__ == "__main__":
    main()
