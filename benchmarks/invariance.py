"""Batch invariance, measured: does a request's text change with what runs beside it?

Issue #11's measurement on the default model: 24 prompts (half of them sharing a
~150-word prefix), 48 tokens each, run alone (one request in the engine, cold prefix
cache) and then

* greedy, in a batch of 64 (the 24 plus 40 load requests of other lengths);
* greedy, after another request with the same prefix filled the prefix cache;
* greedy, with a prefill chunk budget of 32 tokens (prompts computed in many chunks);
* seeded sampling (temperature 0.9, top_p 0.95, own seed) in a batch of 64.

Prints, per quantization, how many of the 24 requests produced different tokens than
alone (the contract is 0 everywhere for the default options; docs/CONTRACTS.md).

    .venv/bin/python benchmarks/invariance.py [--quantization auto fp16 none]
"""

from __future__ import annotations

import argparse
import random

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.sampling_params import SamplingParams

WORDS = ("the a river city light table garden music winter letter ocean story morning "
         "paper window friend market yellow quiet number travel forest stone").split()
NUM_TARGETS, NUM_LOAD, MAX_TOKENS = 24, 40, 48


def prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(targets, load): half the targets share one ~150-word prefix."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(150))
    targets = []
    for i in range(NUM_TARGETS):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
        targets.append(f"{prefix} {tail}" if i % 2 == 0 else f"Story {i}: {tail}")
    load = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 200))) for _ in range(NUM_LOAD)]
    return targets, load


def run(engine: LLMEngine, texts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    """Submit all at once, step to completion; token ids per request, in order."""
    for i, (text, p) in enumerate(zip(texts, params, strict=True)):
        engine.add_request(f"r{i}", text, p)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    engine.block_manager.reset_prefix_cache()
    return [done[f"r{i}"] for i in range(len(texts))]


def alone(engine: LLMEngine, texts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [run(engine, [t], [p])[0] for t, p in zip(texts, params, strict=True)]


def measure(quantization: str) -> dict[str, int]:
    targets, load = prompts()
    greedy = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * NUM_TARGETS
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(NUM_TARGETS)]
    load_params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 16 * (i % 3),
                                  ignore_eos=True) for i in range(NUM_LOAD)]
    engine = LLMEngine(EngineConfig(quantization=quantization))

    def differ(a: list[list[int]], b: list[list[int]]) -> int:
        return sum(x != y for x, y in zip(a, b, strict=True))

    ref = alone(engine, targets, greedy)
    ref_seeded = alone(engine, targets, seeded)
    mixed = run(engine, load[:20] + targets + load[20:], load_params[:20] + greedy + load_params[20:])
    mixed_seeded = run(engine, load[:20] + targets + load[20:],
                       load_params[:20] + seeded + load_params[20:])
    cached = []
    for t, p in zip(targets, greedy, strict=True):  # the prefix was computed by another request
        cached.append(run_after_warm(engine, t, p))
    chunked = alone(LLMEngine(EngineConfig(quantization=quantization, max_num_batched_tokens=32)),
                    targets, greedy)
    return {
        "greedy, batch of 64": differ(ref, mixed[20:20 + NUM_TARGETS]),
        "greedy, prefix cached by another request": differ(ref, cached),
        "greedy, chunk budget 32": differ(ref, chunked),
        "seeded sampling, batch of 64": differ(ref_seeded, mixed_seeded[20:20 + NUM_TARGETS]),
    }


def run_after_warm(engine: LLMEngine, text: str, params: SamplingParams) -> list[int]:
    """Run a request sharing ``text``'s first 100 words first, then ``text`` itself (its
    prefix blocks are hits), without resetting the cache in between."""
    warm = " ".join(text.split()[:100]) + " and then"
    engine.add_request("warm", warm, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return run(engine, [text], [params])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", nargs="+", default=["auto"])
    args = ap.parse_args()
    rows = {q: measure(q) for q in args.quantization}
    names = list(next(iter(rows.values())))
    print(f"| a request run ... vs alone ({NUM_TARGETS} requests) | "
          + " | ".join(f"`{q}`" for q in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{rows[q][n]} differ" for q in rows) + " |")


if __name__ == "__main__":
    main()
