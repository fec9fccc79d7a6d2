"""Scheduler tested without a model: a fake runner makes each next token a
deterministic function of the whole context, so recomputation after preemption
must reproduce exactly the same continuation."""

from __future__ import annotations

import random

import pytest

from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.scheduler import Scheduler, SchedulerOutput
from roseinfer.sampling_params import SamplingParams


def fake_next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 7919 + len(tokens)) % 97 + 3


def fake_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sampled = []
    for s in out.scheduled:
        req = s.request
        # The KV of the chunk must be covered by the block table.
        end = req.num_computed_tokens + s.num_new_tokens
        assert len(req.block_table) * sched.block_manager.block_size >= end
        sampled.append([fake_next_token(req.all_token_ids)] if s.completes else [])
    sched.update(out, sampled)
    return out


def make_sched(num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8,
               budget: int = 32, max_len: int = 256, prefix: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, max_seqs, budget, max_len)


def make_req(rid: str, prompt: list[int], max_tokens: int = 8, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(1,))


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = fake_next_token(toks)
        toks.append(t)
        out.append(t)
    return out


def drain(sched: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        fake_step(sched)
    raise AssertionError("scheduler did not drain")


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_chunked_prefill_under_budget() -> None:
    sched = make_sched(budget=8)
    req = make_req("a", list(range(10, 30)), max_tokens=3)
    sched.add_request(req)
    chunks = [fake_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert req.num_output_tokens == 1  # only the completing chunk samples
    drain(sched)
    assert req.output_token_ids == reference_output(list(range(10, 30)), 3)
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(sched)


def test_decodes_scheduled_before_new_prefill_and_budget_shared() -> None:
    sched = make_sched(budget=6)
    a = make_req("a", [5, 6, 7], max_tokens=5)
    sched.add_request(a)
    fake_step(sched)
    b = make_req("b", list(range(40, 52)), max_tokens=2)
    sched.add_request(b)
    out = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]
    drain(sched)
    assert a.output_token_ids == reference_output([5, 6, 7], 5)
    assert b.output_token_ids == reference_output(list(range(40, 52)), 2)
    assert_all_free(sched)


def test_max_num_seqs() -> None:
    sched = make_sched(max_seqs=2)
    reqs = [make_req(str(i), [i + 2, 3, 4], max_tokens=4) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = fake_step(sched)
    assert len(out.scheduled) == 2
    drain(sched)
    for i, r in enumerate(reqs):
        assert r.output_token_ids == reference_output([i + 2, 3, 4], 4)
    assert_all_free(sched)


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_newest_first_and_exact_continuation(prefix: bool) -> None:
    sched = make_sched(num_blocks=6, block_size=4, budget=64, max_len=64, prefix=prefix)
    prompts = [[2 + i] * 6 for i in range(3)]
    reqs = [make_req(f"r{i}", p, max_tokens=10) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    preempted: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = fake_step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted, "the tiny pool must force preemption"
    assert preempted[0] == "r2"  # the newest running request goes first
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == reference_output(p, 10)
    assert_all_free(sched)


def test_prompt_longer_than_max_model_len_rejected() -> None:
    sched = make_sched(max_len=16)
    with pytest.raises(ValueError, match="max_model_len is 16"):
        sched.add_request(make_req("a", list(range(16))))
    assert not sched.has_unfinished()


def test_length_capped_at_max_model_len() -> None:
    sched = make_sched(max_len=12)
    r = make_req("a", list(range(2, 10)), max_tokens=100)
    sched.add_request(r)
    drain(sched)
    assert r.num_tokens == 12 and r.finish_reason == "length"


def test_eos_and_stop_token_and_min_tokens() -> None:
    sched = make_sched()
    prompt = [5, 6, 7]
    first = reference_output(prompt, 1)[0]
    r = make_req("a", prompt, max_tokens=5, stop_token_ids=[first])
    sched.add_request(r)
    drain(sched)
    assert r.output_token_ids == [first] and r.stop_reason == first
    assert r.finish_reason == "stop"
    r2 = Request("b", prompt, SamplingParams(max_tokens=5), eos_token_ids=(first,))
    sched.add_request(r2)
    drain(sched)
    assert r2.output_token_ids == [first] and r2.finish_reason == "stop"
    r3 = Request("c", prompt, SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=(first,))
    sched.add_request(r3)
    drain(sched)
    assert r3.num_output_tokens == 3
    assert_all_free(sched)


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_every_state(when: str) -> None:
    sched = make_sched(num_blocks=8, block_size=4, budget=8)
    other = make_req("other", [3] * 14, max_tokens=12)
    victim = make_req("victim", [4] * 14, max_tokens=12)
    sched.add_request(other)
    sched.add_request(victim)
    for _ in range(100):
        st = victim.status
        if when == "waiting" and st is RequestStatus.WAITING:
            break
        if (when == "prefilling" and st is RequestStatus.RUNNING
                and 0 < victim.num_computed_tokens < victim.num_prompt_tokens):
            break
        if when == "decoding" and victim.num_output_tokens >= 2:
            break
        if when == "preempted" and st is RequestStatus.PREEMPTED:
            break
        fake_step(sched)
    else:
        pytest.fail(f"victim never reached state {when}")
    sched.abort_request("victim")
    assert victim.status is RequestStatus.FINISHED_ABORTED
    assert victim not in sched.running and victim not in sched.waiting
    drain(sched)
    assert other.output_token_ids == reference_output([3] * 14, 12)
    assert_all_free(sched)


def test_shared_prefix_requests_arriving_together_share_blocks() -> None:
    sched = make_sched(block_size=4, budget=64)
    prefix = list(range(10, 26))  # 4 full blocks
    a = make_req("a", prefix + [1, 2], max_tokens=2)
    b = make_req("b", prefix + [3, 4], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = fake_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b waits for a's prefix
    fake_step(sched)
    assert b.num_cached_tokens == 16
    drain(sched)
    assert b.output_token_ids == reference_output(prefix + [3, 4], 2)
    assert_all_free(sched)


def test_random_mix_keeps_invariants() -> None:
    rng = random.Random(0)
    sched = make_sched(num_blocks=20, block_size=4, max_seqs=6, budget=16, max_len=60)
    expected: dict[str, list[int]] = {}
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    shared = [rng.randrange(3, 90) for _ in range(8)]
    for step in range(400):
        if step < 150 and rng.random() < 0.3:
            rid = f"r{step}"
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(3, 90) for _ in range(rng.randrange(1, 20))]
            mt = rng.randrange(1, 15)
            reqs[rid] = make_req(rid, prompt, max_tokens=mt, ignore_eos=True)
            expected[rid] = reference_output(prompt, mt)
            sched.add_request(reqs[rid])
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.abort_request(rid)
            aborted.add(rid)
        if sched.has_unfinished():
            fake_step(sched)
        bm = sched.block_manager
        used = sum(1 for b in bm.blocks if b.ref_count > 0)
        assert used + bm.num_free_blocks == bm.num_blocks
    drain(sched)
    for rid, req in reqs.items():
        if rid not in aborted:
            assert req.output_token_ids == expected[rid], rid
    assert_all_free(sched)
