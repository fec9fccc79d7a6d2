"""``EngineReplica``: one roseinfer engine and its own HTTP app inside a Ray Serve replica.

The replica builds an ``AsyncEngine`` exactly as ``roseinfer serve`` does (on the
engine thread, warmed up) and the same FastAPI app over it (``create_app``):
validation, OpenAI shapes, SSE, errors, metrics and the API key are roseinfer's own
code, not a copy. The ingress calls ``forward`` through a Ray Serve handle with the
HTTP request as a record; ``asgi_bridge.call_app`` runs it through the app and the
answer goes back as a stream of items (the head, then body chunks).

Ray Serve calls ``check_health`` every ``health_check_period_s``: a dead engine loop
fails it, and Serve replaces the replica, as it does a replica whose process died.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from roseinfer.config import EngineConfig
from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.engine import LLMEngine
from roseinfer.ray_serve.asgi_bridge import ForwardedRequest, ResponseHead, call_app
from roseinfer.ray_serve.options import ServeOptions
from roseinfer.server.app import create_app
from roseinfer.server.startup import warmup
from roseinfer.server.state import ServerSettings

logger = logging.getLogger("roseinfer.ray_serve")


class EngineReplica:
    """One engine replica (deployed by ``app.build``)."""

    def __init__(self, config: EngineConfig, options: ServeOptions) -> None:
        def build() -> LLMEngine:  # on the engine thread (see AsyncEngine.launch)
            engine = LLMEngine(config)
            if options.warmup:
                warmup(engine)
            return engine

        self.engine = AsyncEngine.launch(build, max_waiting_requests=options.max_waiting_requests,
                                         log_stats_interval=options.log_stats_interval)
        settings = ServerSettings(served_model_names=options.served_model_names,
                                  api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                                  stream_stall_timeout_s=options.stream_stall_timeout_s,
                                  access=options.access)
        self.app = create_app(self.engine, settings)
        bm = self.engine.engine.block_manager
        logger.info("replica %s ready: %d KV blocks x %d tokens", self._replica_id(),
                    bm.num_blocks, bm.block_size)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """Serve one HTTP request with the app: its ``ResponseHead``, then body chunks."""
        async for item in call_app(self.app, request):
            yield item

    def stats(self, replica_slot: int | None = None) -> dict[str, Any]:
        """This replica's identity and engine counters (``replica_slot`` is the router's)."""
        s = self.engine.stats()
        return {
            "replica_id": self._replica_id(),
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "pid": os.getpid(),
            "healthy": self.engine.healthy,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "prompt_tokens": s.prompt_tokens_total,
            "generation_tokens": s.generation_tokens_total,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "finished": dict(s.finished),  # finish reason -> sequences
        }

    def check_health(self) -> None:
        if not self.engine.healthy:
            reason = self.engine.dead_reason
            raise RuntimeError(f"the engine loop is not running: {reason!r}")

    def __del__(self) -> None:  # Serve stops the replica: stop the engine thread
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    @staticmethod
    def _replica_id() -> str:
        return serve.get_replica_context().replica_id.unique_id
