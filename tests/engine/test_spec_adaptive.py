"""Adaptive drafting without a model: a request whose drafts keep being rejected stops
feeding them (its proposals are only checked in the shadow), starts again as soon as its
text becomes predictable, and a compute-bound batch drafts only near-certain tokens; no
draft without an n-gram match; the step without drafts is timed now and then."""

from __future__ import annotations

import random

from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.engine.spec_decode import SpecDecoding
from roseinfer.engine.stats import EngineStats
from roseinfer.sampling_params import SamplingParams
from roseinfer.speculative_config import SpeculativeConfig

BATCH_1 = {1: 10.0, 2: 13.0, 3: 13.0, 4: 16.0, 5: 20.0, 6: 21.0, 7: 26.0, 8: 29.0, 9: 33.0}


def drafter(k: int = 8, costs: dict[int, float] = BATCH_1) -> SpecDecoding:
    spec = SpecDecoding(SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}), max_num_batched_tokens=256)
    for rows, ms in costs.items():
        spec.observe_step(rows, ms / 1000)
    return spec


def decoding(prompt: list[int]) -> Request:
    req = Request("r", prompt, SamplingParams(max_tokens=10_000))
    req.num_computed_tokens = req.num_tokens - 1
    return req


def step(spec: SpecDecoding, req: Request, next_token, stats: EngineStats) -> int:  # noqa: ANN001
    """One decode step: propose, verify against ``next_token(context)``, append. Returns
    the number of drafts fed."""
    spec.propose([req])
    drafts = req.spec_token_ids
    emitted = []
    context = list(req.all_token_ids)
    for d in [*drafts, None]:
        t = next_token(context)
        emitted.append(t)
        if t != d:
            break
        context.append(t)
    spec.record([ScheduledRequest(req, 1 + len(drafts), list(drafts))], [emitted], stats)
    for t in emitted:
        req.append_token(t)
    req.num_computed_tokens = req.num_tokens - 1
    return len(drafts)


def test_rejected_drafts_stop_then_copyable_text_restarts_them() -> None:
    spec, stats = drafter(), EngineStats(num_total_blocks=1)
    req = decoding([5, 6, 7, 8] * 10)  # every 1- to 3-gram matches

    def unpredictable(context: list[int]) -> int:  # random over 8 tokens
        return 5 + random.Random(len(context)).randrange(8)

    fed = [step(spec, req, unpredictable, stats) for _ in range(60)]
    assert sum(fed[:10]) > 0, "a fresh request drafts"
    # Rejected drafts stop being fed (a lucky shadow may bring one or two back briefly).
    assert sum(fed[20:]) <= 16 and sum(1 for n in fed[20:] if n) <= 8, fed
    assert req.spec is not None and req.spec.rate < 0.3  # the shadow keeps scoring

    period = [20, 21, 22, 23]
    for t in period * 3:  # a repeating pattern appears
        req.append_token(t)
    req.num_computed_tokens = req.num_tokens - 1

    def copying(context: list[int]) -> int:
        return period[(period.index(context[-1]) + 1) % 4] if context[-1] in period else 20

    fed = [step(spec, req, copying, stats) for _ in range(20)]
    assert sum(fed[:3]) == 0 and sum(fed[8:]) >= 12 * 3, fed
    assert stats.spec_decode_num_accepted_tokens > 0


def test_no_match_no_draft() -> None:
    spec = drafter()
    req = decoding([5, 6, 7, 8, 9])
    spec.propose([req])
    assert req.spec_token_ids == [] and (req.spec is None or req.spec.shadow is None)


def test_compute_bound_batch_drafts_only_likely_tokens() -> None:
    """16 rows cost 80 ms, each extra row 4 ms (a draft must be accepted with chance
    > 0.8 to pay): requests at rate 0.95 draft, those at 0.6 do not."""
    costs = {16: 80.0, 32: 144.0, 48: 208.0}
    spec = drafter(k=3, costs=costs)
    reqs = [decoding([5, 6, 7, 8, 5, 6, 7]) for _ in range(16)]
    for i, r in enumerate(reqs):
        spec.propose([r])  # creates the state
        assert r.spec is not None
        r.spec.accepted, r.spec.verified = (0.95, 1.0) if i < 4 else (0.6, 1.0)
    spec.propose(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [3] * 4 + [0] * 12


def test_untimed_plain_step_is_timed_first() -> None:
    """Steps of 16 rows were never timed: the first proposal runs a plain step."""
    spec = drafter(costs={24: 110.0, 32: 150.0})
    reqs = [decoding([5, 6, 7, 5, 6]) for _ in range(16)]
    spec.propose(reqs)
    assert all(r.spec_token_ids == [] for r in reqs)
    spec.observe_step(16, 0.080)
    spec.propose(reqs)
    assert any(r.spec_token_ids for r in reqs)
