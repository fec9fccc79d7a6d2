"""Issue #11 on the bundled default model with default engine options: 8 prompts (four
share a ~150-word prefix) x 24 tokens, six greedy and two seeded (temperature 0.9,
top_p 0.95). Each prompt's logits rows (``torch.equal``) alone equal those in a batch
of 32 with load requests, with a chunk budget of 32 tokens, and after its prefix was
cached by another request; the seeded ones also give the same tokens.

One engine serves every scenario (loading the model once); the prefix cache is reset
before each cold run, and the chunk budget is the scheduler's own setting (the only
place ``max_num_batched_tokens`` is used).
"""

from __future__ import annotations

import random

import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.sampling_params import SamplingParams
from tests.engine.invariance_helpers import Arrival, RunResult, assert_same_logits, run_schedule

pytestmark = pytest.mark.slow  # default model: `make test-fast` skips it

NEW_TOKENS = 24
PREFIX = (
    "The old lighthouse stood at the end of a narrow spit of rock, where the sea met the "
    "sky in a line that changed colour with every hour of the day. For more than a "
    "hundred years its keepers had climbed the spiral stairs each evening to light the "
    "lamp, trim the wick and polish the great lens until it shone. Ships passing in the "
    "night counted its flashes to know where they were, and fishermen coming home late "
    "looked for its beam before they looked for the harbour lights. When the last keeper "
    "retired, the lamp was automated, and the cottage at its foot stood empty through "
    "long winters of wind and salt. Then one spring a young woman arrived with a "
    "suitcase, a box of books and a letter from the council, and she began to repair the "
    "windows, paint the door and plant a small garden behind the stone wall. "
)
PROMPTS = [
    PREFIX + "Question: who arrived in the spring? Answer:",
    PREFIX + "Summarise the story in one sentence:",
    PREFIX + "What did the ships use the lighthouse for?",
    PREFIX + "Continue the story:",
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about autumn leaves.",
    "List three uses of copper and explain each briefly:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = {3: 1234, 6: 99}  # prompt index -> seed: sampled, not greedy


def params(i: int) -> SamplingParams:
    if i not in SEEDED:
        return GREEDY
    return SamplingParams(temperature=0.9, top_p=0.95, seed=SEEDED[i], max_tokens=NEW_TOKENS,
                          ignore_eos=True)


def targets(step: int = 0) -> list[Arrival]:
    return [Arrival(step, f"p{i}", p, params(i)) for i, p in enumerate(PROMPTS)]


def load(count: int, seed: int = 0) -> list[Arrival]:
    """Load requests: random lengths of varied text, greedy and unseeded sampled, each
    arriving at its own step, ending after 4 to 30 tokens."""
    rng = random.Random(seed)
    words = (PREFIX + " ".join(PROMPTS[4:])).split()
    out = []
    for i in range(count):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 120)))
        p = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(4, 30),
                           ignore_eos=True)
        out.append(Arrival(rng.randint(0, 6), f"load-{i}", text, p))
    return out


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig())  # default options: int8 weights, fp16 KV, all cores


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> dict[str, RunResult]:
    """Each prompt on its own, cold cache."""
    out = {}
    for a in targets():
        engine.block_manager.reset_prefix_cache()
        out[a.request_id] = run_schedule(engine, [a])
    return out


def check(alone: dict[str, RunResult], got: RunResult, what: str) -> None:
    __tracebackhide__ = True
    failures = []
    for rid, want in alone.items():
        try:
            assert_same_logits(want, got, what, rid)
            if rid.removeprefix("p").isdigit() and int(rid[1:]) in SEEDED:
                assert got.tokens[rid] == want.tokens[rid], f"{what}: seeded {rid} tokens"
        except AssertionError as exc:
            failures.append(f"{rid}: {exc}")
    assert not failures, "\n".join(failures)


def test_batch_of_32(engine: LLMEngine, alone: dict[str, RunResult]) -> None:
    engine.block_manager.reset_prefix_cache()
    got = run_schedule(engine, load(24) + targets(step=2))
    assert got.max_rows >= 16
    check(alone, got, "in a batch of 32")


def test_chunk_budget_32(engine: LLMEngine, alone: dict[str, RunResult]) -> None:
    engine.block_manager.reset_prefix_cache()
    budget = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = 32
    try:
        got = run_schedule(engine, targets())
    finally:
        engine.scheduler.max_num_batched_tokens = budget
    check(alone, got, "chunks of 32 tokens")


def test_prefix_cached_by_another_request(engine: LLMEngine,
                                          alone: dict[str, RunResult]) -> None:
    """Another request computes the shared prefix first; the four prompts that share it
    then run together (their own batching is ``test_batch_of_32``'s concern)."""
    engine.block_manager.reset_prefix_cache()
    run_schedule(engine, [Arrival(0, "warm", PREFIX + "Describe the garden:", GREEDY)])
    shared = [a for a in targets() if a.prompt.startswith(PREFIX)]
    got = run_schedule(engine, shared)
    for a in shared:
        assert got.recorder.requests[a.request_id].num_cached_tokens >= 128
    check({a.request_id: alone[a.request_id] for a in shared}, got, "prefix from the cache")
