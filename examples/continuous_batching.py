"""Continuous batching, visibly: a request joins while others are mid-generation.

Three requests start together; after a few engine steps a fourth is added and joins
the running batch at the next step. Every step prints which requests advanced.

    .venv/bin/python examples/continuous_batching.py [--model PATH]
"""

from __future__ import annotations

import argparse

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    first = {
        "a": "The three primary colours are",
        "b": "def add(a, b):",
        "c": "Paris is the capital of",
    }
    for rid, prompt in first.items():
        engine.add_request(rid, prompt, params)
    late = ("d", "Once upon a time")
    results: dict[str, str] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= 5:
        if step == 5:
            engine.add_request(late[0], late[1], params)
            print(f"step {step}: added request {late[0]!r} while others are generating")
        outputs = engine.step()
        running = sorted(o.request_id for o in outputs)
        print(f"step {step}: advanced {running}")
        for o in outputs:
            if o.finished:
                results[o.request_id] = o.outputs[0].text
        step += 1
    print()
    prompts = {**first, late[0]: late[1]}
    for rid in sorted(results):
        print(f"[{rid}] {prompts[rid]!r} -> {results[rid]!r}")


if __name__ == "__main__":
    main()
