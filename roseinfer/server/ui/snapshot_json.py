"""The body of ``GET /ui/api/snapshot``: an ``EngineSnapshot`` as plain JSON.

The shape is documented in docs/CONTRACTS.md ("Web UI snapshot"); bump
``SNAPSHOT_VERSION`` when a field changes meaning or goes away. Everything here runs
on the web side, from the immutable snapshot (percentiles, the throughput series).
"""

from __future__ import annotations

from typing import Any

from roseinfer.engine.snapshot import HISTORY_S, LATENCY_WINDOW_S, EngineSnapshot

SNAPSHOT_VERSION = 1
QUANTILES = (50, 90, 99)
RATE_WINDOW_S = 3  # the "now" rates: mean of the last complete seconds


def snapshot_json(snap: EngineSnapshot, *, now: float, model: str,
                  healthy: bool) -> dict[str, Any]:
    """``now``: time.monotonic() when served (gives the snapshot's age)."""
    prefill, decode = snap.throughput_series(HISTORY_S)
    return {
        "version": SNAPSHOT_VERSION,
        "model": model,
        "healthy": healthy,
        "age_s": round(max(0.0, now - snap.taken_at), 4),
        "limits": {
            "block_size": snap.block_size,
            "max_num_seqs": snap.max_num_seqs,
            "max_num_batched_tokens": snap.max_num_batched_tokens,
            "max_model_len": snap.max_model_len,
            "prefix_caching": snap.prefix_caching,
            "kv_cache_dtype": snap.kv_cache_dtype,
            "quantization": snap.quantization,
        },
        "requests": {
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "preempted": snap.num_preempted,
            "finished": dict(snap.finished),
        },
        "kv": {
            "total": snap.num_blocks,
            "used": snap.num_used_blocks,
            "cached": snap.num_cached_blocks,
            "free": snap.num_free_blocks,
            "usage": snap.kv_usage,
            "map": snap.block_map,
            "blocks_per_cell": snap.blocks_per_cell,
        },
        "tokens": {
            "prompt_total": snap.prompt_tokens_total,
            "generation_total": snap.generation_tokens_total,
            "computed_total": snap.computed_tokens_total,
            "preemptions_total": snap.num_preemptions_total,
        },
        "throughput": {
            "interval_s": 1,
            "prefill_tok_s": prefill,
            "decode_tok_s": decode,
            "prefill_now": sum(prefill[-RATE_WINDOW_S:]) / RATE_WINDOW_S,
            "decode_now": sum(decode[-RATE_WINDOW_S:]) / RATE_WINDOW_S,
        },
        "latency": {
            "window_s": LATENCY_WINDOW_S,
            "ttft": _percentiles(snap, "ttft"),
            "itl": _percentiles(snap, "itl"),
        },
        "prefix_cache": {
            "queries": snap.prefix_cache_queries,
            "hits": snap.prefix_cache_hits,
            "hit_rate": snap.prefix_cache_hit_rate,
        },
        "in_flight": [
            {
                "id": r.request_id,
                "group_id": r.group_id,
                "state": r.state,
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens,
                "computed_tokens": r.num_computed_tokens,
                "cached_tokens": r.num_cached_tokens,
                "blocks": r.num_blocks,
                "age_s": round(r.age_s, 3),
                "preemptions": r.num_preemptions,
                "max_tokens": r.max_tokens,
            }
            for r in snap.requests
        ],
        "in_flight_total": snap.num_running + snap.num_waiting,
    }


def _percentiles(snap: EngineSnapshot, kind: str) -> dict[str, Any]:
    count, values = snap.latency_percentiles(kind, QUANTILES)
    out: dict[str, Any] = {"count": count}
    for q, v in zip(QUANTILES, values, strict=True):
        out[f"p{q}"] = v
    return out
