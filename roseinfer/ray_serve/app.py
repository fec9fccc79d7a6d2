"""The Ray Serve application: an ``Ingress`` in front of N ``EngineReplica`` replicas.

Three ways to run it:

- ``roseinfer serve --ray --num-replicas 2 [engine and server flags]``: starts a local
  Ray (or joins ``--ray-address``), serves until SIGINT/SIGTERM (``serve_forever``);
- ``serve run roseinfer.ray_serve.app:build_app model=... num_replicas=2`` (Ray's CLI;
  ``AppArgs`` lists the keys), or a Serve config file naming the same import path;
- from Python: ``serve.run(build(EngineConfig(...), ServeOptions(...)))``.

::

    client ──HTTP──▶ Ray Serve proxy ──▶ Ingress (1 replica: tokenize, hash prefix blocks)
                                            │ DeploymentHandle(stream=True).forward
                                            │ PrefixAffinityRouter picks the replica
                               ┌────────────┴────────────┐
                               ▼                         ▼
                     EngineReplica #1             EngineReplica #2 ...
                     roseinfer FastAPI app        (each: AsyncEngine + its own
                     over its AsyncEngine          KV pool and prefix cache)
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from roseinfer.config import EngineConfig
from roseinfer.ray_serve.ingress import Ingress
from roseinfer.ray_serve.ingress_guard import IngressLimits
from roseinfer.ray_serve.options import AppArgs, ServeOptions
from roseinfer.ray_serve.replica import EngineReplica
from roseinfer.ray_serve.router import PrefixAffinityRouter

logger = logging.getLogger("roseinfer.ray_serve")
APP_NAME = "roseinfer"
INGRESS_MAX_ONGOING = 1024  # the ingress only relays: let the replicas' queues decide


def build(config: EngineConfig, options: ServeOptions) -> Application:
    """The application graph for ``serve.run``.

    A model path that exists here is made absolute (a replica has its own working
    directory); ``num_threads`` unset becomes the replica's CPUs, never all the cores.
    """
    model = config.model
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    threads = config.num_threads or max(1, round(options.replica_cpus))
    config = dataclasses.replace(config, model=model, num_threads=threads)
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={"routing": options.routing,
                               "imbalance_threshold": options.imbalance_threshold})
    replica = serve.deployment(EngineReplica).options(
        name="EngineReplica", num_replicas=options.num_replicas,
        ray_actor_options={"num_cpus": options.replica_cpus},
        max_ongoing_requests=options.max_ongoing_requests, request_router_config=router,
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=max(30.0, 5 * options.health_check_period_s),
        graceful_shutdown_timeout_s=5.0)
    ingress = serve.deployment(Ingress).options(
        name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING)
    limits = IngressLimits(options.api_key, options.max_body_bytes,
                           options.stream_stall_timeout_s, options.access.public_metrics)
    return ingress.bind(replica.bind(config, options), config.model, config.block_size,
                        options.num_replicas, options.max_retries, config.weight_cache, limits)


def build_app(args: dict[str, Any]) -> Application:
    """``serve run roseinfer.ray_serve.app:build_app key=value ...`` (keys: ``AppArgs``)."""
    parsed = AppArgs.model_validate(args)
    return build(parsed.engine_config(), parsed.serve_options())


def serve_forever(config: EngineConfig, options: ServeOptions, host: str, port: int,
                  address: str | None = None) -> int:
    """Start (or join) Ray, deploy the app at http://host:port, serve until a signal."""
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        logger.info("deploying %d replica(s), routing %s", options.num_replicas, options.routing)
        serve.run(build(config, options), name=APP_NAME, route_prefix="/")
        logger.info("serving %s at http://%s:%d/v1 through Ray Serve (%d replicas)",
                    ", ".join(options.served_model_names), host, port, options.num_replicas)
        _wait_for_signal()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
