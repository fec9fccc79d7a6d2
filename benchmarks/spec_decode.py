"""N-gram speculative decoding on vs off: decode tok/s on copy-heavy and copy-free text.

Workloads (chat prompts for the default model, greedy unless said, each request ends at
EOS or ``--max-tokens``):

* ``repeat``: repeat a ~150-word passage word for word (batch 1);
* ``rename``: rename a function in a ~30-line code block, answering with the whole code
  (batch 1);
* ``nocopy``: open-ended writing with nothing in the prompt to copy (batch 1);
* ``nocopy-t1``: the same sampled at temperature 1 (seeded): n-grams still match here and
  there, but their drafts are mostly rejected (batch 1);
* ``repeat16``: 16 concurrent ``repeat`` requests, each with its own passage (the story
  told from another sentence on), all submitted at once.

Two engines (speculation off / on, same options otherwise) run each workload in
interleaved rounds (off, on, off, on, ...; not step by step: switching engines every
step makes every step start with cold caches, which costs the shorter plain steps
more); decode tok/s = tokens made by steps that computed no prompt token / the time of
those steps, and the table gives medians over ``--rounds``. The output is the same with
and without speculation (greedy, and seeded sampling): the script checks it.

``--oracle`` adds a third engine whose drafter knows the answer: every decoding request
drafts the next ``num_speculative_tokens`` tokens of its output (taken from the run
without speculation), so every draft is accepted. No drafter can do better at the same
step costs: its speedup is the ceiling of speculation for the workload on this machine.

    .venv/bin/python benchmarks/spec_decode.py --num-threads 1 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 8, \\
                               "prompt_lookup_max": 6, "prompt_lookup_min": 3}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from roseinfer.bench.oracle import OracleDrafter
from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams

DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 6, '
                '"prompt_lookup_min": 3}')
SENTENCES = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind.",
    "Every evening the keeper climbed the spiral stairs to light the great lamp.",
    "Ships passing in the night relied on its steady beam to avoid the rocks below.",
    "In the village, people said the keeper had not spoken to anyone in years.",
    "Children dared each other to knock on his door, but none of them ever did.",
    "One winter a storm knocked out the power across the whole coast.",
    "The keeper lit the lamp by hand and kept it burning until dawn.",
    "A fishing boat that had lost its way followed the light safely into the harbour.",
    "The next morning the fishermen walked up the hill to thank him.",
    "He opened the door, nodded once, and offered them a cup of tea.",
    "From then on the villagers visited him every Sunday with bread and news.",
    "The lighthouse still stands today, and its lamp has never once gone dark.",
]
CODE = '''def compute_total(prices, tax_rate):
    """Return the total price of a basket including tax."""
    subtotal = 0.0
    for price in prices:
        if price < 0:
            raise ValueError("prices must be non-negative")
        subtotal += price
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def apply_discount(total, percent):
    """Apply a percentage discount to a total."""
    if not 0 <= percent <= 100:
        raise ValueError("percent must be between 0 and 100")
    return round(total * (1 - percent / 100), 2)


def checkout(basket, tax_rate=0.2, discount=0):
    """Compute the final amount to pay for a basket of items."""
    prices = [item["price"] * item["quantity"] for item in basket]
    total = compute_total(prices, tax_rate)
    if discount:
        total = apply_discount(total, discount)
    return total


if __name__ == "__main__":
    basket = [{"price": 2.5, "quantity": 4}, {"price": 10.0, "quantity": 1}]
    print(compute_total([item["price"] for item in basket], 0.2))
    print(checkout(basket, discount=10))
'''
NOCOPY = [
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain why the sky is blue to a ten-year-old, in a few paragraphs.",
    "Give me some advice for my first day at a new job.",
]


def passage(i: int) -> str:
    """The story told from its i-th sentence on (then from the start): 0 is the story."""
    k = i % len(SENTENCES)
    return " ".join(SENTENCES[k:] + SENTENCES[:k])


def workload(engine: LLMEngine, name: str) -> list[list[int]]:
    llm = LLM.from_engine(engine)

    def chat(text: str) -> list[int]:
        return llm.render_chat([{"role": "user", "content": text}])

    if name == "repeat":
        return [chat("Repeat the following passage word for word, and nothing else:\n\n"
                     + passage(0))]
    if name == "repeat16":
        return [chat("Repeat the following passage word for word, and nothing else:\n\n"
                     + passage(i)) for i in range(16)]
    if name == "rename":
        return [chat("Rename the function compute_total to sum_prices everywhere in this "
                     "code and reply with the whole updated code:\n\n```python\n" + CODE
                     + "```")]
    if name in ("nocopy", "nocopy-t1"):
        return [chat(NOCOPY[0])]
    raise ValueError(f"unknown workload {name!r}")


def sampling(name: str, max_tokens: int) -> SamplingParams:
    """Greedy, except ``nocopy-t1``: temperature 1 with a seed (the same tokens with and
    without speculation), text where drafts are mostly rejected."""
    if name == "nocopy-t1":
        return SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@dataclass
class Run:
    decode_tok_s: float
    output_tok_s: float
    tokens: int
    decode_steps: int
    drafted: int
    accepted: int
    outputs: list[list[int]]


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Run:
    """The workload on one engine, from an empty prefix cache to the last token."""
    engine.block_manager.reset_prefix_cache()
    before = engine.get_stats()
    ids = []
    for p in prompts:
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], p, params)
    decode_t, decode_tokens, decode_steps = 0.0, 0, 0
    finals: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        prefill = any(r.num_computed_tokens < r.num_prompt_tokens
                      for r in sched.running + list(sched.waiting))
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not prefill:
            decode_t += dt
            decode_tokens += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
            decode_steps += 1
        for o in outs:
            if o.finished:
                finals[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - start
    after = engine.get_stats()
    outputs = [finals[i] for i in ids]
    total = sum(len(o) for o in outputs)
    return Run(decode_tokens / decode_t if decode_t else 0.0, total / wall, total, decode_steps,
               after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
               after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
               outputs)


def cpu_description() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "unknown CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile")
             if f in flags]
    return f"{model} ({', '.join(shown) or 'no AVX2'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--workloads", nargs="+",
                    default=["repeat", "rename", "nocopy", "nocopy-t1", "repeat16"])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--oracle", action="store_true",
                    help="also run a drafter that knows the output (the ceiling)")
    ap.add_argument("--output", default="benchmarks/results/spec_decode.json")
    args = ap.parse_args()

    base = dict(model=args.model, num_threads=args.num_threads,
                quantization=args.quantization)
    engines = {"off": LLMEngine(EngineConfig(**base)),
               "on": LLMEngine(EngineConfig(**base, speculative_config=args.speculative_config))}
    spec = json.loads(args.speculative_config)
    if args.oracle:
        engines["oracle"] = LLMEngine(EngineConfig(
            **base, speculative_config=json.dumps({**spec, "adaptive": False})))
    for engine in engines.values():  # warm-up
        run_once(engine, workload(engine, "nocopy"), sampling("nocopy", 8))
    print(f"CPU: {cpu_description()}; threads {args.num_threads}; "
          f"speculative_config {args.speculative_config}")
    rows = []
    for name in args.workloads:
        prompts = workload(engines["off"], name)
        runs: dict[str, list[Run]] = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode in engines:  # interleaved runs: all see the machine's load
                runs[mode].append(run_once(engines[mode], prompts,
                                           sampling(name, args.max_tokens)))
                if mode == "off" and "oracle" in engines:
                    answers = {tuple(p): o for p, o in
                               zip(prompts, runs["off"][0].outputs, strict=True)}
                    drafter = engines["oracle"].spec
                    assert drafter is not None
                    drafter.propose = OracleDrafter(  # type: ignore[method-assign]
                        answers, spec["num_speculative_tokens"]).propose
        same = all(r.outputs == runs["off"][0].outputs for rs in runs.values() for r in rs)
        off = statistics.median(r.decode_tok_s for r in runs["off"])
        on = statistics.median(r.decode_tok_s for r in runs["on"])
        last = runs["on"][-1]
        row = {"workload": name, "batch": len(prompts), "tokens": last.tokens,
               "off_decode_tok_s": off, "on_decode_tok_s": on, "speedup": on / off,
               "drafted": last.drafted, "accepted": last.accepted,
               "acceptance": last.accepted / last.drafted if last.drafted else 0.0,
               "tokens_per_step_on": last.tokens / max(1, last.decode_steps) / len(prompts),
               "identical_output": same,
               "off_runs": [r.decode_tok_s for r in runs["off"]],
               "on_runs": [r.decode_tok_s for r in runs["on"]]}
        if "oracle" in runs:
            oracle_tok_s = statistics.median(r.decode_tok_s for r in runs["oracle"])
            row.update(oracle_decode_tok_s=oracle_tok_s, oracle_speedup=oracle_tok_s / off,
                       oracle_runs=[r.decode_tok_s for r in runs["oracle"]])
        rows.append(row)
        print(f"{name:9s} batch {len(prompts):2d}  tokens {last.tokens:5d}  off {off:7.1f}  "
              f"on {on:7.1f} tok/s  x{on / off:4.2f}  accepted {last.accepted}/{last.drafted} "
              f"drafted  "
              f"identical {same}"
              + (f"  oracle {row['oracle_decode_tok_s']:7.1f} tok/s x{row['oracle_speedup']:4.2f}"
                 if "oracle" in runs else ""), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_description(), "threads": args.num_threads,
                               "speculative_config": args.speculative_config,
                               "max_tokens": args.max_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
