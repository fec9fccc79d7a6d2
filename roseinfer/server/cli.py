"""``roseinfer serve``: load the model, start the engine loop and run uvicorn
(or, with ``--ray``, N engine replicas behind Ray Serve: ``roseinfer.ray_serve``).

SIGTERM / Ctrl-C: uvicorn stops accepting connections, lets in-flight requests
finish for up to ``--graceful-timeout`` seconds, then the lifespan shuts the
engine loop down and the process exits 0.

Heavy imports (torch, fastapi, uvicorn) happen inside ``cmd_serve`` so that other
subcommands do not pay for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from roseinfer.cli_args import add_engine_args, engine_config_from_args
from roseinfer.pooling_params import PoolingParams
from roseinfer.server.api_key import resolve_api_key
from roseinfer.server.startup import DEFAULT_MODEL_NAME, default_model_name, warmup

if TYPE_CHECKING:
    from roseinfer.engine.async_engine import AsyncEngine
    from roseinfer.engine.engine import LLMEngine
    from roseinfer.server.conn_limits import ConnectionLimits
    from roseinfer.server.lora_registry import LoRASettings
    from roseinfer.server.state import ServerSettings

logger = logging.getLogger("roseinfer.server")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (visible in `ps`: prefer "
                        "--api-key-file or $ROSEINFER_API_KEY)")
    g.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (default: $ROSEINFER_API_KEY)")
    g.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key")
    g.add_argument("--allowed-hosts", nargs="+", default=(), metavar="HOST",
                   help="Host names answered besides loopback ones ('*': any; default on a "
                        "non-loopback --host: any)")
    g.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="browser origins (scheme://host[:port], '*') served cross-origin "
                        "with CORS headers")
    g.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds for a request's headers and body to arrive (408 after)")
    g.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="close a keep-alive connection idle this many seconds")
    g.add_argument("--max-connections", type=int, default=512,
                   help="open connections; a request on one past it is answered 503")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: from --model)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="answer 503 while this many sequences wait to be scheduled")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="413 above this size")
    g.add_argument("--stream-stall-timeout", type=float, default=60.0,
                   help="abort a stream whose client reads nothing for this many seconds "
                        "(0: never)")
    g.add_argument("--no-strict-tool-arguments", dest="strict_tool_arguments",
                   action="store_false", default=True,
                   help="let tool-call arguments hold keys a tool's schema does not declare "
                        "when the schema does not forbid them (default: only declared keys)")
    g.add_argument("--responses-store-size", type=int, default=256,
                   help="Responses API responses kept for previous_response_id (0: none)")
    g.add_argument("--embedding-pooling", choices=("mean", "last"), default="mean",
                   help="/v1/embeddings: pool the final hidden states of every prompt "
                        "position (mean) or take the last position's (last)")
    g.add_argument("--no-embedding-normalize", dest="embedding_normalize",
                   action="store_false", default=True,
                   help="/v1/embeddings: return the pooled vectors as they are "
                        "(default: L2-normalized)")
    g.add_argument("--graceful-timeout", type=int, default=30,
                   help="seconds in-flight requests may take to finish on SIGTERM")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy")
    g.add_argument("--no-warmup", dest="warmup", action="store_false", default=True,
                   help="skip the warm-up generation at startup")
    g.add_argument("--no-ui", dest="ui", action="store_false", default=True,
                   help="do not serve the web UI (chat + engine dashboard) at /")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    lo = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters (implied by the options below)")
    lo.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                    help="PEFT adapter directories served under these model names")
    lo.add_argument("--max-loras", type=int, default=4,
                    help="adapters resident at once (LRU, swapped in from disk)")
    lo.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank")
    lo.add_argument("--lora-dir", default=None,
                    help="POST /v1/load_lora_adapter may load adapters inside this directory")
    lo.add_argument("--allow-any-lora-path", action="store_true",
                    help="POST /v1/load_lora_adapter may load any path the server can read "
                         "(as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    r = p.add_argument_group("replicas on Ray Serve (needs the 'ray' extra)")
    r.add_argument("--ray", action="store_true",
                   help="serve --num-replicas engines behind one endpoint with Ray Serve")
    r.add_argument("--num-replicas", type=int, default=2, help="engine replicas (with --ray)")
    r.add_argument("--routing", default="prefix", choices=["prefix", "round_robin"],
                   help="prefix: send a prompt where its prefix is cached (load permitting)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: $RAY_ADDRESS, else a local one)")
    p.set_defaults(func=cmd_serve)


def _setup_logging(level: str) -> None:
    root = logging.getLogger("roseinfer")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def run_server(async_engine: AsyncEngine, settings: ServerSettings, host: str, port: int,
               graceful_timeout: int = 30, log_level: str = "info",
               limits: ConnectionLimits | None = None, timeout_keep_alive: int = 5,
               lora: LoRASettings | None = None) -> int:
    """Serve until SIGTERM / SIGINT; returns the process exit code."""
    import uvicorn

    from roseinfer.server.app import create_app
    from roseinfer.server.conn_limits import ConnectionLimits, server_config

    app = create_app(async_engine, settings, lora)
    config = server_config(app, limits or ConnectionLimits(), host=host, port=port,
                           log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                           timeout_keep_alive=timeout_keep_alive, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; a no-op
    # handler underneath turns that into a normal return, so the exit code is 0.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if in_main else None
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        async_engine.shutdown()
    logger.info("server stopped")
    return 0 if server.started else 1


def cmd_serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    if args.ray:
        return _serve_on_ray(args)
    from roseinfer.engine.async_engine import AsyncEngine
    from roseinfer.engine.engine import LLMEngine
    from roseinfer.runner.model_runner import kv_bytes_per_block
    from roseinfer.server.access import AccessSettings
    from roseinfer.server.conn_limits import ConnectionLimits
    from roseinfer.server.lora_registry import LoRASettings
    from roseinfer.server.state import ServerSettings

    try:  # the server's own options, checked before the model loads
        args.api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ)
        access = AccessSettings(bind_host=args.host, allowed_hosts=tuple(args.allowed_hosts),
                                allowed_origins=tuple(args.allowed_origins),
                                public_metrics=args.public_metrics)
        limits = ConnectionLimits(args.request_timeout, args.max_connections)
        lora = LoRASettings(modules=parse_lora_modules(args.lora_modules),
                            lora_dir=args.lora_dir, allow_any_path=args.allow_any_lora_path)
        config = lora_engine_config(engine_config_from_args(args), args)
    except ValueError as exc:
        print(f"roseinfer serve: error: {exc}", file=sys.stderr)
        return 2
    names = tuple(args.served_model_name or (default_model_name(args.model),))
    logger.info("loading model %s (dtype %s, device %s)", args.model or DEFAULT_MODEL_NAME,
                config.dtype, config.device)

    def build() -> LLMEngine:  # runs on the engine thread (see AsyncEngine.launch)
        engine = LLMEngine(config)
        bm = engine.block_manager
        gib = bm.num_blocks * kv_bytes_per_block(engine.model_config, bm.block_size,
                                                 engine.kv_dtype) / (1 << 30)
        logger.info("model %s: %s, dtype %s, weights %s, KV cache %s, on %s; KV pool %d "
                    "blocks x %d tokens = %d tokens (~%.2f GiB); max_model_len %d; prefix "
                    "caching %s", names[0], engine.model_config.architecture, config.dtype,
                    "exact" if engine.quantization == "none" else engine.quantization,
                    str(engine.kv_dtype).removeprefix("torch."), engine.device,
                    bm.num_blocks, bm.block_size, bm.num_blocks * bm.block_size, gib,
                    engine.max_model_len, "on" if config.enable_prefix_caching else "off")
        if args.warmup:
            warmup(engine)
        return engine

    async_engine = AsyncEngine.launch(build, max_waiting_requests=args.max_waiting_requests,
                                      log_stats_interval=args.log_stats_interval)
    settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                              max_body_bytes=args.max_body_bytes, ui=args.ui, access=access,
                              stream_stall_timeout_s=args.stream_stall_timeout,
                              strict_tool_arguments=args.strict_tool_arguments,
                              responses_store_size=args.responses_store_size,
                              embedding_pooling=PoolingParams(args.embedding_pooling,
                                                              args.embedding_normalize))
    logger.info("serving %s at http://%s:%d/v1 (API key %s)", ", ".join(names), args.host,
                args.port, "required" if args.api_key else "not required")
    if args.ui:
        logger.info("web UI (chat + engine dashboard) at http://%s:%d/", args.host, args.port)
    logger.info("Host names answered: %s; cross-origin browser requests: %s",
                "loopback" + "".join(f", {h}" for h in access.allowed_hosts)
                if access.loopback_bound or access.allowed_hosts else "any",
                ", ".join(access.allowed_origins) or "none")
    return run_server(async_engine, settings, args.host, args.port, args.graceful_timeout,
                      args.log_level, limits, args.timeout_keep_alive, lora)


def parse_lora_modules(items: Any) -> tuple[tuple[str, str], ...]:
    """``--lora-modules name=path ...`` -> ((name, path), ...); ValueError otherwise."""
    out = []
    for item in items or ():
        name, sep, path = str(item).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        out.append((name, path))
    return tuple(out)


def lora_engine_config(config: Any, args: argparse.Namespace) -> Any:
    """The engine config with LoRA on when any LoRA option asks for it."""
    enable = bool(args.enable_lora or args.lora_modules or args.lora_dir
                  or args.allow_any_lora_path)
    return dataclasses.replace(config, enable_lora=enable, max_loras=args.max_loras,
                               max_lora_rank=args.max_lora_rank)


def _serve_on_ray(args: argparse.Namespace) -> int:
    """``--ray``: N engine replicas behind Ray Serve (``roseinfer.ray_serve``).

    Each replica runs ``--num-threads`` torch threads (default: this machine's cores
    shared out) and reserves as many Ray CPUs. The web UI is not served (each replica
    would show only its own engine).
    """
    from roseinfer.ray_serve import require_ray

    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or max(1, (cores or 1) // args.num_replicas)
    local = args.ray_address is None and not os.environ.get("RAY_ADDRESS")
    if local and args.num_replicas * threads > (os.cpu_count() or 1):
        raise ValueError(f"{args.num_replicas} replicas x {threads} threads need "
                         f"{args.num_replicas * threads} CPUs; this machine has "
                         f"{os.cpu_count()}: lower --num-replicas or --num-threads")
    try:
        require_ray()
        args.api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ)
    except (ImportError, ValueError) as exc:
        print(f"roseinfer: error: {exc}", file=sys.stderr)
        return 2
    from roseinfer.server.access import AccessSettings

    try:
        access = AccessSettings(bind_host=args.host, allowed_hosts=tuple(args.allowed_hosts),
                                allowed_origins=tuple(args.allowed_origins),
                                public_metrics=args.public_metrics)
    except ValueError as exc:
        print(f"roseinfer serve: error: {exc}", file=sys.stderr)
        return 2
    from roseinfer.ray_serve.app import serve_forever
    from roseinfer.ray_serve.options import ServeOptions

    config = dataclasses.replace(engine_config_from_args(args), num_threads=threads)
    options = ServeOptions(
        num_replicas=args.num_replicas, routing=args.routing, replica_cpus=float(threads),
        served_model_names=tuple(args.served_model_name or (default_model_name(args.model),)),
        api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes, log_stats_interval=args.log_stats_interval,
        warmup=args.warmup, stream_stall_timeout_s=args.stream_stall_timeout, access=access)
    return serve_forever(config, options, args.host, args.port, args.ray_address)
