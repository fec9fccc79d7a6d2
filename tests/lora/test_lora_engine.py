"""LoRA in the engine (issue #28): PEFT's numbers, batch invariance with mixed
adapters, prefix caching per adapter, and the LRU of resident adapters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from roseinfer.lora import LoRARequest
from tests.engine.invariance_helpers import cpu_kernels, make_engine, tiny_gqa_llama
from tests.lora.lora_helpers import greedy, make_adapter, run_jobs

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[LoRARequest, object]]:
    """Four adapters: all modules (r 8), attention only (r 16, rslora), MLP only with a
    rank / alpha pattern, and q/v/o (r 4; k_proj not adapted: parts with gaps); each
    with PEFT's merged model."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "all": dict(r=8, alpha=16),
        "attn": dict(r=16, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                     use_rslora=True),
        "mlp": dict(r=4, alpha=4, targets=["gate_proj", "up_proj", "down_proj"],
                    rank_pattern={"down_proj": 8}, alpha_pattern={"up_proj": 12}),
        "qv": dict(r=4, alpha=32, targets=["q_proj", "v_proj", "o_proj"]),
    }
    out = {}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        path = root / name
        merged = make_adapter(path, seed=i, **spec)
        out[name] = (LoRARequest(name, i, str(path)), merged)
    return out


@pytest.fixture(scope="module")
def hf_base():  # noqa: ANN201
    return tiny_gqa_llama(0)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "pytorch"])
def test_logits_match_peft_merged(adapters, hf_base, kernels: bool) -> None:  # noqa: ANN001
    """Exact mode: every sampled row equals PEFT's merged fp32 model's logits (teacher
    forced on the generated tokens), for each adapter in one mixed batch."""
    with cpu_kernels(kernels):
        engine = make_engine(hf_base, "none", enable_lora=True)
        jobs = [(name, _prompt(i, 20 + 7 * i), MAX_TOKENS, lora)
                for i, (name, (lora, _)) in enumerate(adapters.items())]
        tokens, rows = run_jobs(engine, jobs)
    for name, prompt, _, _ in jobs:
        merged = adapters[name][1]
        ids = torch.tensor([prompt + tokens[name][:-1]])
        with torch.no_grad():
            want = merged(ids).logits[0, len(prompt) - 1:]  # [MAX_TOKENS, V]
        got = torch.stack(rows[name]).cpu()  # the engine may run on a GPU (docs/testing.md)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_mixed_batch_is_bitwise_alone(adapters, hf_base, quantization: str) -> None:  # noqa: ANN001
    """Base + two adapters, each alone then all in one batch (prefill chunks and decodes
    mixed): the same logits rows bitwise, hence the same greedy tokens."""
    with cpu_kernels(True):
        engine = make_engine(hf_base, quantization, enable_lora=True,
                             enable_prefix_caching=False, max_num_batched_tokens=48)
        jobs = [("base", _prompt(10, 40), MAX_TOKENS, None),
                ("all", _prompt(11, 23), MAX_TOKENS, adapters["all"][0]),
                ("attn", _prompt(12, 57), MAX_TOKENS, adapters["attn"][0]),
                ("all-2", _prompt(13, 5), MAX_TOKENS, adapters["all"][0]),
                ("qv", _prompt(14, 9), MAX_TOKENS, adapters["qv"][0])]
        alone = {job[0]: run_jobs(engine, [job]) for job in jobs}
        tokens, rows = run_jobs(engine, jobs)
        assert engine.runner.model._stack is not None  # the C++ stack ran the LoRA steps
    for rid, *_ in jobs:
        assert tokens[rid] == alone[rid][0][rid], rid
        for step, (w, g) in enumerate(zip(alone[rid][1][rid], rows[rid], strict=True)):
            assert torch.equal(w, g), f"{rid}: logits differ at step {step}"
    assert tokens["all"] != tokens["base"] or rows["all"][0].ne(alone["base"][1]["base"][0]).any()


