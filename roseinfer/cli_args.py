"""The engine's command-line flags, shared by every subcommand that loads a model.

``add_engine_args`` adds one flag per ``EngineConfig`` field to a parser;
``engine_config_from_args`` turns the parsed flags back into an ``EngineConfig``. The
``roseinfer`` command (``cli.py``), ``roseinfer serve`` (``server/cli.py``) and
``roseinfer bench`` (``bench/cli.py``) all import them from here: none of them imports
another for its flags.
"""

from __future__ import annotations

import argparse

from roseinfer.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf or .pt (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--quantization", default="auto",
                   choices=["auto", "none", "fp16", "fp16+bf16", "int8", "q8_0", "q4_0"],
                   help="weight format: none (exact fp32), fp16 (fp16 weights, fp32 math), "
                        "int8 (int8 weights with a scale per 32, fp32 math), fp16+bf16 "
                        "(plus bf16 GEMMs for 32+ rows: not batch-invariant); "
                        "q8_0 (int8, and a GGUF's F16/BF16 matrices requantized to Q8_0 at "
                        "load: the old speed, 1.06 bytes per weight instead of 2); "
                        "q4_0 (int8, and float weights but the LM head quantized to GGUF "
                        "Q4_0 at load: 0.56 bytes per weight); "
                        "auto = int8 on CPU, none elsewhere")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="KV cache element type; auto = float16 with fp16 weights, else --dtype; "
                        "int8 = int8 with a scale per token and KV head (~1.9x the tokens "
                        "per GiB of float16; docs/kv-cache.md)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV pool budget in GiB (default: --kv-cache-memory-fraction of the "
                        "memory available after the weights, capped by what --max-num-seqs "
                        "sequences of --max-model-len tokens use)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.5,
                   help="share of the available memory the default KV pool may take")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-prefault-gb", type=float, default=1.0,
                   help="GiB of the KV pool's next blocks backed with memory ahead of use "
                        "while the engine is idle (0: off, pages backed when first "
                        "written; docs/kv-cache.md)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=True,
                   help="do not reuse the KV blocks of prompt prefixes already computed")
    g.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="persistent prefix cache: keep full KV blocks in DIR (written when "
                        "evicted from memory or when idle, read on a prefix-cache miss), so "
                        "long shared prefixes survive restarts; several servers may share DIR")
    g.add_argument("--kv-cache-dir-size", default="8G", metavar="SIZE",
                   help="size bound of --kv-cache-dir, bytes or e.g. 500M, 2G (least "
                        "recently used blocks are deleted)")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=None,
                   help="engine RNG seed for unseeded sampling (default 0); for generate "
                        "and chat it also seeds each request")
    g.add_argument("--no-weight-cache", dest="weight_cache", action="store_false", default=None,
                   help="do not read or write the converted-weights cache ($ROSEINFER_CACHE_DIR, "
                        "default ~/.cache/roseinfer; $ROSEINFER_WEIGHT_CACHE=0 also disables it)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N processes (this one and N-1 spawned "
                        "workers; gloo on CPU, NCCL on CUDA); threads per rank default to "
                        "the cores / N")
    g.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                   help="where the tensor-parallel ranks meet (default: 127.0.0.1, a free "
                        "port)")
    g.add_argument("--distributed-local-workers", type=int, default=None, metavar="K",
                   help="start only ranks 1..K here; ranks K+1..N-1 join from other hosts "
                        "with `roseinfer tp-worker` (needs --distributed-init-method)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="n-gram speculative decoding (off by default), vLLM's JSON: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 8, "
                        "\"prompt_lookup_max\": 6, \"prompt_lookup_min\": 3}'")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        kv_cache_memory_fraction=getattr(args, "kv_cache_memory_fraction", 0.5),
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_prefault_gb=getattr(args, "kv_cache_prefault_gb", 1.0),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, num_threads=args.num_threads,
        kv_cache_dir=getattr(args, "kv_cache_dir", None),
        kv_cache_dir_size=getattr(args, "kv_cache_dir_size", "8G"),
        seed=args.seed if args.seed is not None else 0,
        speculative_config=getattr(args, "speculative_config", None),
        weight_cache=getattr(args, "weight_cache", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        distributed_init_method=getattr(args, "distributed_init_method", None),
        distributed_local_workers=getattr(args, "distributed_local_workers", None),
    )
