"""Tests for roseinfer.runner.sampler (tiny vocabularies, CPU, fast)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from roseinfer.runner.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    greedy_tokens,
)
from roseinfer.runner.sampling_batch import is_plain_greedy
from roseinfer.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def make_batch(
    params: Sequence[SamplingParams],
    vocab: int,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    suppress: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    b = len(params)
    return SamplingBatch.from_requests(
        params,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        generators if generators is not None else [None] * b,
        suppress if suppress is not None else [[] for _ in range(b)],
        vocab,
        CPU,
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(x: torch.Tensor) -> list[list[int]]:
    """Indices of finite entries per row."""
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in x]


# --------------------------------------------------------------- SamplingBatch


def test_from_requests_flags_and_neutral_greedy_rows() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3),
        SamplingParams(temperature=0.7, top_k=-1),
        SamplingParams(temperature=1.0, top_k=100, logprobs=2),
    ]
    batch = make_batch(params, 8, generators=[gen(0), gen(1), None])
    assert batch.batch_size == 3 and batch.vocab_size == 8
    assert batch.greedy.tolist() == [True, False, False]
    assert batch.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0])
    assert batch.top_k.tolist() == [8, 8, 8]  # greedy, -1 and k > V are all "off"
    assert batch.top_p.tolist() == [1.0, 1.0, 1.0] and batch.min_p.tolist() == [0.0] * 3
    assert not (batch.all_greedy or batch.any_topk or batch.any_topp or batch.any_minp)
    assert batch.any_greedy and not batch.any_penalty and not batch.any_suppress
    assert batch.seeded_rows == (1,)  # the greedy row's generator is not used
    assert batch.max_num_logprobs == 2
    assert batch.output_token_counts is None and batch.suppress_mask is None


def test_token_counts_scatter() -> None:
    params = [SamplingParams(frequency_penalty=0.1), SamplingParams()]
    batch = make_batch(params, 5, prompts=[[4, 4], [0]], outputs=[[1, 1, 3], []])
    assert batch.any_penalty
    assert batch.output_token_counts is not None and batch.seen_token_mask is not None
    assert batch.output_token_counts.tolist() == [[0, 2, 0, 1, 0], [0] * 5]
    assert batch.seen_token_mask.tolist() == [
        [False, True, False, True, True],
        [True, False, False, False, False],
    ]


def test_from_requests_rejects_bad_inputs() -> None:
    p = SamplingParams(presence_penalty=0.5)
    with pytest.raises(ValueError, match="token ids"):
        make_batch([p], 4, outputs=[[4]])
    with pytest.raises(ValueError, match="token ids"):
        make_batch([SamplingParams()], 4, suppress=[[-1]])
    with pytest.raises(ValueError, match="generators"):
        make_batch([p, p], 4, generators=[None])


# ----------------------------------------------------------------- processors


def test_top_k_keeps_exactly_k_even_with_ties() -> None:
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0, 5.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    out = apply_top_k_top_p(x, torch.tensor([2, 3]), None)
    assert kept(out) == [[1, 4], [0, 1, 2]]  # stable sort: first tied tokens win
    assert out[0, 4] == 5.0 and out[0, 1] == 3.0  # survivors untouched
    full = apply_top_k_top_p(x, torch.tensor([5, 5]), None)
    assert torch.equal(full, x)


def test_top_p_keeps_minimal_nucleus() -> None:
    # probs 0.5, 0.25, 0.15, 0.1 (shuffled positions)
    probs = torch.tensor([[0.15, 0.5, 0.1, 0.25]])
    x = probs.log().repeat(4, 1)
    top_p = torch.tensor([0.5, 0.6, 0.8, 0.95])
    # 0.5 reaches 0.5 alone; 0.6 needs 0.5+0.25; 0.8 needs +0.15 (0.9); 0.95 needs all.
    out = apply_top_k_top_p(x, None, top_p)
    assert kept(out) == [[1], [1, 3], [0, 1, 3], [0, 1, 2, 3]]
    # top token is always kept even for a tiny top_p; top_p=1 keeps everything
    out = apply_top_k_top_p(x[:2], None, torch.tensor([1e-6, 1.0]))
    assert kept(out) == [[1], [0, 1, 2, 3]]


def test_top_k_then_top_p_uses_renormalised_probs() -> None:
    # top-2 of [0.4, 0.3, 0.2, 0.1] renormalises to [4/7, 3/7]: top_p 0.55 keeps only the top.
    x = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    out = apply_top_k_top_p(x, torch.tensor([2]), torch.tensor([0.55]))
    assert kept(out) == [[0]]
    out = apply_top_k_top_p(x, None, torch.tensor([0.55]))
    assert kept(out) == [[0, 1]]


def test_min_p_threshold() -> None:
    x = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    out = apply_min_p(x, torch.tensor([0.0, 0.5, 0.35]))
    # thresholds: 0, 0.25, 0.175
    assert kept(out) == [[0, 1, 2, 3], [0, 1], [0, 1]]
    out = apply_min_p(x[:1], torch.tensor([0.29]))  # 0.145 keeps 0.15
    assert kept(out) == [[0, 1, 2]]


def test_penalties_hand_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    seen = torch.tensor([[True, True, True, False, False]])  # prompt [0], output [1, 1, 2]
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]])
    one = torch.tensor
    rep = apply_penalties(logits, seen, counts, one([2.0]), one([0.0]), one([0.0]))
    assert rep.tolist() == [[1.0, -2.0, 0.25, 3.0, 1.0]]
    pf = apply_penalties(logits, seen, counts, one([1.0]), one([0.5]), one([0.25]))
    # token 1: -1 - 0.5 - 2 * 0.25; token 2: 0.5 - 0.5 - 0.25; prompt-only token 0 untouched
    assert pf.tolist() == [[2.0, -2.0, -0.25, 3.0, 1.0]]
    both = apply_penalties(logits, seen, counts, one([2.0]), one([0.5]), one([0.25]))
    assert both.tolist() == [[1.0, -3.0, -0.5, 3.0, 1.0]]


# -------------------------------------------------------------------- Sampler


def test_greedy_fast_path_is_argmax_and_consumes_no_rng() -> None:
    logits = torch.randn(4, 11, generator=gen(0))
    batch = make_batch([SamplingParams(temperature=0.0)] * 4, 11, generators=[gen(1)] * 4)
    state = torch.get_rng_state()
    out = Sampler()(logits, batch)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_penalties_change_greedy_choice_end_to_end() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 2 -> 1, 1.5 wins
        SamplingParams(temperature=0.0, frequency_penalty=1.0),  # 2 - 2*1 = 0, 1.5 wins
        SamplingParams(temperature=0.0),  # no penalty on this row
    ]
    batch = make_batch(params, 4, prompts=[[0], [], [0]], outputs=[[], [0, 0], [0, 0]])
    before = logits.clone()
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == [2, 2, 0]
    assert torch.equal(logits, before)  # input untouched


def test_suppression_greedy_and_sampled() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    batch = make_batch(params, 5, suppress=[[0], [0, 1]])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(20):
            out = Sampler()(logits, batch)
            assert out.token_ids[0] == 1
            assert out.token_ids[1] in (2, 3, 4)


def test_temperature_zero_equals_argmax_in_mixed_batch() -> None:
    v = 16
    logits = torch.randn(6, v, generator=gen(3))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.1),
        SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=1),  # sampled but degenerate -> argmax
        SamplingParams(temperature=0.0),
    ]
    g = gen(9)
    batch = make_batch(params, v, generators=[g, None, None, gen(2), None, None])
    state = g.get_state()
    top3 = logits.topk(3, dim=-1).indices
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(10):
            out = Sampler()(logits, batch).token_ids
            argmax = logits.argmax(-1)
            assert out[[0, 2, 4, 5]].tolist() == argmax[[0, 2, 4, 5]].tolist()
            assert out[1] in top3[1]
    assert torch.equal(g.get_state(), state)  # greedy row never advanced its generator


def test_temperature_scaling_distribution() -> None:
    # p(1) = 2/3 at T=1; logits / T: T=0.5 -> 4/5, T=2 -> sqrt2 / (1 + sqrt2).
    n = 4000
    temps = [0.5, 1.0, 2.0]
    expected = [0.8, 2 / 3, math.sqrt(2) / (1 + math.sqrt(2))]
    logits = torch.tensor([[0.0, math.log(2.0)]]).repeat(n * len(temps), 1)
    params = [SamplingParams(temperature=t) for t in temps for _ in range(n)]
    batch = make_batch(params, 2)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        tokens = Sampler()(logits, batch).token_ids.view(len(temps), n)
    freq = tokens.float().mean(dim=1).tolist()
    for f, e in zip(freq, expected, strict=True):
        assert abs(f - e) < 0.03, (freq, expected)


def test_top_k_sampling_support_and_proportions() -> None:
    n = 3000
    logits = torch.tensor([[3.0, 0.0, 3.0 + math.log(3.0), -1.0, 2.0]]).repeat(n, 1)
    batch = make_batch([SamplingParams(top_k=2)] * n, 5)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        tokens = Sampler()(logits, batch).token_ids
    assert set(tokens.tolist()) <= {0, 2}
    assert abs((tokens == 2).float().mean().item() - 0.75) < 0.03


def _run_steps(logits: torch.Tensor, batch_factory, steps: int) -> list[list[int]]:
    sampler = Sampler()
    return [sampler(logits, batch_factory()).token_ids.tolist() for _ in range(steps)]


def test_seeded_rows_reproducible_across_batch_composition() -> None:
    v, steps = 64, 6
    row = torch.randn(1, v, generator=gen(5)) * 0.3  # flat-ish: tokens vary per step
    p_seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)

    g_alone = gen(42)
    alone = make_batch([p_seeded], v, generators=[g_alone])
    solo = [t[0] for t in _run_steps(row, lambda: alone, steps)]
    assert len(set(solo)) > 1

    others = torch.randn(3, v, generator=gen(6))
    logits = torch.cat([others[:2], row, others[2:]])  # seeded row at position 2
    params = [
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.0),
        p_seeded,
        SamplingParams(temperature=0.5, seed=7, min_p=0.1),
    ]
    g_mixed = gen(42)
    mixed = make_batch(params, v, generators=[None, None, g_mixed, gen(7)])
    with torch.random.fork_rng():
        torch.manual_seed(99)
        got = [t[2] for t in _run_steps(logits, lambda: mixed, steps)]
    assert got == solo

    # Same row at position 0 of a different, all-seeded batch.
    g_first = gen(42)
    first = make_batch([p_seeded, params[3]], v, generators=[g_first, gen(8)])
    got = [t[0] for t in _run_steps(torch.cat([row, others[2:]]), lambda: first, steps)]
    assert got == solo


def test_logprobs_are_raw_log_softmax() -> None:
    v = 10
    logits = torch.randn(3, v, generator=gen(11))
    params = [
        SamplingParams(temperature=0.7, top_k=4, presence_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, logprobs=1),
    ]
    batch = make_batch(params, v, outputs=[[1, 2], [3], []], suppress=[[0], [], []])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler()(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32
    expected = raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (3, 3) and ids.dtype == torch.int64
    ref_values, ref_ids = raw.topk(3, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(values, ref_values)


def test_logprobs_zero_gives_sampled_logprob_only() -> None:
    logits = torch.randn(2, 6, generator=gen(12))
    batch = make_batch([SamplingParams(temperature=0.0, logprobs=0)] * 2, 6)
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.top_logprobs is None and out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).amax(-1))


def test_rejects_wrong_logits_shape() -> None:
    batch = make_batch([SamplingParams()], 4)
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.zeros(1, 5), batch)


def test_inverse_cdf_never_picks_zero_probability_tokens() -> None:
    from roseinfer.runner.sampler import sample_inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 1e-12], dtype=torch.float64)
    for chunk in (1024, 2, 3):
        assert sample_inverse_cdf(probs, u, chunk=chunk).tolist() == [1, 1, 3, 3]
    one_hot = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    for value in (0.0, 0.5, 1.0 - 1e-12, 1.0):  # u = 1.0 is out of range yet stays safe
        u1 = torch.tensor([value], dtype=torch.float64)
        for chunk in (1024, 2, 3):
            assert sample_inverse_cdf(one_hot, u1, chunk=chunk).tolist() == [2]


@pytest.mark.parametrize("chunk", [1024, 4, 3])
def test_inverse_cdf_matches_probabilities(chunk: int) -> None:
    from roseinfer.runner.sampler import sample_inverse_cdf

    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.0, 0.0, 0.3, 0.4, 0.0, 0.0, 0.0]])
    draws = 20000
    u = torch.rand(draws, dtype=torch.float64, generator=gen)
    picks = sample_inverse_cdf(probs.expand(draws, -1).contiguous(), u, chunk=chunk)
    freq = torch.bincount(picks, minlength=10).double() / draws
    assert freq[probs[0] == 0].sum() == 0
    torch.testing.assert_close(freq, probs[0].double(), atol=0.015, rtol=0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),  # greedy fast path
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),  # greedy, processed
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
])
@pytest.mark.parametrize("bad", ["nan", "inf", "all_masked"])
def test_unsampleable_row_is_flagged_and_ids_stay_in_vocab(params, bad) -> None:  # noqa: ANN001
    v = 1000  # not a multiple of the inverse-CDF chunk
    logits = torch.randn(3, v, generator=gen(0))
    suppress: list[list[int]] = [[], [], []]
    if bad == "nan":
        logits[1, 7] = float("nan")
    elif bad == "inf":
        logits[1, 7] = float("inf")
    else:
        suppress[1] = list(range(v))
    batch = SamplingBatch.from_requests([params] * 3, [[1, 2]] * 3, [[3]] * 3,
                                        [None] * 3, suppress, v, torch.device("cpu"))
    out = Sampler(gen(1))(logits, batch)
    ids = out.token_ids.tolist()
    assert all(0 <= t < v for t in ids)
    assert out.valid is not None and out.valid.tolist() == [True, False, True]


def test_greedy_tokens_equal_the_samplers_greedy_rows() -> None:
    """The engine's all-greedy shortcut (no SamplingBatch) picks what the sampler picks,
    ties (first maximum), NaN (first NaN), +inf and all -inf rows included, and flags
    the same rows as unsampleable."""
    nan, inf = float("nan"), float("inf")
    logits = torch.randn(8, 50, generator=gen(0))
    logits[1, 4] = logits[1, 9] = logits[1].max() + 1  # a tie
    logits[2, 6], logits[2, 30] = nan, nan
    logits[3, 11], logits[3, 40] = inf, inf
    logits[4] = -inf
    logits[5, 3], logits[5, 8] = inf, nan
    params = [SamplingParams(temperature=0.0)] * 8
    out = Sampler()(logits, make_batch(params, 50))
    ids, finite = greedy_tokens(logits)
    assert ids == out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.valid is not None and finite == out.valid.tolist()
    assert ids[1:6] == [4, 6, 11, 0, 8] and finite[:6] == [True, True, False, False, False, False]


@pytest.mark.parametrize(("params", "plain"), [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, logit_bias={}), True),
    (SamplingParams(temperature=0.5), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1), False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0.0, frequency_penalty=0.5), False),
    (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), False),
    (SamplingParams(temperature=0.0, allowed_token_ids=(1, 2)), False),
    (SamplingParams(temperature=0.0, logprobs=0), False),
])
def test_is_plain_greedy(params: SamplingParams, plain: bool) -> None:
    assert is_plain_greedy(params) is plain
