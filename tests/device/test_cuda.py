"""The engine on a GPU: the PyTorch path is device-agnostic, so CUDA works by construction;
these tests check it where a CUDA device is present (skipped elsewhere: CI has none).

On a GPU, run them with the engine suites on that device as well (docs/testing.md, On a
GPU): ``ROSEINFER_TEST_DEVICE=cuda pytest tests/device tests/engine ...``. Each test
compares the engine on CUDA with the exact fp32 engine on the CPU (the same weights): the
same greedy tokens, logits within the dtype's rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tokenizers.pre_tokenizers import ByteLevel

from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from tests.engine.invariance_helpers import (
    Arrival,
    RunResult,
    greedy,
    make_engine,
    random_prompt,
    run_schedule,
    tiny_gqa_llama,
)
from tests.model.conftest_loader import llama_gguf_tensors, llama_metadata, tiny_llama, write_gguf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# Every stored format gguf-py can write, one per part of the block.
GGUF_TYPES = {"token_embd": QT.Q8_0, "attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q5_0,
              "attn_output": QT.Q5_1, "ffn_gate": QT.Q8_0, "ffn_up": QT.F16,
              "ffn_down": QT.BF16, "output": QT.Q8_0}


def _run(device: str, quantization: str = "none", **options: object) -> RunResult:
    """Four requests of mixed lengths, batched, greedy: each one's logits rows and tokens."""
    rng = random.Random(0)
    engine = make_engine(tiny_gqa_llama(), quantization, device=device, **options)
    arrivals = [Arrival(step, f"r{i}", random_prompt(rng, length), greedy(10))
                for i, (step, length) in enumerate([(0, 37), (0, 5), (2, 90), (3, 1)])]
    return run_schedule(engine, arrivals)


def _max_logit_error(want: RunResult, got: RunResult) -> tuple[float, float]:
    """The largest |logit difference| over the first step of every request (the later
    steps may follow other tokens), and the largest |logit|."""
    err = scale = 0.0
    for rid, rows in want.recorder.rows.items():
        w, g = rows[0].double().cpu(), got.rows(rid)[0].double().cpu()
        err = max(err, (w - g).abs().max().item())
        scale = max(scale, w.abs().max().item())
    return err, scale


def test_fp32_engine_on_cuda_gives_the_cpu_tokens_and_logits() -> None:
    cpu, cuda = _run("cpu"), _run("cuda")
    assert cuda.tokens == cpu.tokens
    err, scale = _max_logit_error(cpu, cuda)
    assert err <= 1e-4 * scale, (err, scale)
    for rows in cuda.recorder.rows.values():
        assert rows[0].device.type == "cuda"


@pytest.mark.parametrize(("dtype", "kv_dtype", "tol"), [
    ("float16", "auto", 0.02), ("bfloat16", "auto", 0.05), ("float32", "int8", 0.02)])
def test_16_bit_and_int8_kv_engines_on_cuda_stay_close(dtype: str, kv_dtype: str,
                                                       tol: float) -> None:
    """Half-precision compute and the int8 KV cache run on CUDA; their logits stay within
    the format's rounding of the exact fp32 CPU engine's."""
    cpu = _run("cpu")
    cuda = _run("cuda", dtype=dtype, kv_cache_dtype=kv_dtype)
    err, scale = _max_logit_error(cpu, cuda)
    assert err <= tol * scale, (err, scale)
    assert all(len(t[0]) == 10 for t in cuda.tokens.values())


def test_seeded_sampling_on_cuda_is_reproducible() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234,
                            ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_gqa_llama(), "none", device="cuda")
        runs.append(run_schedule(engine, [Arrival(0, "s", list(range(3, 40)), params)]).tokens)
    assert runs[0] == runs[1]


def _tiny_gguf_with_tokenizer(path: Path) -> Path:
    """A tiny random Llama GGUF in the stored formats above, with a byte-level BPE
    vocabulary (so ``LLM`` can take text)."""
    tokens = ["<unk>", "<s>", "</s>"] + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell"]
    model = tiny_llama(vocab_size=len(tokens))
    return write_gguf(path, "llama", llama_metadata(model.config),
                      llama_gguf_tensors(model, GGUF_TYPES), tokens=tokens,
                      merges=["h e", "l l", "he ll"])


def test_gguf_through_llm_on_cuda_gives_the_cpu_text(tmp_path: Path) -> None:
    path = _tiny_gguf_with_tokenizer(tmp_path / "tiny.gguf")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["hello world", "The quick brown fox", "x"]
    outs = {}
    for device in ("cpu", "cuda"):
        with LLM(str(path), device=device, quantization="none", num_kv_blocks=64) as llm:
            assert llm.engine.device.type == device
            outs[device] = [(o.outputs[0].token_ids, o.outputs[0].text)
                            for o in llm.generate(prompts, params)]
    assert outs["cuda"] == outs["cpu"]
