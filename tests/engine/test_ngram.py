"""NgramIndex: prompt-lookup drafts (longest n-gram first, latest occurrence, periodic
continuation, incremental indexing) and SpecState's shadow scoring."""

from __future__ import annotations

import random

import pytest

from roseinfer.engine.ngram import NgramIndex
from roseinfer.engine.spec_decode import SpecState


def test_no_match_no_draft() -> None:
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 3).propose([1, 2, 3, 1], 4) == []  # a 1-gram is below min_n


def test_copies_what_followed_the_match() -> None:
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert NgramIndex(1, 3).propose(tokens, 3) == [3, 4, 5]


def test_longest_ngram_wins_over_a_later_shorter_one() -> None:
    # "2" last occurred before 7, but "1 2" occurred before 3.
    tokens = [1, 2, 3, 4, 2, 7, 1, 2]
    assert NgramIndex(1, 2).propose(tokens, 2) == [3, 4]
    assert NgramIndex(1, 1).propose(tokens, 2) == [7, 1]


def test_latest_occurrence_wins() -> None:
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert NgramIndex(2, 2).propose(tokens, 1) == [2]


def test_periodic_continuation_past_the_end() -> None:
    assert NgramIndex(1, 2).propose([4, 7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert NgramIndex(1, 3).propose([3, 3, 3], 4) == [3, 3, 3, 3]


def test_zero_k_indexes_only() -> None:
    idx = NgramIndex(1, 2)
    assert idx.propose([1, 2, 3, 1], 0) == []
    assert idx.propose([1, 2, 3, 1], 2) == [2, 3]


def test_incremental_equals_fresh() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    inc = NgramIndex(1, 4)
    for end in range(1, len(tokens) + 1):
        assert inc.propose(tokens[:end], 5) == NgramIndex(1, 4).propose(tokens[:end], 5)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)


def test_shadow_scores_drafts_that_were_not_fed() -> None:
    state = SpecState(NgramIndex(1, 2))
    rate0 = state.rate
    state.shadow, state.shadow_at = [7, 8, 9, 10, 11], 2
    state.check_shadow([1, 2, 7])  # confirmed so far: wait
    assert state.shadow is not None and state.rate == rate0
    state.check_shadow([1, 2, 7, 8, 4])  # refuted at the third: 2 of 3
    assert state.shadow is None
    assert state.accepted == pytest.approx(0.7 * rate0 + 2)
    assert state.verified == pytest.approx(0.7 + 3)
    state.shadow, state.shadow_at = [5], 5
    state.check_shadow([1, 2, 7, 8, 4, 6])  # refuted at once
    assert state.shadow is None and state.rate < 0.7
    low = state.rate
    state.shadow, state.shadow_at = [1, 2, 3, 4, 5], 6
    state.check_shadow([1, 2, 7, 8, 4, 6, 1, 2, 3])  # 3 confirmed: enough to count
    assert state.shadow is None and state.rate > low
