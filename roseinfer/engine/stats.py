"""EngineStats: counters and gauges the engine keeps for logs and /metrics, and the
periodic stats log line."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    num_total_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    num_held: int = 0  # unfinished sequences held because their reader is behind
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
    # Persistent prefix cache (kv_cache_dir): prompt tokens loaded from disk, lookups that
    # found nothing there, bytes read and written, files rejected (corrupt / foreign).
    kv_disk_hit_tokens: int = 0
    kv_disk_misses: int = 0
    kv_disk_read_bytes: int = 0
    kv_disk_written_bytes: int = 0
    kv_disk_rejected: int = 0
    # Speculative decoding (vLLM's names): verifications with drafts, drafted and
    # accepted tokens, and accepted tokens by draft position (0 = the first draft).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)

    def record_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def record_spec_decode(self, drafted: int, accepted: int) -> None:
        """One verification of ``drafted`` drafts, the first ``accepted`` accepted."""
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += drafted
        self.spec_decode_num_accepted_tokens += accepted
        per_pos = self.spec_decode_accepted_per_pos
        if len(per_pos) < drafted:
            per_pos.extend([0] * (drafted - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        d = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / d if d else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


def log_stats(logger: logging.Logger, s: EngineStats, elapsed: float,
              previous: tuple[int, int]) -> tuple[int, int]:
    """The periodic stats log (vLLM's shape): throughputs since ``previous`` (prompt and
    generation token totals ``elapsed`` seconds ago), logged only when something
    happened; returns the totals for the next call."""
    prompt, gen = s.prompt_tokens_total, s.generation_tokens_total
    if (prompt, gen) != previous or s.num_running or s.num_waiting:
        logger.info(
            "running: %d, waiting: %d, KV cache usage: %.1f%%, prompt throughput: %.1f tok/s, "
            "generation throughput: %.1f tok/s, prefix cache hit rate: %.1f%%",
            s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
            (prompt - previous[0]) / elapsed, (gen - previous[1]) / elapsed,
            100 * s.prefix_cache_hit_rate,
        )
        if s.spec_decode_num_drafts:  # speculative decoding, since the start
            logger.info(
                "speculative decoding: acceptance rate %.1f%% (%d of %d drafted tokens), "
                "mean accepted per draft: %.2f, per position: %s",
                100 * s.spec_decode_acceptance_rate, s.spec_decode_num_accepted_tokens,
                s.spec_decode_num_draft_tokens,
                s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts,
                ", ".join(f"{n / s.spec_decode_num_drafts:.2f}"
                          for n in s.spec_decode_accepted_per_pos))
    return prompt, gen
