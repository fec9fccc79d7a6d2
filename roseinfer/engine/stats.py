"""EngineStats: counters and gauges the engine keeps for logs and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    num_total_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    computed_tokens_total: int = 0  # tokens run through the model (prefill + decode)
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens served from cache
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count

    def record_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0
