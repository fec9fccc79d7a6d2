"""`roseinfer bench profile` on the default model: the C++ stack's GEMM time split by
linear (qkv, o, gate/up, down), with the weight bytes each read per second."""

from __future__ import annotations

import pytest

from roseinfer.bench.bandwidth import LINEAR_KINDS, gguf_linear_bytes
from roseinfer.bench.profile import format_profile, run_profile
from roseinfer.llm import LLM
from roseinfer.model.loader import default_model_path
from roseinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM()  # the default format: the GGUF as stored, in the C++ stack
    llm.generate(["Hello"], SamplingParams(max_tokens=2))
    if getattr(llm.engine.runner.model, "_stack", None) is None:
        pytest.skip("no C++ decoder stack in this build")
    return llm


def test_the_stack_times_each_linear_within_its_gemm_time(llm: LLM) -> None:
    stack = llm.engine.runner.model._stack
    stack.set_profiling(True)
    llm.generate(["The capital of France is", "def f(x):"], SamplingParams(max_tokens=6))
    gemm, linears = stack.profile()[0], stack.linear_profile()
    stack.set_profiling(False)
    assert len(linears) == 4 and all(t > 0 for t in linears)
    assert sum(linears) == pytest.approx(gemm, rel=1e-9)
    assert stack.linear_profile() == [0.0] * 4  # set_profiling resets them


def test_profile_reports_each_linear_with_its_read_and_arithmetic_rates(llm: LLM) -> None:
    prof = run_profile(llm.engine, 2, prompt_len=16, steps=3)
    lin = prof["linears"]
    assert tuple(lin) == LINEAR_KINDS
    assert sum(v["ms"] for v in lin.values()) <= prof["runner_ms"]["gemm"]  # + the LM head
    stored = gguf_linear_bytes(default_model_path())
    cfg = llm.engine.model_config
    macs = {"qkv": cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
            "o": cfg.num_heads * cfg.head_dim * cfg.hidden_size,
            "gate_up": 2 * cfg.hidden_size * cfg.intermediate_size,
            "down": cfg.intermediate_size * cfg.hidden_size}
    for kind, v in lin.items():
        assert v["ms"] > 0
        assert v["gb_s"] * v["ms"] * 1e6 == pytest.approx(stored[kind])  # bytes a step
        flops = 2 * macs[kind] * cfg.num_layers * 2  # 2 rows a step
        assert v["gflop_s"] * v["ms"] * 1e6 == pytest.approx(flops)
    text = format_profile(prof)
    assert "the stack's GEMMs by linear" in text and "gate_up" in text


def test_prefill_profile_splits_a_prompt_by_the_stack_timers(llm: LLM) -> None:
    from roseinfer.bench.prefill_profile import format_prefill_profile, run_prefill_profile

    prof = run_prefill_profile(llm.engine, 40, repeats=2)
    assert prof["tok_s"] == pytest.approx(40 / prof["ms"] * 1e3)
    parts = prof["stack_ms"]
    assert set(parts) == {"gemm", "attention", "kv_write", "row_ops"}
    assert all(v > 0 for v in parts.values()) and sum(parts.values()) < prof["ms"]
    lin = prof["linears"]
    assert tuple(lin) == LINEAR_KINDS
    assert sum(v["ms"] for v in lin.values()) == pytest.approx(parts["gemm"], rel=0.05)
    text = format_prefill_profile(prof)
    assert "prefill of 40 tokens" in text and "gate_up" in text
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError):
        run_prefill_profile(llm.engine, 0)
