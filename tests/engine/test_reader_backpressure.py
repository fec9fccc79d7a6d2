"""Backpressure: a request whose reader has fallen behind is held, not decoded.

``AsyncEngine`` holds a request once ``max_unread_outputs`` of its outputs wait untaken
(a streaming client that stopped reading); the scheduler then gives it no row and, when
others need them, its seat and KV blocks first. Holding changes when tokens are
computed, never which: the output equals an unheld run.
"""

from __future__ import annotations

import asyncio

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.request import RequestStatus
from roseinfer.sampling_params import SamplingParams
from tests.engine.test_output_stream import PROMPT, char_engine, params
from tests.engine.test_scheduler import drain, fake_step, make_req, make_sched, reference_output


# ------------------------------------------------------------------ scheduler
def test_held_running_request_is_not_scheduled():
    sched = make_sched()
    a, b = make_req("a", [3, 4, 5], 6), make_req("b", [6, 7], 6)
    a.group_id, b.group_id = "a", "b"
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)  # both prefilled
    sched.held = frozenset({"a"})
    before = a.num_output_tokens
    for _ in range(3):
        out = fake_step(sched)
        assert [s.request.request_id for s in out.scheduled] == ["b"]
    assert a.num_output_tokens == before and a.status is RequestStatus.RUNNING
    sched.held = frozenset()
    drain(sched)
    assert a.output_token_ids == reference_output([3, 4, 5], 6)  # same tokens once released
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_held_request_gives_its_seat_and_blocks_to_a_waiting_one():
    sched = make_sched(num_blocks=4, block_size=4, max_seqs=1)
    a = make_req("a", [3, 4, 5, 6, 7, 8, 9], 8)
    a.group_id = "a"
    sched.add_request(a)
    fake_step(sched)
    sched.held = frozenset({"a"})
    b = make_req("b", [10, 11, 12, 13, 14, 15, 16, 17, 18], 4)
    b.group_id = "b"
    sched.add_request(b)
    out = fake_step(sched)  # a is preempted for b (the seat), and stays out while held
    assert [r.request_id for r in out.preempted] == ["a"]
    assert [s.request.request_id for s in out.scheduled] == ["b"]
    for _ in range(20):
        if b.is_finished:
            break
        fake_step(sched)
    assert b.is_finished and a.status is RequestStatus.PREEMPTED
    assert a in sched.waiting and sched.num_held == 1
    sched.held = frozenset()
    drain(sched)
    assert a.output_token_ids == reference_output([3, 4, 5, 6, 7, 8, 9], 8)
    assert b.output_token_ids == reference_output([10, 11, 12, 13, 14, 15, 16, 17, 18], 4)


def test_held_request_is_preempted_before_a_running_one():
    sched = make_sched(num_blocks=6, block_size=4, max_seqs=4)
    a, b = make_req("a", [3, 4, 5], 12), make_req("b", [6, 7, 8], 12)
    a.group_id, b.group_id = "a", "b"
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    sched.held = frozenset({"a"})  # the older one is held: it goes first, not b
    for _ in range(40):
        out = fake_step(sched)
        assert b not in out.preempted
        if b.is_finished:
            break
    assert b.is_finished and b.output_token_ids == reference_output([6, 7, 8], 12)
    sched.held = frozenset()
    drain(sched)
    assert a.output_token_ids == reference_output([3, 4, 5], 12)


# --------------------------------------------------------------- async engine
def test_unread_stream_is_held_and_resumes_when_read():
    async def run() -> None:
        alone = char_engine()
        alone.add_request("ref", PROMPT, params(60))
        ref = None
        for _ in range(1000):
            for out in alone.step():
                ref = out
            if not alone.has_unfinished_requests():
                break
        ae = AsyncEngine(char_engine(), max_unread_outputs=4)
        ae.start()
        try:
            stalled = ae.add_request("s", PROMPT, params(60))
            for _ in range(300):  # the reader takes nothing: the request is held
                if ae.stats().num_held:
                    break
                await asyncio.sleep(0.01)
            assert ae.stats().num_held == 2  # both sequences (n=2)
            generated = ae.stats().generation_tokens_total
            other = ae.add_request("o", [9, 8, 7], SamplingParams(max_tokens=30,
                                                                   ignore_eos=True))
            outs = [o async for o in other]  # others run to the end meanwhile
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30
            steps = ae.engine.stats.computed_tokens_total
            await asyncio.sleep(0.3)  # nothing left but the held one: the loop waits
            assert ae.engine.stats.computed_tokens_total == steps
            assert ae.stats().generation_tokens_total - generated == 30
            final = None
            async for out in stalled:  # reading resumes it
                final = out
            assert final is not None and final.finished and ref is not None
            for c, r in zip(final.outputs, ref.outputs, strict=True):
                assert c.token_ids == r.token_ids and c.logprobs == r.logprobs
            assert ae.stats().num_held == 0
            bm = ae.engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks
        finally:
            ae.shutdown()

    asyncio.run(run())
