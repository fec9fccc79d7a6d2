"""The paged decode attention op alone, as a decode step calls it: float16 cache, the
default model's heads (9 query / 3 KV, head dim 64; ``--heads``), B decode rows of context C.

``--layers 30`` (default) calls it once on each of 30 distinct caches per pass, so the
cache comes from DRAM as inside a step (the weights stream through L3 between layers);
``--layers 1`` calls one cache 30 times (its bytes then in L2/L3: the kernel's compute).
Prints the best and median pass (ms) over ``--passes``, and with ``--layers 1`` the time a
(KV head, position) in ns and in core cycles at ``--ghz``.

    PYTHONPATH=. python benchmarks/attention_op.py --batch 16 --context 168 --threads 2
    PYTHONPATH=. python benchmarks/attention_op.py --batch 1 --context 1024 --threads 1 --layers 1
    PYTHONPATH=. python benchmarks/attention_op.py --batch 1 --context 128 --heads 24 8 128 --layers 28  # 3B
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roseinfer.kernels import cpu_kernels_available
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata

BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=168)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--ghz", type=float, default=3.34, help="core clock for the cycle figure")
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "HKV", "DH"),
                    help="query heads, KV heads, head dim (default: the default model's)")
    args = ap.parse_args()
    H, HKV, DH = args.heads
    assert cpu_kernels_available()
    torch.set_num_threads(args.threads)
    b, ctx = args.batch, args.context
    per = -(-ctx // BS)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, b * per * BS, HKV, DH, generator=gen).half()
              for _ in range(args.layers)]
    calls = caches * (30 // args.layers) if args.layers < 30 else caches  # >= 30 calls a pass
    specs = [SeqSpec(ctx - 1, 1, list(range(i * per, (i + 1) * per))) for i in range(b)]
    meta = build_attention_metadata(specs, BS, torch.device("cpu"))
    q = torch.randn(b, H, DH, generator=gen)
    op = torch.ops.roseinfer.paged_attention

    def one_pass() -> float:
        t0 = time.perf_counter()
        for c in calls:
            op(q, c, meta.block_tables, meta.token_seq, meta.token_context_lens, BS, DH**-0.5)
        return time.perf_counter() - t0

    for _ in range(3):
        one_pass()
    ts = [one_pass() for _ in range(args.passes)]
    best = min(ts)
    line = (f"batch {b}, context {ctx}, {args.threads} threads, {len(calls)} calls over "
            f"{args.layers} caches: best {best * 1e3:.3f} ms, median "
            f"{statistics.median(ts) * 1e3:.3f} ms a pass")
    if args.layers == 1:
        ns = best / len(calls) / (b * ctx * HKV) * 1e9
        line += f"; {ns:.2f} ns = {ns * args.ghz * args.threads:.0f} core cycles a (KV head, position)"
    print(line)


if __name__ == "__main__":
    main()
