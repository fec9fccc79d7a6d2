"""Shared-prefix workload: prefix caching on vs off, side by side in one run.

A long system prompt (about --prefix-tokens tokens) followed by --num-requests
different short questions, all submitted at once to the offline engine. Reports
TTFT (p50 / p90 / max), total wall time and prompt tokens actually computed.

    .venv/bin/python benchmarks/prefix_cache.py [--prefix-tokens 1000 --num-requests 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.sampling_params import SamplingParams

WORDS = ("system policy user tool answer careful concise data report table value "
         "result context query search document summary format reply detail step").split()


def make_workload(engine: LLMEngine, prefix_tokens: int, num_requests: int, question_tokens: int,
                  seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tok = engine.tokenizer
    assert tok is not None
    prefix: list[int] = []
    while len(prefix) < prefix_tokens:
        prefix += tok.encode(" ".join(rng.choice(WORDS) for _ in range(64)) + ".\n",
                             add_special_tokens=False)
    prefix = prefix[:prefix_tokens]
    prompts = []
    for i in range(num_requests):
        q = tok.encode(f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(80)),
                       add_special_tokens=False)[:question_tokens]
        prompts.append(prefix + q)
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    engine.block_manager.reset_prefix_cache()
    computed0 = engine.stats.computed_tokens_total
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params, arrival_time=start)
    ttfts: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.metrics and out.metrics.first_token_time is not None:
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    total = time.monotonic() - start
    ttfts.sort()
    gen_tokens = len(prompts) * max_tokens
    return {
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "ttft_max": ttfts[-1],
        "total_s": total,
        "computed_tokens": engine.stats.computed_tokens_total - computed0 - gen_tokens
        + len(prompts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=50)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = []
    for caching in (False, True):
        cfg = EngineConfig(model=args.model, enable_prefix_caching=caching,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           quantization=args.quantization)
        engine = LLMEngine(cfg)
        prompts = make_workload(engine, args.prefix_tokens, args.num_requests,
                                args.question_tokens, args.seed)
        run(engine, prompts[:2], 2)  # warm-up
        rows.append(("on" if caching else "off", run(engine, prompts, args.max_tokens)))
        del engine

    print(f"model={args.model or 'default SmolLM2-135M-Instruct'} prefix={args.prefix_tokens} "
          f"question={args.question_tokens} requests={args.num_requests} "
          f"max_tokens={args.max_tokens} quantization={args.quantization or 'default'}")
    print(f"{'caching':8} {'TTFT p50 s':>11} {'TTFT p90 s':>11} {'TTFT max s':>11} "
          f"{'total s':>8} {'prompt tok computed':>20}")
    for name, r in rows:
        print(f"{name:8} {r['ttft_p50']:11.2f} {r['ttft_p90']:11.2f} {r['ttft_max']:11.2f} "
              f"{r['total_s']:8.2f} {r['computed_tokens']:20.0f}")
    off, on = rows[0][1], rows[1][1]
    print(f"speed-up with caching: total {off['total_s'] / on['total_s']:.2f}x, "
          f"TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
