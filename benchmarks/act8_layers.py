"""Which decoder layers' gate/up could take int8 activations: the chat gate per layer set.

For each set of layer indices, the default model is loaded with int8 activations in
front of those layers' gate/up (the real kernels, ``csrc/q4_act8.h``; every other layer
int16) and scored against the exact fp32 model on the quality gate's everyday questions
(``tests/integration/test_chat_quality.py``): greedy answers agreeing on their first 16
tokens, whether "What is the capital of France?" names Paris, and, teacher-forced on
fp32's own 48-token answers, the summed negative log-likelihood and the positions where
fp32's token is not the top one ("misses"); plus the first answer token's top-3
logprobs for the Paris question (how close its tie is).

    PYTHONPATH=. python benchmarks/act8_layers.py                # none, all, all but each
    PYTHONPATH=. python benchmarks/act8_layers.py --sets '[[0, 1], [28, 29]]'
    PYTHONPATH=. python benchmarks/act8_layers.py --sets '[[]]' --kinds gate_up_proj,down_proj
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import roseinfer.model.gguf_stream as gguf_stream
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from test_chat_quality import QUESTIONS  # noqa: E402


def _layer(path: str) -> int:
    m = re.search(r"layers\.(\d+)\.", path)
    return int(m.group(1)) if m else -1


def load(layers: set[int], kinds: tuple[str, ...] = ("gate_up_proj",)) -> LLM:
    """The default model with int8 activations in front of ``layers``' ``kinds`` (gate/up
    by default)."""
    gguf_stream.act8_layer = lambda path: path.endswith(kinds) and _layer(path) in layers
    return LLM(quantization="auto", weight_cache=False, max_num_batched_tokens=512)


def greedy(llm: LLM, tokens: int) -> tuple[list[list[int]], list[str]]:
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(max_tokens=tokens, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


def forced(llm: LLM, prompts: list[list[int]], answers: list[list[int]]) -> tuple[float, int]:
    """Summed NLL of ``answers`` after ``prompts``, and how many of their tokens are not
    the model's top choice."""
    outs = llm.generate([p + a for p, a in zip(prompts, answers, strict=True)],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    nll, misses = 0.0, 0
    for p, a, o in zip(prompts, answers, outs, strict=True):
        for i, t in enumerate(a):
            e = o.prompt_logprobs[len(p) + i][t]
            nll -= e.logprob
            misses += e.rank != 1
    return nll, misses


def first_token(llm: LLM) -> list[tuple[str, float]]:
    out = llm.chat([[{"role": "user", "content": QUESTIONS[0]}]],
                   SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))[0].outputs[0]
    top = sorted(out.logprobs[0].values(), key=lambda e: -e.logprob)[:3]
    return [(e.decoded_token or "", round(e.logprob, 3)) for e in top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", help="JSON list of layer-index lists (default: none, all, "
                    "and all but each layer)")
    ap.add_argument("--kinds", default="gate_up_proj",
                    help="comma-separated layer kinds that take int8 activations in the "
                    "chosen layers (default: gate_up_proj; e.g. gate_up_proj,down_proj)")
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    ref = LLM(quantization="none", max_num_batched_tokens=512)
    n_layers = ref.engine.model_config.num_layers
    every = list(range(n_layers))
    sets = (json.loads(args.sets) if args.sets else
            [[], every] + [[j for j in every if j != i] for i in every])
    prompts = [ref.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    ref16, _ = greedy(ref, 16)
    ref48, _ = greedy(ref, 48)
    print(f"fp32: first token of the Paris answer {first_token(ref)}")
    del ref
    for layers in sets:
        name = ("none" if not layers else "all" if layers == every else
                f"all but {sorted(set(every) - set(layers))}" if len(layers) > n_layers // 2
                else str(sorted(layers)))
        llm = load(set(layers), kinds)
        ids, text = greedy(llm, 16)
        agree = sum(a == b for a, b in zip(ids, ref16, strict=True))
        nll, misses = forced(llm, prompts, ref48)
        print(f"act8 {name}: {agree}/{len(QUESTIONS)} as fp32, Paris {'Paris' in text[0]}, "
              f"forced NLL {nll:.3f}, misses {misses}, first token {first_token(llm)}",
              flush=True)
        del llm


if __name__ == "__main__":
    main()
