"""Random-weight GGUFs of real model shapes with the default model's tokenizer
(``roseinfer/bench/random_gguf.py``), for ``benchmarks/scale.py``.

    .venv/bin/python benchmarks/make_random_gguf.py --shape llama-1b --format Q4_K_M Q4_0 \
        --out-dir /tmp/gguf [--llama-quantize /path/to/llama-quantize]

Shapes: llama-1b (Llama-3.2-1B), llama-3b (Llama-3.2-3B), llama-8b (Llama-3.1-8B),
qwen-1.5b (Qwen2.5-1.5B); the vocabulary is the default model's (49,152 tokens).
Formats: F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K Q4_K_M, or "all".
Files are named ``<shape>-<format>.gguf``; existing ones are kept unless --force.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from roseinfer.bench.random_gguf import SHAPES, iter_formats, write_random_gguf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["llama-1b"], choices=sorted(SHAPES))
    p.add_argument("--format", nargs="+", default=["Q4_K_M"])
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/roseinfer-gguf"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-quantize", type=Path, default=None,
                   help="llama.cpp's llama-quantize: quantize an F16 file with it instead")
    p.add_argument("--force", action="store_true", help="rewrite existing files")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for shape in args.shape:
        for fmt in iter_formats(args.format):
            path = args.out_dir / f"{shape}-{fmt}.gguf"
            if path.exists() and not args.force:
                print(f"{path} exists (--force rewrites it)")
                continue
            start = time.perf_counter()
            write_random_gguf(path, SHAPES[shape], fmt, args.seed,
                              llama_quantize=args.llama_quantize,
                              log=lambda m: print(m, file=sys.stderr))
            print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in "
                  f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
