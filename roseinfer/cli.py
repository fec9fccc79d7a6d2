"""The ``roseinfer`` command: serve | generate | chat | bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from roseinfer.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf or .pt (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--quantization", default="auto",
                   choices=["auto", "none", "fp16", "fp16+bf16", "int8"],
                   help="weight format: none (exact fp32), fp16 (fp16 weights, fp32 math), "
                        "int8 (int8 weights with a scale per 32, fp32 math), fp16+bf16 "
                        "(plus bf16 GEMMs for 32+ rows: not batch-invariant); "
                        "auto = int8 on CPU, none elsewhere")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache element type; auto = float16 with fp16 weights, else --dtype")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV pool budget in GiB (default: --kv-cache-memory-fraction of the "
                        "memory available after the weights, capped by what --max-num-seqs "
                        "sequences of --max-model-len tokens use)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.5,
                   help="share of the available memory the default KV pool may take")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=True)
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
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
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


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _add_structured_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("structured outputs (at most one)")
    kinds = g.add_mutually_exclusive_group()
    kinds.add_argument("--json-schema", metavar="FILE", default=None,
                       help="the output is JSON valid under the JSON schema in FILE")
    kinds.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    kinds.add_argument("--regex", default=None, help="the output matches this regex")
    kinds.add_argument("--choice", nargs="+", default=None, metavar="TEXT",
                       help="the output is one of these strings")
    kinds.add_argument("--grammar", metavar="FILE", default=None,
                       help="the output matches the grammar in FILE (llguidance Lark or GBNF)")


def _structured_outputs(args: argparse.Namespace):  # noqa: ANN202
    """StructuredOutputsParams from the generate flags, or None."""
    from roseinfer.structured_outputs import StructuredOutputsParams

    if getattr(args, "json_schema", None):
        return StructuredOutputsParams(json=_read_text(args.json_schema))
    if getattr(args, "json_object", False):
        return StructuredOutputsParams(json_object=True)
    if getattr(args, "regex", None):
        return StructuredOutputsParams(regex=args.regex)
    if getattr(args, "choice", None):
        return StructuredOutputsParams(choice=args.choice)
    if getattr(args, "grammar", None):
        return StructuredOutputsParams(grammar=_read_text(args.grammar))
    return None


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _sampling_params(args: argparse.Namespace):  # noqa: ANN202
    from roseinfer.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=tuple(args.stop or ()),
        structured_outputs=_structured_outputs(args),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from roseinfer.llm import LLM

    params = _sampling_params(args)
    with LLM.from_engine(_build_engine(args)) as llm:  # stops tensor-parallel workers
        prompts = [llm.render_chat([{"role": "user", "content": p}]) if args.chat else p
                   for p in args.prompt]
        if args.stream:
            for i, prompt in enumerate(prompts):
                if len(prompts) > 1:
                    print(f"--- [{i}] {args.prompt[i]!r}")
                for delta in llm.stream(prompt, params):
                    print(delta, end="", flush=True)
                print()
            return 0
        for i, out in enumerate(llm.generate(prompts, params)):
            c = out.outputs[0]
            if len(prompts) > 1:
                print(f"--- [{i}] {args.prompt[i]!r} ({len(c.token_ids)} tokens, "
                      f"{c.finish_reason})")
            print(c.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from roseinfer.llm import LLM

    params = _sampling_params(args)
    with LLM.from_engine(_build_engine(args)) as llm:  # stops tensor-parallel workers
        _chat_loop(llm, params, args.system)
    return 0


def _chat_loop(llm, params, system: str | None) -> None:  # noqa: ANN001
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    print("roseinfer chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for delta in llm.stream(llm.render_chat(messages), params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _build_engine(args: argparse.Namespace):  # noqa: ANN202
    from roseinfer.engine.engine import LLMEngine

    return LLMEngine(engine_config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roseinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    _add_sampling_args(gen)
    _add_structured_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)

    worker = sub.add_parser(
        "tp-worker", help="join a tensor-parallel group from another host (a rank > 0)",
        description="Run one tensor-parallel rank for an engine started elsewhere with "
                    "--tensor-parallel-size N --distributed-local-workers K "
                    "--distributed-init-method tcp://HOST:PORT: ranks K+1..N-1 are started "
                    "this way. The model path of rank 0 must exist on this host too.")
    worker.add_argument("--distributed-init-method", required=True, metavar="tcp://HOST:PORT",
                        help="rank 0's address")
    worker.add_argument("--rank", type=int, required=True, help="this worker's rank (>= 1)")
    worker.add_argument("--host", default=None,
                        help="this host's address for the group (default: the one on the "
                             "route to rank 0)")
    worker.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: rank 0's threads per rank)")
    worker.add_argument("--secret-file", default=None, metavar="PATH",
                        help="file holding the group's secret (default: the "
                             "ROSEINFER_TP_SECRET environment variable; never a value here)")
    worker.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    worker.set_defaults(func=cmd_tp_worker)

    for register in _extra_commands():
        register(sub)
    return parser


def cmd_tp_worker(args: argparse.Namespace) -> int:
    from roseinfer.config import parse_init_method
    from roseinfer.distributed.worker import join_main

    parse_init_method(args.distributed_init_method)  # ValueError naming the option
    if args.rank < 1:
        raise ValueError(f"--rank must be >= 1 (rank 0 is the engine), got {args.rank}")
    return join_main(args.distributed_init_method, args.rank, args.host, args.num_threads,
                     args.secret_file, args.parent_pid)


def _extra_commands() -> list:
    """Subcommands that live next to what they run (server, benchmarks)."""
    commands = []
    try:
        from roseinfer.server.cli import register as register_serve

        commands.append(register_serve)
    except ImportError:  # pragma: no cover - server extras not installed
        pass
    try:
        from roseinfer.bench.cli import register as register_bench

        commands.append(register_bench)
    except ImportError:  # pragma: no cover
        pass
    return commands


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # bad options or model path: no traceback
        print(f"roseinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
