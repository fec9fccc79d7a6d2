"""Output tok/s of JSON-schema-constrained requests vs unconstrained ones (offline engine).

For each concurrency C, C copies of a chat prompt run as one batch twice: unconstrained
(``ignore_eos``, so every request makes ``--max-tokens`` tokens) and constrained by a
JSON schema that cannot be complete before ``--max-tokens`` (an array with many
required items), so both runs make the same number of tokens and only the per-step
cost differs. Reported: output tok/s (prefill included) and their ratio; each figure is
the best of ``--repeat`` runs. ``--realistic`` adds a run with a small schema whose
requests finish on their own ("stop").

    python benchmarks/structured_outputs.py --concurrency 1 16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_outputs import StructuredOutputsParams

LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 24}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                               "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False,
}
PROMPT = "List some people with their name, age and city, as JSON."


def run(llm: LLM, prompt: list[int], n: int, params: SamplingParams) -> tuple[float, int]:
    """(seconds, output tokens) of n copies of the prompt as one batch."""
    start = time.perf_counter()
    outs = llm.generate([prompt] * n, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def best_rate(llm: LLM, prompt: list[int], n: int, params: SamplingParams,
              repeat: int) -> tuple[float, int]:
    rates = [run(llm, prompt, n, params) for _ in range(repeat)]
    return max(tokens / secs for secs, tokens in rates), rates[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="compute masks on a worker thread during the forward (auto: only "
                         "when the forward leaves a core idle)")
    ap.add_argument("--mask-threads", type=int, default=1,
                    help="llguidance threads filling the masks (1: the mask thread itself)")
    ap.add_argument("--realistic", action="store_true", help="also a small, finishing schema")
    args = ap.parse_args()

    llm = LLM()
    if args.overlap != "auto":
        llm.engine.structured.overlap = args.overlap == "on"
    llm.engine.structured.mask_threads = args.mask_threads
    prompt = llm.render_chat([{"role": "user", "content": PROMPT}])
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
    small = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                           structured_outputs=StructuredOutputsParams(json=SMALL_SCHEMA))
    run(llm, prompt, 2, constrained)  # warm up: kernels, llguidance tokenizer, grammar
    results = []
    for n in args.concurrency:
        base, base_tokens = best_rate(llm, prompt, n, plain, args.repeat)
        rate, tokens = best_rate(llm, prompt, n, constrained, args.repeat)
        row = {"concurrency": n, "unconstrained_tok_s": round(base, 1),
               "json_schema_tok_s": round(rate, 1), "ratio": round(rate / base, 3),
               "tokens": [base_tokens, tokens]}
        if args.realistic:
            small_rate, small_tokens = best_rate(llm, prompt, n, small, args.repeat)
            row["small_schema_tok_s"] = round(small_rate, 1)
            row["small_schema_tokens"] = small_tokens
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"overlap": llm.engine.structured.overlap, "mask_threads": args.mask_threads,
                      "max_tokens": args.max_tokens,
                      "results": results}))


if __name__ == "__main__":
    main()
