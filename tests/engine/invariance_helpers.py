"""Batch-invariance harness (issue #11): run requests through an ``LLMEngine`` and
capture, per request, the exact logits row the sampler received at each of its steps.

``recording(engine)`` wraps that engine instance's ``StepSampler.sample`` (and its
model's ``compute_logits``, for the LM head's input) while inside: it maps the rows of
``StepLogits.sample_logits`` (one per chunk that completes its request, in scheduled
order) to request ids through the scheduled chunks, and copies them before the sampler
runs (``LogitsRecorder``). ``run_schedule`` feeds requests in at given
steps and steps the engine until all finish. ``assert_same_logits`` compares with
``torch.equal`` and, on a mismatch, names the first step that differs, by how much, and
whether the LM head's input already differed.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.request import Request
from roseinfer.sampling_params import SamplingParams
from tests.engine.tiny_models import engine_from_hf

VOCAB = 512
MAX_POSITIONS = 640
QUANTIZATIONS = ("none", "auto", "fp16")  # exact fp32, the default (int8 on CPU), fp16
# A weight format with a KV cache dtype after a slash ("auto/int8": the int8 KV cache).
KV_INT8 = ("auto/int8",)


def tiny_gqa_llama(seed: int = 0) -> transformers.PreTrainedModel:
    """A random 2-layer GQA Llama shaped for the C++ kernels' fast paths: head_dim 64,
    hidden / intermediate multiples of 32 (int8 blocks), 4 query heads over 2 KV heads."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@contextmanager
def cpu_kernels(enabled: bool) -> Iterator[None]:
    """With ``enabled=False``: the PyTorch fallback, as ``ROSEINFER_CPU_KERNELS=0`` gives
    (the library is loaded once per process, so the check every caller makes is patched)."""
    import roseinfer.kernels

    if enabled:
        if not roseinfer.kernels.cpu_kernels_available():
            pytest.skip("C++ kernels unavailable: " + str(roseinfer.kernels.unavailable_reason()))
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROSEINFER_CPU_KERNELS", "0")
        mp.setattr(roseinfer.kernels, "cpu_kernels_available", lambda: False)
        yield


def make_engine(hf_model: transformers.PreTrainedModel, quantization: str,
                **options: object) -> LLMEngine:
    """An engine with default options except those given; one thread unless told (two
    threads on a loaded 2-core machine run ~20x slower: spinning OpenMP workers) and a
    pool of 1024 blocks (not 1 GiB of zeros per engine).  ``quantization`` may name a KV
    cache dtype after a slash: "auto/int8"."""
    quantization, _, kv_dtype = quantization.partition("/")
    if kv_dtype:
        options.setdefault("kv_cache_dtype", kv_dtype)
    options.setdefault("num_kv_blocks", 1024)
    return engine_from_hf(hf_model, quantization=quantization, **options)


@dataclass
class LogitsRecorder:
    """Per request id: the logits rows the sampler got, the final hidden states they came
    from (the LM head's input), their row positions, and the ``Request`` objects."""

    rows: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    hidden: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    positions: dict[str, list[tuple[int, int]]] = field(
        default_factory=lambda: defaultdict(list))  # (row, rows in the step) per step
    requests: dict[str, Request] = field(default_factory=dict)


@contextmanager
def recording(engine: LLMEngine) -> Iterator[LogitsRecorder]:
    """Record while inside: wraps this engine instance's ``StepSampler.sample`` and its
    model's ``compute_logits`` (the call that made the step's sample logits gives the
    hidden states), and restores both on exit. Greedy steps compute their logits too
    (``greedy_only`` false: no tokens-alone head, which gives the argmax of these)."""
    recorder = LogitsRecorder()
    heads: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's (hidden, logits)
    model, step_sampler = engine.runner.model, engine.step_sampler
    compute_logits: Callable = model.compute_logits
    sample_rows: Callable = step_sampler.sample

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        heads.append((hidden.detach().clone(), logits))
        return logits

    def sample(scheduled, logits, failed, masks=None):  # noqa: ANN001, ANN202
        if logits is not None:
            done = [s.request for s in scheduled if s.completes]
            hidden = next((h for h, out in heads if out.float() is logits.sample_logits), None)
            for k, req in enumerate(done):
                recorder.rows[req.request_id].append(logits.sample_logits[k].clone())
                if hidden is not None:
                    recorder.hidden[req.request_id].append(hidden[k])
                recorder.positions[req.request_id].append((k, len(done)))
                recorder.requests[req.request_id] = req
        heads.clear()
        return sample_rows(scheduled, logits, failed, masks)

    model.compute_logits, step_sampler.sample = head, sample  # these instances only
    step_sampler.greedy_only = lambda scheduled: False
    try:
        yield recorder
    finally:
        del model.compute_logits, step_sampler.sample, step_sampler.greedy_only


