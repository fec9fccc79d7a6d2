"""Property: the sampler is row-local, bitwise (issue #11, "deterministic by default").

A deterministic row (greedy, or sampled with its own seed) yields the same token,
the same logprob entries and the same ``valid`` flag when it is sampled alone and
when it sits at any position of a batch of other random rows, whatever features
those rows switch on (batch-level fast-path flags: ``all_greedy``, ``any_topk``,
``any_topp``, ``any_minp``, ``any_penalty``, suppression / allowed masks, logit bias,
the batch's largest ``logprobs``). Values are compared bit for bit (NaN as NaN).
Vocabularies above 1024 exercise the chunked inverse-CDF sampler, and batches of up
to 24 rows the multi-threaded paths of torch's reductions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.runner import sampler as sampler_module
from roseinfer.runner.sampler import Sampler, SamplingBatch, top_logprobs
from roseinfer.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCABS = (5, 64, 300, 1500, 2100)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Row:
    """One request's row: its logits and everything ``from_requests`` takes per row."""

    logits: torch.Tensor  # [V] float32
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    suppress: list[int]  # min_tokens: EOS + stop ids while below min_tokens
    grammar: torch.Tensor | None  # [V] bool allowed ids (structured outputs) or None

    @property
    def deterministic(self) -> bool:
        return self.params.temperature == 0.0 or self.params.seed is not None


@dataclass(frozen=True)
class RowResult:
    token: int
    valid: bool
    logprob: torch.Tensor | None  # [] float32
    top_ids: list[int] | None
    top_values: torch.Tensor | None  # [n] float32
    probs: torch.Tensor | None  # [V] the final distribution drawn from (sampled rows)
    u: float | None  # the row's U[0, 1) draw (sampled rows)


def make_logits(seed: int, vocab: int, scale: float, ties: bool, special: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * scale
    if ties:  # a coarse grid: many equal logits (argmax, sort, topk tie-breaks)
        x = torch.round(x * 2) / 2
    if special == "some_neginf":
        x[torch.rand(vocab, generator=g) < 0.3] = float("-inf")
    elif special == "all_neginf":
        x[:] = float("-inf")
    elif special == "nan":
        x[int(torch.randint(vocab, (1,), generator=g))] = float("nan")
    elif special == "posinf":
        x[int(torch.randint(vocab, (1,), generator=g))] = float("inf")
    return x


def random_row(seed: int, vocab: int, deterministic: bool = False) -> Row:
    """A random row: logits of a random scale (ties, -inf, NaN, +inf sometimes) and a
    random mix of every per-row feature; ``deterministic``: greedy or seeded."""
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    def maybe(value: object, p: float = 0.4) -> object:
        return value if rng.random() < p else None

    logits = make_logits(rng.getrandbits(31), vocab, rng.choice([0.1, 1.0, 1.0, 2.0, 4.0, 30.0]),
                         rng.random() < 0.3, rng.choice(["none"] * 6 + [
                             "some_neginf", "all_neginf", "nan", "posinf"]))
    greedy = rng.random() < 0.4
    seed_value = rng.getrandbits(40)
    params = SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.9, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 3, 50]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.7]),
        logit_bias=maybe({t: rng.choice([-100.0, -2.5, 3.0, 100.0]) for t in ids(1, 4)}, 0.3),
        allowed_token_ids=maybe(tuple(ids(1, 8)), 0.2),
        logprobs=rng.choice([None, None, 0, 1, 5, 20]),
        seed=seed_value if deterministic and not greedy else maybe(seed_value, 0.6),
        max_tokens=64,
    )
    grammar = None
    if rng.random() < 0.15:
        grammar = torch.rand(vocab, generator=torch.Generator().manual_seed(seed)) < 0.5
    return Row(logits, params, ids(0, 12), ids(0, 12), ids(0, 3), grammar)


