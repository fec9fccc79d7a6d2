"""Scheduler and block manager with speculative drafts, without a model: drafts are
budgeted like other tokens, never preempt anyone, the slots of rejected drafts are
given back, the prefix cache only ever holds blocks of accepted tokens, and a fake
model (next token = a function of the whole context) yields the same continuation with
drafts as without, through chunked prefill and preemption, with no block leaked."""

from __future__ import annotations

import random

import pytest

from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import Scheduler
from tests.engine.test_scheduler import fake_next_token, make_req, make_sched, reference_output


def decoding(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 50) -> Request:
    """A running request that has just sampled its first token (its next step decodes)."""
    req = make_req(rid, prompt, max_tokens=max_tokens)
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled[-1].request is req and all(s.completes for s in out.scheduled)
    sched.update(out, [[fake_next_token(s.request.all_token_ids)] for s in out.scheduled])
    return req


def verify(req: Request, drafts: list[int]) -> list[int]:
    """What the verifier emits: the fake model's token after each accepted draft, up to
    the first draft it disagrees with."""
    out: list[int] = []
    context = list(req.all_token_ids)
    for d in [*drafts, None]:
        token = fake_next_token(context)
        out.append(token)
        if token != d:
            break
        context.append(token)
    return out


def test_drafts_take_the_budget_left_after_decodes() -> None:
    sched = make_sched(budget=8)
    reqs = [decoding(sched, f"r{i}", [5, 6, 7, 8 + i]) for i in range(3)]
    for r in reqs:
        r.spec_token_ids = [40, 41, 42, 43, 44]
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [6, 1, 1]
    assert [s.spec_token_ids for s in out.scheduled] == [[40, 41, 42, 43, 44], [], []]
    assert out.num_tokens == 8
    assert all(s.completes for s in out.scheduled)
    assert all(not r.spec_token_ids for r in reqs[:1])


def test_drafts_capped_by_max_tokens_and_model_len() -> None:
    sched = make_sched(max_len=12)
    short = decoding(sched, "short", [5, 6, 7], max_tokens=4)
    long = decoding(sched, "long", [5, 6, 7, 8, 9, 10, 11, 12], max_tokens=50)  # 9 of 12
    assert short.num_output_tokens == 2  # it decoded while "long" was admitted: 2 to go
    short.spec_token_ids = long.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    assert [len(s.spec_token_ids) for s in out.scheduled] == [1, 2]


def test_drafts_never_preempt() -> None:
    """Two decodes, one block each; their drafts would need a second block: none free."""
    sched = make_sched(num_blocks=2, block_size=4)
    a = decoding(sched, "a", [5, 6])
    b = decoding(sched, "b", [8, 9])
    a.spec_token_ids = b.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert not out.preempted
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [(1, []), (1, [])]


def test_rejected_slots_are_given_back_and_never_cached() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 8, 64, 256)
    req = decoding(sched, "r", [5, 6, 7, 8, 9, 10, 11])  # 8 tokens, 7 computed: 2 blocks
    right = reference_output([5, 6, 7, 8, 9, 10, 11], 20)
    req.spec_token_ids = [right[1], right[2], 3, 3, 3, 3, 3]  # two right, then wrong
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 8 and len(req.block_table) == 4  # 7 + 8 = 15 slots
    emitted = verify(req, s.spec_token_ids)
    assert emitted == right[1:4]
    sched.update(out, [emitted])
    assert req.output_token_ids == right[:4]
    assert req.num_computed_tokens == req.num_tokens - 1 == 10
    assert len(req.block_table) == bm.blocks_needed(10) == 3
    assert bm.num_free_blocks == 16 - 3
    tokens = req.all_token_ids
    for i, block_id in enumerate(req.block_table[:2]):  # the full, computed blocks
        assert bm.blocks[block_id].token_ids == tuple(tokens[4 * i:4 * i + 4])
    assert bm.blocks[req.block_table[2]].block_hash is None  # holds a rejected draft's slot


def step_with_drafts(sched: Scheduler, rng: random.Random, right_share: float) -> None:
    """One step: each decoding request drafts up to 4 tokens, each right with chance
    ``right_share``; the verifier emits what the fake model agrees with."""
    for req in sched.running:
        if req.num_tokens - req.num_computed_tokens == 1:
            good = reference_output(req.all_token_ids, 4)
            req.spec_token_ids = [t if rng.random() < right_share else 1 for t in good]
    out = sched.schedule()
    sampled = []
    for s in out.scheduled:
        req = s.request
        end = req.num_computed_tokens + s.num_new_tokens
        assert len(req.block_table) * sched.block_manager.block_size >= end
        sampled.append(verify(req, s.spec_token_ids) if s.completes else [])
    sched.update(out, sampled)


@pytest.mark.parametrize(("num_blocks", "budget", "right"), [
    (256, 64, 0.9), (256, 5, 0.7), (24, 32, 0.8), (16, 7, 0.5)],
    ids=["roomy", "small-budget", "preempting", "preempting-small-budget"])
def test_drain_equals_reference(num_blocks: int, budget: int, right: float) -> None:
    rng = random.Random(num_blocks + budget)
    sched = make_sched(num_blocks=num_blocks, block_size=4, budget=budget)
    shared = [rng.randrange(3, 90) for _ in range(9)]
    reqs = []
    for i in range(8):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 90) for _ in range(rng.randint(2, 20))]
        reqs.append(make_req(f"r{i}", prompt, max_tokens=rng.randint(5, 30), ignore_eos=True))
        sched.add_request(reqs[-1])
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step_with_drafts(sched, rng, right)
    assert not sched.has_unfinished()
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params.max_tokens)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if num_blocks < 256:
        assert sched.num_preemptions > 0
    # Every cached block holds what its hash says: computed, accepted tokens only.
    for block in bm.blocks:
        if block.block_hash is not None:
            assert bm._hash_fn(block.parent_hash, block.token_ids) == block.block_hash
