"""How many drafted tokens a step can afford: step time vs rows, learned online.

Speculation pays only while a step's extra rows cost less than the tokens they are
expected to add. That depends on the machine and the weight format: on the CPU with the
default ``int8`` weights a 1-row decode reads int8 weights and 2+ rows an fp16 copy (2
rows cost ~1.6x one), and at 16+ rows a step is compute-bound (an extra row costs about
what it can earn). So the engine times its steps (``StepCostModel.observe``: tokens
computed, seconds) and ``plan_drafts`` picks, among the step's proposed drafts, the count
that maximises expected tokens per second, given each draft's chance of acceptance.

Other processes on the machine make single timings noisy, and only ever slower: each
row count keeps a *decaying minimum* of its timings (the smallest recent one, allowed to
creep up by ``_DRIFT`` per timing, so a context that grows is followed). A row count
never measured is interpolated between measured ones, or extrapolated optimistically
above them (``_PRIOR_ROW_COST`` of the per-row time at the largest measured count), so
a larger step is tried once and then known. The time of the step *without* drafts is
what every plan is measured against, yet a request that keeps drafting never runs it:
``fresh`` says whether a row count (or one within 1/8 of it) was timed recently, and the
drafter runs a plain step now and then to time it when it was not.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_DRIFT = 0.02  # a row count's estimate rises by this fraction per timing above it
_STALE = 256  # a timing older than this many step timings is not fresh
_PRIOR_ROW_COST = 0.2  # untried rows above the largest measured: this x its per-row time


class StepCostModel:
    """Seconds of an engine step by the number of tokens (rows) it computes."""

    def __init__(self) -> None:
        self._rows: list[int] = []  # sorted row counts with a measurement
        self._seconds: dict[int, float] = {}
        self._timed_at: dict[int, int] = {}  # row count -> number of the timing
        self._num_timings = 0

    def observe(self, num_rows: int, seconds: float) -> None:
        self._num_timings += 1
        self._timed_at[num_rows] = self._num_timings
        old = self._seconds.get(num_rows)
        if old is None:
            bisect.insort(self._rows, num_rows)
            self._seconds[num_rows] = seconds
        else:
            self._seconds[num_rows] = min(seconds, old * (1.0 + _DRIFT))

    def fresh(self, num_rows: int) -> bool:
        """Whether a step of about ``num_rows`` rows (within 1/8) was timed recently."""
        slack = num_rows // 8
        return any(self._num_timings - self._timed_at.get(n, -_STALE) < _STALE
                   for n in range(num_rows - slack, num_rows + slack + 1))

    def estimate(self, num_rows: int) -> float | None:
        """Expected seconds of a step of ``num_rows`` rows (None: nothing measured yet)."""
        known = self._seconds.get(num_rows)
        if known is not None:
            return known
        rows = self._rows
        if not rows:
            return None
        i = bisect.bisect_left(rows, num_rows)
        if i == len(rows):  # above every measurement: optimistic
            top = rows[-1]
            t = self._seconds[top]
            return t * (1.0 + _PRIOR_ROW_COST * (num_rows - top) / top)
        hi = rows[i]
        if i == 0:  # below every measurement: no cheaper than the smallest
            return self._seconds[hi] * num_rows / hi
        lo = rows[i - 1]
        t_lo, t_hi = self._seconds[lo], self._seconds[hi]
        return t_lo + (t_hi - t_lo) * (num_rows - lo) / (hi - lo)


def plan_drafts(cost: StepCostModel, base_rows: int, num_sampled: int,
                chances: Sequence[Sequence[float]], max_rows: int) -> list[int]:
    """How many of its drafts each request feeds this step.

    ``chances[r]``: for request r's drafts in order, the chance each is accepted (its
    drafts before it included; non-increasing). A step of ``base_rows`` rows samples
    ``num_sampled`` tokens without drafts; each draft adds a row and its chance to the
    expected tokens. The plan maximises expected tokens / estimated seconds, with at
    most ``max_rows`` rows in all; with no measurement yet, every draft that fits.
    """
    ranked = sorted(((p, r) for r, ps in enumerate(chances) for p in ps),
                    key=lambda item: -item[0])[:max(0, max_rows - base_rows)]
    best_n = len(ranked)
    base_time = cost.estimate(base_rows)
    if base_time is not None and base_time > 0:
        best_n, best = 0, num_sampled / base_time
        expected = float(num_sampled)
        for n, (p, _) in enumerate(ranked, 1):
            expected += p
            t = cost.estimate(base_rows + n)
            if t is not None and t > 0 and expected / t > best:
                best_n, best = n, expected / t
    counts = [0] * len(chances)
    for _, r in ranked[:best_n]:
        counts[r] += 1
    return counts
