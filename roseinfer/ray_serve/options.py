"""Options of the Ray Serve application: the engine's, the server's, the router's.

``AppArgs`` is what ``serve run roseinfer.ray_serve.app:build_app key=value ...`` (or
a Serve config file's ``args:``) passes: flat, strings coerced by pydantic, unknown
keys refused. ``roseinfer serve --ray`` builds the same two records from its flags:
an ``EngineConfig`` (each replica builds its engine from it) and ``ServeOptions``.

Threads and CPUs: each replica runs torch with ``num_threads`` threads (default 1)
and reserves as many Ray CPUs (``replica_cpus`` overrides), so N replicas on one
machine never oversubscribe its cores unless asked to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from roseinfer.config import EngineConfig
from roseinfer.ray_serve.routing_policy import RoutingMode


@dataclass(frozen=True)
class ServeOptions:
    """Deployment and HTTP options (everything but the engine's)."""

    num_replicas: int = 2
    routing: RoutingMode = "prefix"
    imbalance_threshold: int = 4  # in-flight calls above the least loaded replica
    replica_cpus: float = 1.0  # Ray CPUs each engine replica reserves
    max_ongoing_requests: int = 64  # Ray Serve's cap per engine replica
    max_retries: int = 2  # re-sends of a call whose replica died before any answer byte
    health_check_period_s: float = 2.0
    served_model_names: tuple[str, ...] = ("SmolLM2-135M-Instruct",)
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_body_bytes: int = 4 << 20
    log_stats_interval: float = 10.0
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.routing not in ("prefix", "round_robin"):
            raise ValueError(f"routing must be 'prefix' or 'round_robin', got {self.routing!r}")
        if self.max_retries < 0 or self.imbalance_threshold < 0:
            raise ValueError("max_retries and imbalance_threshold must be >= 0")
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")


class AppArgs(BaseModel):
    """``serve run ... build_app key=value`` arguments (flat: engine + serve options)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # engine (EngineConfig fields; roseinfer serve's flags of the same names)
    model: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantization: Literal["auto", "none", "fp16", "fp16+bf16", "int8"] = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = Field(16, ge=1)
    kv_cache_memory_gb: float = Field(1.0, gt=0)
    num_kv_blocks: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(256, ge=1)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int = Field(1, ge=1)
    seed: int = 0
    speculative_config: str | None = None
    weight_cache: bool | None = None
    # serve
    num_replicas: int = Field(2, ge=1)
    routing: RoutingMode = "prefix"
    imbalance_threshold: int = Field(4, ge=0)
    replica_cpus: float | None = Field(None, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    max_retries: int = Field(2, ge=0)
    served_model_name: str | None = None  # one name, or several separated by commas
    api_key: str | None = None
    max_waiting_requests: int = Field(256, ge=1)
    warmup: bool = True

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size,
            kv_cache_memory_gb=self.kv_cache_memory_gb, num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            num_threads=self.num_threads, seed=self.seed,
            speculative_config=self.speculative_config, weight_cache=self.weight_cache)

    def serve_options(self) -> ServeOptions:
        from roseinfer.server.cli import default_model_name

        names = tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())
        return ServeOptions(
            num_replicas=self.num_replicas, routing=self.routing,
            imbalance_threshold=self.imbalance_threshold,
            replica_cpus=float(self.num_threads if self.replica_cpus is None
                               else self.replica_cpus),
            max_ongoing_requests=self.max_ongoing_requests, max_retries=self.max_retries,
            served_model_names=names or (default_model_name(self.model),),
            api_key=self.api_key, max_waiting_requests=self.max_waiting_requests,
            warmup=self.warmup)
