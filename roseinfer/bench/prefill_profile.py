"""Where one prompt's prefill time goes.

Prefills ``prompt_len`` fresh random tokens (no prefix reuse) in the engine's own chunks
(``max_num_batched_tokens``), up to the first (greedy) token, ``repeats`` times after a
warm-up, and reports the medians: the wall time and, when the model runs in the C++
decoder stack, its own timers (GEMMs, attention, KV writes with the rotary embedding,
row ops) and its GEMM time by linear (qkv, o, gate/up, down over all layers) with their
GFLOP/s; the rest is the embedding, the LM head of the sampled row and Python.  The KV
blocks the prompt takes are backed before each run (``touch_next_blocks``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from roseinfer.bench.bandwidth import LINEAR_KINDS, linear_weights
from roseinfer.bench.throughput import random_prompts, touch_next_blocks
from roseinfer.engine.engine import LLMEngine
from roseinfer.sampling_params import SamplingParams

_STACK_PARTS = ("gemm", "attention", "kv_write", "row_ops")


def run_prefill_profile(engine: LLMEngine, prompt_len: int, repeats: int = 3,
                        seed: int = 0) -> dict[str, Any]:
    """Profile ``repeats`` prefills of ``prompt_len`` tokens (medians; one warm-up first)."""
    if prompt_len < 1 or repeats < 1:
        raise ValueError("prompt_len and repeats must be >= 1")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    runs: list[tuple[float, ...]] = []
    for r in range(repeats + 1):
        prompt = random_prompts(1, prompt_len, vocab, seed + r)[0]
        touch_next_blocks(engine, [prompt_len + 1])
        engine.add_request(engine.next_request_id(), prompt, params)
        stack = getattr(engine.runner.model, "_stack", None)  # built on the first step
        if stack is not None:
            stack.set_profiling(True)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - t0
        parts: list[float] = []
        if stack is not None:
            parts = [*stack.profile(), *stack.linear_profile()]
            stack.set_profiling(False)
        if r > 0:  # the first run warms up (and builds the stack)
            runs.append((wall, *parts))
    med = [statistics.median(c) for c in zip(*runs, strict=True)]
    wall = med[0]
    out: dict[str, Any] = {"prompt_len": prompt_len, "repeats": repeats, "ms": wall * 1e3,
                           "tok_s": prompt_len / wall, "stack_ms": {}, "linears": {}}
    if len(med) > 1:  # the stack's timers came with the wall time
        out["stack_ms"] = {k: v * 1e3 for k, v in zip(_STACK_PARTS, med[1:5], strict=True)}
        weights = linear_weights(engine.model_config)
        out["linears"] = {k: {"ms": v * 1e3,
                              "gflop_s": 2 * weights[k] * prompt_len / v / 1e9 if v else 0.0}
                          for k, v in zip(LINEAR_KINDS, med[5:9], strict=True)}
    return out


def format_prefill_profile(p: dict[str, Any]) -> str:
    ms = p["ms"]
    lines = [f"prefill of {p['prompt_len']} tokens (median of {p['repeats']}): {ms:.1f} ms, "
             f"{p['tok_s']:.1f} tok/s"]
    if p["stack_ms"]:
        lines.append("  the C++ stack's timers:")
        for k, v in p["stack_ms"].items():
            lines.append(f"    {k:<10} {v:8.2f} ms  {100 * v / ms:5.1f}%")
        rest = ms - sum(p["stack_ms"].values())
        lines.append(f"    {'rest':<10} {rest:8.2f} ms  {100 * rest / ms:5.1f}%  "
                     "(embedding, the sampled row's LM head, Python)")
        lines.append("  the stack's GEMMs by linear (all layers):")
        for k, v in p["linears"].items():
            lines.append(f"    {k:<10} {v['ms']:8.2f} ms  {v['gflop_s']:7.1f} GFLOP/s")
    return "\n".join(lines)
