"""Quality of 8-bit activations, layer by layer: the measurement behind the next GEMM.

The default ``int8`` format multiplies int16 activations (one scale per row and 32
values) with ``vpmaddwd``. 8-bit activations would let AVX2 use ``vpmaddubsw`` against
the Q4_1 weights (unsigned 0..15) and add 8 steps in int16 before widening: half the
instructions per multiply-add. Whether the default may do that is decided by the
quality gate of ``tests/model/test_quantize.py`` (the 1,128-token text scored with
prompt logprobs: top-1 agreement with fp32 >= 98%, perplexity within 1%).

This script measures the gate with activations rounded to 8 bits (per row and
32-block, round to nearest even, like the kernels' quantizer) in front of chosen
linear layers, in the exact fp32 PyTorch path (``ROSEINFER_CPU_KERNELS=0``, weights
= the GGUF's Q4_1 values), so no kernel has to exist first. The default format adds
its other roundings (int16 activations elsewhere, an fp16 KV cache), so its own gate
(the test) reads lower: 98.31% with gate/up, 97.78% with q/k/v and o too:

    .venv/bin/python benchmarks/activation_bits.py [--bits 8]

``--model FILE.gguf`` measures another file (the reference: its weights dequantized,
exact fp32) and ``--layers gate_up_proj[,o_proj]`` one chosen layer set (repeatable)
instead of the sets above, e.g. the gate of act8 for a Q4_0 or Q4_K_M file's gate/up.
``--chat`` adds the chat part of the gate for each set: the greedy answers (16 tokens)
to ``tests/integration/test_chat_quality.py``'s everyday questions with the layers
rounded, against the exact fp32 model's (>= 80% equal, Paris named).
``--block 16`` (or 8) gives each 16 (8) activations their own scale instead of 32;
``--default-roundings`` adds the default format's other roundings (int16 in front of
every other linear, a float16 KV cache) to each set, so a set that passes there would
pass as the default:

    .venv/bin/python benchmarks/activation_bits.py --block 16 --chat --default-roundings
"""

from __future__ import annotations

import argparse
import math
import os
import runpy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "quality_text.txt"
CHAT = ROOT / "tests" / "integration" / "test_chat_quality.py"  # QUESTIONS, TOKENS
LAYER_SETS: dict[str, tuple[str, ...]] = {
    "gate_up (the default's)": ("gate_up_proj",),
    "o, gate_up": ("o_proj", "gate_up_proj"),
    "qkv, o, gate_up": ("qkv_proj", "o_proj", "gate_up_proj"),
    "qkv, o, gate_up, down": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}