@dataclass(frozen=True)
class Arrival:
    step: int  # engine step before which the request is added
    request_id: str
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class RunResult:
    recorder: LogitsRecorder
    tokens: dict[str, list[list[int]]]  # request id -> token ids of each of its n outputs
    num_steps: int
    max_rows: int  # most rows sampled in one step

    def rows(self, request_id: str) -> list[torch.Tensor]:
        return self.recorder.rows[request_id]


def run_schedule(engine: LLMEngine, arrivals: list[Arrival], max_steps: int = 4000
                 ) -> RunResult:
    """Add each request before its step; step until every request finished."""
    pending = sorted(arrivals, key=lambda a: a.step)
    tokens: dict[str, list[list[int]]] = {}
    step = 0
    with recording(engine) as recorder:
        while pending or engine.has_unfinished_requests():
            assert step < max_steps, "the engine did not finish"
            while pending and pending[0].step <= step:
                a = pending.pop(0)
                engine.add_request(a.request_id, a.prompt, a.params)
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    tokens[out.request_id] = [list(o.token_ids) for o in out.outputs]
            step += 1
    max_rows = max((n for pos in recorder.positions.values() for _, n in pos), default=0)
    return RunResult(recorder, tokens, step, max_rows)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def load_arrivals(rng: random.Random, count: int, first_step: int = 0, last_step: int = 12,
                  max_prompt: int = 90) -> list[Arrival]:
    """``count`` load requests of random lengths arriving at random steps: greedy,
    unseeded and seeded sampled ones, stopping after 2 to 24 tokens."""
    out = []
    for i in range(count):
        kind = rng.choice(["greedy", "sampled", "seeded"])
        params = SamplingParams(
            temperature=0.0 if kind == "greedy" else 0.8, top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(1 << 30) if kind == "seeded" else None,
            max_tokens=rng.randint(2, 24), ignore_eos=True)
        out.append(Arrival(rng.randint(first_step, last_step), f"load-{i}",
                           random_prompt(rng, rng.randint(1, max_prompt)), params))
    return out


def assert_same_logits(want: RunResult, got: RunResult, what: str, request_id: str = "target",
                       got_id: str | None = None) -> None:
    """The request's logits rows bitwise equal, step by step; on a mismatch the message
    names the first differing step and whether the LM head's input (the final hidden
    state) already differed there (decoder stack) or not (LM head)."""
    __tracebackhide__ = True
    got_id = got_id or request_id
    w_rows, g_rows = want.rows(request_id), got.rows(got_id)
    assert len(g_rows) == len(w_rows), f"{what}: {len(g_rows)} sampled steps, expected {len(w_rows)}"
    for step, (w, g) in enumerate(zip(w_rows, g_rows, strict=True)):
        if torch.equal(w, g):
            continue
        source = "hidden states not recorded"
        w_h, g_h = want.recorder.hidden[request_id], got.recorder.hidden[got_id]
        if step < min(len(w_h), len(g_h)):
            d = (w_h[step] - g_h[step]).abs().max()
            source = ("the final hidden state equal: the LM head differs" if torch.equal(
                w_h[step], g_h[step]) else f"the final hidden state already differs "
                f"(max |diff| {float(d):.3e}): the decoder stack")
        raise AssertionError(
            f"{what}: logits differ first at output step {step} of {len(w_rows)}: "
            f"{int((w != g).sum())}/{w.numel()} entries, max |diff| "
            f"{float((w - g).abs().max()):.3e}, argmax {int(w.argmax())} vs {int(g.argmax())}; "
            f"{source}; rows in that step: {want.recorder.positions[request_id][step]} vs "
            f"{got.recorder.positions[got_id][step]} (row, of)")
