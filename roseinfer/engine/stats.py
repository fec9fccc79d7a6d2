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