def round_blocks(bits: int, block: int = 32
                 ) -> Callable[[nn.Module, tuple[Tensor, ...]], tuple[Tensor]]:
    """A forward pre-hook rounding the input to ``bits`` per row and ``block`` values."""
    qmax = 2 ** (bits - 1) - 1

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
        x = args[0]
        blocks = x.reshape(-1, x.shape[-1] // block, block)
        scale = blocks.abs().amax(-1, keepdim=True) / qmax
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return (torch.round(blocks / scale).clamp(-qmax, qmax) * scale).reshape(x.shape),

    return hook


def prompt_stats(llm: object) -> tuple[list[float], list[int]]:
    """Logprob of each actual next token and the top-1 token, per position."""
    from roseinfer.sampling_params import SamplingParams

    out = llm.generate(TEXT.read_text(), SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    entries, targets = out.prompt_logprobs[1:], out.prompt_token_ids[1:]
    logprobs = [e[t].logprob for e, t in zip(entries, targets, strict=True)]
    top1 = [next(tid for tid, lp in e.items() if lp.rank == 1) for e in entries]
    return logprobs, top1


def chat_answers(llm: object) -> list[tuple[list[int], str]]:
    """Greedy (token ids, text) answers to the chat gate's everyday questions."""
    from roseinfer.sampling_params import SamplingParams

    gate = runpy.run_path(str(CHAT))
    params = SamplingParams(max_tokens=gate["TOKENS"], temperature=0.0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in gate["QUESTIONS"]], params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@contextmanager
def rounded(model: nn.Module, names: Sequence[str], bits: int, block: int = 32,
            others16: bool = False) -> Iterator[list]:
    """The inputs of the layers named ``names`` rounded while inside (yields their hooks);
    ``others16``: every other linear's input to int16 per 32 values, as the default
    format's kernels do."""
    hooks, rest = [], []
    for n, m in model.named_modules():
        leaf = n.rsplit(".", 1)[-1]
        if leaf in names:
            hooks.append(m.register_forward_pre_hook(round_blocks(bits, block)))
        elif others16 and leaf in LINEARS:
            rest.append(m.register_forward_pre_hook(round_blocks(16)))
    try:
        yield hooks
    finally:
        for h in hooks + rest:
            h.remove()


def measure(llm: object, model: nn.Module, names: Sequence[str], bits: int,
            ref: tuple[list[float], list[int]], block: int = 32,
            others16: bool = False) -> tuple[float, float, int]:
    """(perplexity change in %, top-1 agreement in %, layers rounded)."""
    with rounded(model, names, bits, block, others16) as hooks:
        logprobs, top1 = prompt_stats(llm)
    ppl_ref = math.exp(-sum(ref[0]) / len(ref[0]))
    ppl = math.exp(-sum(logprobs) / len(logprobs))
    agree = sum(a == b for a, b in zip(ref[1], top1, strict=True)) / len(top1)
    return 100 * (ppl / ppl_ref - 1), 100 * agree, len(hooks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--block", type=int, default=32,
                    help="activations per scale (the kernels': 32; 16 or 8: finer scales)")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    ap.add_argument("--layers", action="append", default=None,
                    help="comma-separated layer names rounded together (repeatable)")
    ap.add_argument("--chat", action="store_true",
                    help="also the everyday chat answers against the exact model's")
    ap.add_argument("--default-roundings", action="store_true",
                    help="the default format's other roundings too: int16 in front of every "
                         "other linear, a float16 KV cache")
    args = ap.parse_args()
    sets = ({s: tuple(s.split(",")) for s in args.layers} if args.layers else LAYER_SETS)
    os.environ["ROSEINFER_CPU_KERNELS"] = "0"  # the exact fp32 PyTorch path, hookable
    from roseinfer.llm import LLM

    exact = LLM(model=args.model, quantization="none", max_num_batched_tokens=512)
    ref = prompt_stats(exact)
    answers_exact = chat_answers(exact) if args.chat else []
    others16 = args.default_roundings
    llm = (LLM(model=args.model, quantization="none", max_num_batched_tokens=512,
               kv_cache_dtype="float16") if others16 else exact)
    model = llm.engine.runner.model
    print(f"| activations rounded to {args.bits} bits (blocks of {args.block}) in front of "
          "| layers | perplexity "
          "vs fp32 | top-1 agreement |\n|---|---|---|---|")
    for label, names in sets.items():
        dppl, agree, count = measure(llm, model, names, args.bits, ref, args.block, others16)
        print(f"| {label} | {count} | {dppl:+.2f}% | {agree:.2f}% |")
    if args.chat:
        for label, names in sets.items():
            with rounded(model, names, args.bits, args.block, others16):
                answers = chat_answers(llm)
            same = [a[0] == b[0] for a, b in zip(answers, answers_exact, strict=True)]
            for ok, a, b in zip(same, answers, answers_exact, strict=True):
                print(f"{'=' if ok else '!'} {a[1]!r} / fp32 {b[1]!r}")
            print(f"{label}: {sum(same)} of {len(same)} answers as fp32 (16 tokens), "
                  f"Paris named: {'Paris' in answers[0][1]}")


if __name__ == "__main__":
    main()