def test_prefix_cache_is_per_adapter(adapters, hf_base) -> None:  # noqa: ANN001
    """The same prompt under another adapter (or none) takes no prefix-cache hit; under
    the same adapter it does, with the same tokens."""
    with cpu_kernels(True):
        engine = make_engine(hf_base, "none", enable_lora=True, block_size=16)
        prompt = _prompt(20, 50)
        a, b = adapters["all"][0], adapters["qv"][0]
        cached = {}
        outs = {}
        for rid, lora in (("a1", a), ("b", b), ("base", None), ("a2", a)):
            engine.add_request(rid, prompt, greedy(3), lora_request=lora)
            for _ in range(100):
                done = [o for o in engine.step() if o.finished]
                if done:
                    cached[rid], outs[rid] = done[0].num_cached_tokens, done[0].outputs[0].token_ids
                    break
    assert cached == {"a1": 0, "b": 0, "base": 0, "a2": 48}
    assert outs["a2"] == outs["a1"]


def test_lru_swap_under_max_loras(adapters, hf_base) -> None:  # noqa: ANN001
    """max_loras=2 with 4 adapters in flight: at most 2 resident, an adapter in use is
    never evicted, every request finishes with the tokens it gets alone."""
    with cpu_kernels(True):
        engine = make_engine(hf_base, "none", enable_lora=True, max_loras=2)
        manager = engine.lora.manager
        jobs = [(f"{name}-{k}", _prompt(30 + 2 * i + k, 12 + i), 4, lora)
                for i, (name, (lora, _)) in enumerate(adapters.items()) for k in range(2)]
        alone = {job[0]: run_jobs(engine, [job])[0][job[0]] for job in jobs}
        loads_before = manager.num_loads
        for rid, prompt, max_tokens, lora in jobs:
            engine.add_request(rid, prompt, greedy(max_tokens), lora_request=lora)
        tokens = {}
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            in_use = {r.lora_request.lora_int_id for r in engine.scheduler.requests.values()
                      if r.lora_request is not None}
            assert in_use <= set(manager.resident), "a request runs without its adapter"
            assert len(manager.resident) <= 2
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            in_use_now = {r.lora_request.lora_int_id for r in engine.scheduler.requests.values()
                          if r.lora_request is not None}
            assert in_use_now <= set(manager.resident)
    assert tokens == alone
    assert manager.num_loads - loads_before >= 4  # every adapter swapped in from disk
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_lora_needs_enable_lora(adapters, hf_base, tmp_path: Path) -> None:  # noqa: ANN001
    from roseinfer.engine.validation import InvalidRequestError

    engine = make_engine(hf_base, "none")
    with pytest.raises(InvalidRequestError, match="not enabled"):
        engine.add_request("x", [5, 6, 7], lora_request=adapters["all"][0])


def test_adapter_gone_before_loading_fails_its_request_alone(hf_base, tmp_path: Path) -> None:  # noqa: ANN001
    """Checked when added, its weights file deleted before the swap-in: that request ends
    with finish reason "error" naming the adapter; a base request beside it finishes."""
    with cpu_kernels(True):
        engine = make_engine(hf_base, "none", enable_lora=True)
        make_adapter(tmp_path / "gone", seed=9, r=8)
        engine.add_request("lora", _prompt(40, 10), greedy(3),
                           lora_request=LoRARequest("gone", 7, str(tmp_path / "gone")))
        engine.add_request("base", _prompt(41, 10), greedy(3))
        (tmp_path / "gone" / "adapter_model.safetensors").unlink()
        finals = {}
        for _ in range(50):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
    assert finals["lora"].outputs[0].finish_reason == "error"
    assert "'gone' could not be loaded" in finals["lora"].error
    assert finals["base"].error is None and len(finals["base"].outputs[0].token_ids) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_adapters_are_laid_out_on_the_models_device(adapters, hf_base) -> None:  # noqa: ANN001
    """The PyTorch path's adapter buffer lives on the engine's device (on a GPU it was
    left on the CPU and every LoRA step failed: docs/testing.md); "meta" stands in for
    an accelerator here."""
    from roseinfer.lora.weights import build_adapter

    engine = make_engine(hf_base, "none", enable_lora=True)
    manager = engine.lora.manager
    lora = adapters["all"][0]
    meta = build_adapter(lora.lora_int_id, lora.lora_name, manager.check(lora), manager.config,
                         use_kernels=False, device=torch.device("meta"))
    assert meta.buffer.device.type == "meta"
    assert all(low.a.device.type == "meta" for layer in meta.layers for low in layer.values())
    assert manager.device == engine.device
