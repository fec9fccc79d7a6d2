"""int8 vs float16 KV cache on the default model (issue 27): attention time and decode steps.

At batch B and context C (defaults 64 and 1,024), with the KV pool filled for B
sequences of C tokens, this times, alternating float16 and int8 caches:

1. ``attention``: the C++ paged-attention op over every layer's cache, one decode row
   per sequence (the call the decoder stack makes each layer);
2. ``step``: one whole decode step, the model's forward (the C++ decoder stack:
   GEMMs, rotary, KV writes, attention, MLP) plus the LM head, for B decode rows; the
   stack's own timers give the attention share inside it.

The caches hold random K/V: the bytes read and the arithmetic do not depend on the
values.  Prints the medians of ``--repeat`` interleaved runs and the int8 / float16
ratios (wall clock; the machine's other load shows as noise, hence medians).

    PYTHONPATH=. python benchmarks/kv_int8.py [--batch 64] [--context 1024] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.runner.kv_pool import allocate_kv_caches

DTYPES = {"float16": torch.float16, "int8": torch.int8}


def fill_random(caches: list[torch.Tensor], head_dim: int, gen: torch.Generator) -> None:
    """Random K/V: fp16 values in [-1, 1); int8 values with a scale of 1/127 per row."""
    for cache in caches:
        if cache.dtype == torch.int8:
            cache[..., :head_dim] = torch.randint(-127, 128, cache[..., :head_dim].shape,
                                                  generator=gen, dtype=torch.int8)
            scale = torch.full(cache.shape[:-1] + (1,), 1 / 127, dtype=torch.float32)
            cache[..., head_dim:] = scale.view(torch.int8)
        else:
            cache.copy_(torch.rand(cache.shape, generator=gen).mul_(2).sub_(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(num_kv_blocks=4, num_threads=args.threads))
    model, cfg, bs = engine.runner.model, engine.model_config, 16
    b, ctx = args.batch, args.context
    per_seq = -(-ctx // bs)
    caches = {name: allocate_kv_caches(cfg, b * per_seq, bs, dt, torch.device("cpu"))
              for name, dt in DTYPES.items()}
    gen = torch.Generator().manual_seed(0)
    for c in caches.values():
        fill_random(c, cfg.head_dim, gen)
    specs = [SeqSpec(ctx - 1, 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(b)]
    meta = build_attention_metadata(specs, bs, torch.device("cpu"))
    ids = torch.randint(3, cfg.vocab_size, (b,), generator=gen)
    q = torch.randn(b, cfg.num_heads, cfg.head_dim, generator=gen)
    scale = cfg.head_dim**-0.5
    times: dict[str, dict[str, list[float]]] = {n: {"attention": [], "step": [],
                                                    "stack_attention": []} for n in DTYPES}
    with torch.inference_mode():
        model(ids, meta.positions, caches["float16"], meta)  # builds the decoder stack
        stack = getattr(model, "_stack", None)
        for _ in range(args.repeat):
            for name, layer_caches in caches.items():
                t0 = time.perf_counter()
                for cache in layer_caches:
                    torch.ops.roseinfer.paged_attention(q, cache, meta.block_tables,
                                                        meta.token_seq, meta.token_context_lens,
                                                        bs, scale)
                times[name]["attention"].append(time.perf_counter() - t0)
                if stack is not None:
                    stack.set_profiling(True)
                t0 = time.perf_counter()
                model.compute_logits(model(ids, meta.positions, layer_caches, meta))
                times[name]["step"].append(time.perf_counter() - t0)
                if stack is not None:
                    times[name]["stack_attention"].append(stack.profile()[1])
                    stack.set_profiling(False)
    print(f"default model, batch {b}, context {ctx}, {cfg.num_layers} layers, "
          f"{torch.get_num_threads()} threads, medians of {args.repeat} interleaved runs")
    med = {n: {k: statistics.median(v) if v else float("nan") for k, v in t.items()}
           for n, t in times.items()}
    for what in ("attention", "stack_attention", "step"):
        f16, i8 = med["float16"][what], med["int8"][what]
        print(f"{what:16s} float16 {f16 * 1e3:8.1f} ms   int8 {i8 * 1e3:8.1f} ms   "
              f"int8/float16 {i8 / f16:.2f}x")
    f16, i8 = med["float16"]["step"], med["int8"]["step"]
    print(f"decode tok/s      float16 {b / f16:8.1f}      int8 {b / i8:8.1f}      "
          f"int8/float16 {f16 / i8:.2f}x")


if __name__ == "__main__":
    main()