def sample(batch_rows: list[Row], vocab: int) -> list[RowResult]:
    """Sample a batch the way ``StepSampler`` does: fresh generators from each row's
    seed, grammar masks all True on unconstrained rows, top logprobs cut to each row's
    n; the distribution and uniform draw of sampled rows are captured on the way."""
    gens = [torch.Generator().manual_seed(r.params.seed) if r.params.seed is not None else None
            for r in batch_rows]
    grammar = None
    if any(r.grammar is not None for r in batch_rows):
        grammar = torch.stack([r.grammar if r.grammar is not None
                               else torch.ones(vocab, dtype=torch.bool) for r in batch_rows])
    batch = SamplingBatch.from_requests(
        [r.params for r in batch_rows], [r.prompt for r in batch_rows],
        [r.output for r in batch_rows], gens, [r.suppress for r in batch_rows], vocab, CPU,
        allowed_mask=grammar)
    seen: dict[str, torch.Tensor] = {}
    real = sampler_module.sample_inverse_cdf

    def spy(probs: torch.Tensor, u: torch.Tensor, **kw: bool) -> object:
        seen["probs"], seen["u"] = probs, u
        return real(probs, u, **kw)

    with mock.patch.object(sampler_module, "sample_inverse_cdf", spy):
        out = Sampler(torch.Generator().manual_seed(0))(
            torch.stack([r.logits for r in batch_rows]), batch)
    results = []
    for k, r in enumerate(batch_rows):
        n = r.params.logprobs
        top_ids = top_values = None
        if n is not None and out.top_logprobs is not None:
            top_ids, top_values = out.top_logprobs[0][k, :n].tolist(), out.top_logprobs[1][k, :n]
        sampled = r.params.temperature != 0.0 and "probs" in seen
        results.append(RowResult(
            int(out.token_ids[k]), bool(out.valid[k]) if out.valid is not None else True,
            out.logprobs[k] if n is not None else None,
            top_ids if n else ([] if n == 0 else None), top_values if n else None,
            seen["probs"][k] if sampled else None, float(seen["u"][k]) if sampled else None))
    return results


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal float tensors; NaN matches NaN (its payload is not meaningful)."""
    if a is None or b is None:
        return a is None and b is None
    nan = a.isnan()
    return (torch.equal(nan, b.isnan())
            and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def assert_same(alone: RowResult, batched: RowResult, where: str) -> None:
    assert (batched.token, batched.valid) == (alone.token, alone.valid), where
    assert same_bits(batched.logprob, alone.logprob), where
    assert batched.top_ids == alone.top_ids, where
    assert same_bits(batched.top_values, alone.top_values), where
    assert same_bits(batched.probs, alone.probs), where
    assert batched.u == alone.u, where


seeds = st.integers(0, 2**32 - 1)


@SETTINGS
@given(st.sampled_from(VOCABS), st.lists(seeds, min_size=2, max_size=24))
def test_every_deterministic_row_matches_its_row_alone(vocab: int, row_seeds: list[int]) -> None:
    batch_rows = [random_row(s, vocab) for s in row_seeds]
    batched = sample(batch_rows, vocab)
    for k, row in enumerate(batch_rows):
        if row.deterministic:
            assert_same(sample([row], vocab)[0], batched[k], f"row {k} of {len(batch_rows)}")


@SETTINGS
@given(st.sampled_from(VOCABS), seeds, st.lists(seeds, min_size=1, max_size=15), st.data())
def test_a_row_at_any_position_of_a_batch(vocab: int, row_seed: int, other_seeds: list[int],
                                          data: st.DataObject) -> None:
    """Among rows that switch on features it does not use (or the same ones)."""
    row = random_row(row_seed, vocab, deterministic=True)
    others = [random_row(s, vocab) for s in other_seeds]
    position = data.draw(st.integers(0, len(others)), label="position")
    batch_rows = others[:position] + [row] + others[position:]
    assert_same(sample([row], vocab)[0], sample(batch_rows, vocab)[position],
                f"position {position} of {len(batch_rows)}")


@pytest.mark.parametrize("vocab", [300, 4096])
def test_top_logprobs_ties_do_not_depend_on_the_batch_n(vocab: int) -> None:
    """Equal logprobs: a row's top-m is the same whatever larger n the batch asks for
    (``topk``'s own tie order changes with k); ties go to the lowest id."""
    x = torch.round(torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 2) / 2
    raw = torch.log_softmax(x, dim=-1)
    for m in (1, 2, 5):
        ids_m, values_m = top_logprobs(raw, m)
        for n in (m + 1, 20):
            ids_n, values_n = top_logprobs(raw, n)
            assert torch.equal(ids_n[:, :m], ids_m) and torch.equal(values_n[:, :m], values_m)
    want_values, want_ids = raw.sort(dim=-1, descending=True, stable=True)
    ids, values = top_logprobs(raw, 20)
    assert torch.equal(ids, want_ids[:, :20]) and torch.equal(values, want_values[:, :20])


def test_neutral_values_leave_a_row_bitwise_unchanged() -> None:
    """What a row gets when other rows switch a batch-level flag on (top-k = V,
    top-p = 1, min-p = 0, penalties 1 / 0 / 0) returns its logits bit for bit."""
    vocab = 2100
    x = torch.stack([make_logits(s, vocab, scale, ties, special) for s, (scale, ties, special)
                     in enumerate([(1.0, False, "none"), (4.0, True, "none"),
                                   (30.0, False, "some_neginf"), (1.0, False, "nan"),
                                   (2.0, True, "posinf"), (1.0, False, "all_neginf")])])
    b = x.shape[0]
    ones, zeros = torch.ones(b), torch.zeros(b)
    full_k = torch.full((b,), vocab, dtype=torch.int64)
    counts = torch.randint(0, 3, (b, vocab)).float()
    for got in (sampler_module.apply_top_k_top_p(x, full_k, ones),
                sampler_module.apply_top_k_top_p(x, full_k, None),
                sampler_module.apply_top_k_top_p(x, None, ones),
                sampler_module.apply_min_p(x, zeros),
                sampler_module.apply_penalties(x, counts > 0, counts, ones, zeros, zeros)):
        assert same_bits(got, x)


def test_real_vocabulary_batch_of_64() -> None:
    """SmolLM2's vocabulary (48 chunks of the inverse-CDF sampler, 3M-element reductions
    split over the threads): every deterministic row of 64 matches its row alone."""
    vocab = 49152
    batch_rows = [random_row(s, vocab) for s in range(64)]
    batched = sample(batch_rows, vocab)
    checked = 0
    for k, row in enumerate(batch_rows):
        if row.deterministic:
            assert_same(sample([row], vocab)[0], batched[k], f"row {k} of 64")
            checked += 1
    assert checked >= 16
