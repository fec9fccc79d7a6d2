"""``roseinfer bench [throughput|serve|profile]``: the benchmarks from the command line.

    roseinfer bench throughput --batch-sizes 1 16 64 --quantization fp16 --compare-hf
    roseinfer bench profile --batch-size 64 --quantization fp16
    roseinfer bench serve --url http://127.0.0.1:8000 --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from roseinfer.bench.cpu_info import cpu_flags
from roseinfer.cli_args import add_engine_args, engine_config_from_args

RESULTS_DIR = Path("benchmarks/results")


def _header(args: argparse.Namespace, engine: Any) -> dict[str, Any]:
    import torch

    return {
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "dtype": args.dtype,
        "quantization": engine.quantization,
        "threads": torch.get_num_threads(),
        "cpu_kernels": _kernel_note(),
        "cpu": cpu_flags(),
    }


def _kernel_note() -> str:
    try:
        from roseinfer.kernels import cpu_kernels_available

        return "on" if cpu_kernels_available() else "off"
    except ImportError:
        return "off"


def _write_json(name: str, payload: dict[str, Any], path: str | None) -> Path:
    out = Path(path) if path else RESULTS_DIR / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    return out


def cmd_throughput(args: argparse.Namespace) -> int:
    from roseinfer.bench.bandwidth import read_bandwidth_gbs
    from roseinfer.bench.throughput import (
        bandwidth_report,
        format_bandwidth,
        format_table,
        results_json,
        run_throughput,
    )
    from roseinfer.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    results = run_throughput(
        engine, args.batch_sizes, args.prompt_len, args.gen_len, args.repeat,
        compare_hf=args.compare_hf, hf_batch_sizes=args.hf_batch_sizes, seed=args.bench_seed,
        probe=read_bandwidth_gbs if args.bandwidth else None,
    )
    header = _header(args, engine) | {"prompt_len": args.prompt_len, "gen_len": args.gen_len}
    payload = results_json(results, header)
    print(format_table(results, header))
    if args.bandwidth:
        limit = bandwidth_report(engine, results)
        print(format_bandwidth(limit))
        payload["bandwidth"] = limit
    out = _write_json("throughput.json", payload, args.output)
    print(f"wrote {out}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from roseinfer.bench.prefill_profile import format_prefill_profile, run_prefill_profile
    from roseinfer.bench.profile import format_profile, run_profile
    from roseinfer.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    header = _header(args, engine)
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    payload = {"config": header, "profiles": []}
    for b in args.batch_sizes:
        prof = run_profile(engine, b, args.prompt_len, args.steps, args.bench_seed)
        print(format_profile(prof))
        payload["profiles"].append(prof)
    if args.prefill_len:
        pre = run_prefill_profile(engine, args.prefill_len, args.prefill_repeats, args.bench_seed)
        print(format_prefill_profile(pre))
        payload["prefill"] = pre
    out = _write_json("profile.json", payload, args.output)
    print(f"wrote {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from roseinfer.bench.serving import main_from_args

    return main_from_args(args)


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput | serve | profile")
    sub = bench.add_subparsers(dest="bench_command")
    bench.set_defaults(func=lambda a: cmd_throughput(_defaults_for_bare(a)))

    tp = sub.add_parser("throughput", help="offline prefill/decode throughput")
    add_engine_args(tp)
    _add_common(tp)
    tp.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    tp.add_argument("--gen-len", type=int, default=128)
    tp.add_argument("--repeat", type=int, default=1, help="runs per batch size (median)")
    tp.add_argument("--compare-hf", action="store_true",
                    help="run HF transformers generate on the same work and print the ratio")
    tp.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None,
                    help="batch sizes to run HF at (default: all)")
    tp.add_argument("--no-bandwidth", dest="bandwidth", action="store_false",
                    help="skip measuring read bandwidth and batch 1's share of its limit")
    tp.set_defaults(func=cmd_throughput)

    pr = sub.add_parser("profile", help="where one decode step's (and a prefill's) time goes")
    add_engine_args(pr)
    _add_common(pr)
    pr.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    pr.add_argument("--steps", type=int, default=16)
    pr.add_argument("--prefill-len", type=int, default=0,
                    help="also profile the prefill of one prompt of this many tokens")
    pr.add_argument("--prefill-repeats", type=int, default=3,
                    help="prefills to take the median of (after a warm-up)")
    pr.set_defaults(func=cmd_profile)

    sv = sub.add_parser("serve", help="online load against an OpenAI-compatible server")
    from roseinfer.bench.serving import add_serving_args

    add_serving_args(sv)
    sv.set_defaults(func=cmd_serve)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path (default benchmarks/results/)")


def _defaults_for_bare(args: argparse.Namespace) -> argparse.Namespace:
    """``roseinfer bench`` with no subcommand: the throughput benchmark's defaults."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    _add_common(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--compare-hf", action="store_true")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--no-bandwidth", dest="bandwidth", action="store_false")
    return parser.parse_args([])


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
