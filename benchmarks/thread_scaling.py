"""What a decode step gains from more threads, piece by piece (wall clock).

    PYTHONPATH=. python benchmarks/thread_scaling.py [--batch 16] [--threads 2]
        [--rounds 6] [--steps 10] [--prompt-len 128] [--model PATH]

One engine (the default model unless --model) decodes ``batch`` greedy streams; blocks of
``steps`` steps alternate between 1 and ``threads`` threads (``torch.set_num_threads``,
the order swapped every round, so both see the same contexts on average). Each block is
split by the C++ decoder stack's own timers (``LlamaStack.set_profiling``): its GEMMs
(activation quantization included), attention, rotary + K/V writes, row ops (norms,
SiLU), and the rest of the step (LM head, embedding, metadata, sampling, scheduler,
outputs). Prints the medians per step (ms) for each thread count and their ratios; a
ratio near the thread count means that piece scales.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.bench.throughput import random_prompts

PIECES = ("step", "gemm", "attention", "rope_kv", "row_ops", "rest")


def measure(batch: int, threads: int, rounds: int, steps: int, prompt_len: int,
            model: str | None) -> dict[int, list[float]]:
    """Median ms per step of each piece, for 1 and ``threads`` threads."""
    eng = LLM(model, num_threads=threads).engine
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    for prompt in random_prompts(batch, prompt_len, eng.model_config.vocab_size, 0):
        eng.add_request(eng.next_request_id(), prompt, params)
    for _ in range(10):  # the prefill and a few decodes
        eng.step()
    stack = getattr(eng.runner.model, "_stack", None)
    if stack is None:
        raise SystemExit("this model has no C++ decoder stack: nothing to split")
    rows: dict[int, list[tuple[float, ...]]] = {1: [], threads: []}
    for r in range(rounds):
        for nt in ((1, threads) if r % 2 == 0 else (threads, 1)):
            torch.set_num_threads(nt)
            for _ in range(2):  # the new team settles
                eng.step()
            stack.set_profiling(True)
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            total = (time.perf_counter() - t0) / steps * 1e3
            parts = [t / steps * 1e3 for t in stack.profile()]
            stack.set_profiling(False)
            rows[nt].append((total, *parts, total - sum(parts)))
    return {nt: [statistics.median(x[i] for x in got) for i in range(len(PIECES))]
            for nt, got in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    if a.threads < 2:
        ap.error("--threads must be at least 2")
    med = measure(a.batch, a.threads, a.rounds, a.steps, a.prompt_len, a.model)
    print(f"batch {a.batch}, prompt {a.prompt_len}, {a.rounds} rounds of {a.steps} steps, "
          "medians, ms a step")
    for nt, values in med.items():
        print(f"{nt} thread(s): " + "  ".join(
            f"{k} {v:.2f}" for k, v in zip(PIECES, values, strict=True)))
    ratios = zip(PIECES, med[1], med[a.threads], strict=True)
    print(f"1 / {a.threads} threads: " + "  ".join(
        f"{k} {one / many:.2f}x" for k, one, many in ratios))


if __name__ == "__main__":
    main()
