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

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from roseinfer.config import EngineConfig
from roseinfer.ray_serve.routing_policy import RoutingMode
from roseinfer.server.access import AccessSettings
from roseinfer.server.startup import default_model_name


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
    stream_stall_timeout_s: float = 60.0  # a client reading nothing this long is cut off
    access: AccessSettings = AccessSettings()  # Host / Origin / public /metrics, per replica

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
    """``serve run ... build_app key=value`` arguments, flat: every ``EngineConfig`` field
    (validated and coerced by pydantic against the dataclass itself, ``num_threads``
    defaulting to 1 per replica) plus the serve options below; other keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(num_threads=1))
    num_replicas: int = Field(2, ge=1)
    routing: RoutingMode = "prefix"
    imbalance_threshold: int = Field(4, ge=0)
    replica_cpus: float | None = Field(None, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    max_retries: int = Field(2, ge=0)
    served_model_name: str | None = None  # one name, or several separated by commas
    api_key: str | None = None
    max_waiting_requests: int = Field(256, ge=1)
    stream_stall_timeout_s: float = Field(60.0, ge=0)
    warmup: bool = True
    # Who may talk to the app (server/access.py): the address Serve's HTTP proxy is bound
    # to, Host names and browser origins answered besides loopback ones (comma-separated).
    bind_host: str = "127.0.0.1"
    allowed_hosts: str | None = None
    allowed_origins: str | None = None
    public_metrics: bool = False

    @model_validator(mode="before")
    @classmethod
    def _engine_keys(cls, data: Any) -> Any:
        """Gather the flat keys that name ``EngineConfig`` fields into ``engine``."""
        if not isinstance(data, dict):
            return data
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = {"num_threads": 1} | {k: v for k, v in data.items() if k in names}
        return {k: v for k, v in data.items() if k not in names} | {"engine": engine}

    def engine_config(self) -> EngineConfig:
        return self.engine

    def serve_options(self) -> ServeOptions:
        names = tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())
        return ServeOptions(
            num_replicas=self.num_replicas, routing=self.routing,
            imbalance_threshold=self.imbalance_threshold,
            replica_cpus=float(self.engine.resolved_num_threads() if self.replica_cpus is None
                               else self.replica_cpus),
            max_ongoing_requests=self.max_ongoing_requests, max_retries=self.max_retries,
            served_model_names=names or (default_model_name(self.engine.model),),
            api_key=self.api_key, max_waiting_requests=self.max_waiting_requests,
            warmup=self.warmup, stream_stall_timeout_s=self.stream_stall_timeout_s,
            access=AccessSettings(bind_host=self.bind_host,
                                  allowed_hosts=_split(self.allowed_hosts),
                                  allowed_origins=_split(self.allowed_origins),
                                  public_metrics=self.public_metrics))


def _split(names: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (names or "").split(",") if n.strip())
