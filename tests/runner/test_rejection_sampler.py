"""RejectionSampler: drafted tokens are verified so that the emitted tokens follow the
target distribution (after the request's filters) exactly as non-speculative sampling
would: acceptance with probability p(t), the residual (p without t, renormalised) on a
rejection, the next row's distribution after an acceptance; greedy rows accept exactly
the argmax; seeded rows are reproducible and leave their generator as plain sampling of
the emitted tokens would. Statistics over thousands of seeded draws of synthetic logits
(bounded, one batched call each)."""

from __future__ import annotations

import torch

from roseinfer.runner.rejection_sampler import RejectionSampler, accepted_rows
from roseinfer.runner.sampler import Sampler, SamplingBatch, apply_top_k_top_p
from roseinfer.sampling_params import SamplingParams

V = 6
CPU = torch.device("cpu")
ROW0 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # distribution of the first token
ROW1 = torch.tensor([0.0, 1.0, 0.2, 2.0, -0.5, 0.7])  # of the next, after the draft
ROW2 = ROW1.flip(0)  # of the one after, after two drafts
DRAFT = [1]  # the drafted first token: not the likeliest
PARAMS = SamplingParams(temperature=0.8, top_k=5, seed=0)  # top-k drops token 5


def target(row: torch.Tensor) -> torch.Tensor:
    """The distribution PARAMS sample ``row`` from: temperature, then top-k."""
    x = apply_top_k_top_p((row / PARAMS.temperature)[None], torch.tensor([PARAMS.top_k]), None)
    return torch.softmax(x, -1)[0]


def batch(num_chunks: int, params: SamplingParams, seed0: int = 0,
          draft: list[int] = DRAFT) -> tuple[torch.Tensor, SamplingBatch, list[torch.Generator]]:
    """``num_chunks`` chunks of 1 + len(draft) rows, each with its own seeded generator."""
    gens = [torch.Generator().manual_seed(seed0 + c) for c in range(num_chunks)]
    rows = len(draft) + 1
    logits = torch.stack([ROW0, ROW1, ROW2][:rows] * num_chunks)  # [C * rows, V]
    b = SamplingBatch.from_requests(
        [params] * (num_chunks * rows), [[]] * (num_chunks * rows),
        [list(draft[:j]) for _ in range(num_chunks) for j in range(rows)],
        [g for g in gens for _ in range(rows)], [[]] * (num_chunks * rows), V, CPU)
    return logits, b, gens


def emitted(out, num_chunks: int, rows: int) -> list[list[int]]:  # noqa: ANN001
    tokens = out.sampled.token_ids.tolist()
    return [tokens[c * rows:c * rows + n] for c, n in enumerate(out.num_emitted)]


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between empirical counts and a distribution."""
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_accepted_rows() -> None:
    assert accepted_rows([4], [True], []) == 1
    assert accepted_rows([4, 5, 6], [True] * 3, [4, 5]) == 3  # all drafts, then the bonus
    assert accepted_rows([4, 9, 6], [True] * 3, [4, 5]) == 2  # correction at row 1
    assert accepted_rows([7, 5, 6], [True] * 3, [4, 5]) == 1
    assert accepted_rows([4, 5, 6], [True, False, True], [4, 5]) == 1  # stop before a bad row
    assert accepted_rows([4, 5], [False, True], [4]) == 0


def test_distribution_is_the_target() -> None:
    n = 6000
    logits, b, _ = batch(n, PARAMS)
    runs = emitted(RejectionSampler(Sampler())(logits, b, [DRAFT] * n), n, 2)
    p0, p1 = target(ROW0), target(ROW1)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=V).float()
    assert tv(first, p0) < 0.03, "first token ~ p0"
    accepted = [r for r in runs if len(r) == 2]
    assert abs(len(accepted) / n - float(p0[DRAFT[0]])) < 0.03, "accepted with p0(t)"
    second = torch.bincount(torch.tensor([r[1] for r in accepted]), minlength=V).float()
    assert tv(second, p1) < 0.05, "after an acceptance, the next token ~ p1"
    rejected = torch.bincount(torch.tensor([r[0] for r in runs if len(r) == 1]),
                              minlength=V).float()
    residual = p0.clone()
    residual[DRAFT[0]] = 0.0
    assert rejected[DRAFT[0]] == 0 and tv(rejected, residual / residual.sum()) < 0.03
    assert first[5] == 0, "top-k's filtered token never comes out"


def test_same_as_plain_sampling_draw_for_draw() -> None:
    """Seeded chunks: the emitted tokens are what plain sampling of one row at a time
    with the same generator gives, and the generator ends in the same state."""
    n = 300
    draft = [1, 3]
    logits, b, gens = batch(n, PARAMS, seed0=1000, draft=draft)
    runs = emitted(RejectionSampler(Sampler())(logits, b, [draft] * n), n, 3)
    plain = Sampler()
    for c in range(n):
        g = torch.Generator().manual_seed(1000 + c)
        want: list[int] = []
        for j in range(3):
            row = SamplingBatch.from_requests([PARAMS], [[]], [draft[:j]], [g], [[]], V, CPU)
            token = int(plain(logits[3 * c + j][None], row).token_ids[0])
            want.append(token)
            if j == 2 or token != draft[j]:
                break
        assert runs[c] == want, f"chunk {c}"
        assert torch.equal(gens[c].get_state(), g.get_state()), f"generator of chunk {c}"
    assert {len(r) for r in runs} == {1, 2, 3}


def test_seeded_reproducible() -> None:
    a = RejectionSampler(Sampler())(*batch(50, PARAMS, seed0=7)[:2], [DRAFT] * 50)
    b = RejectionSampler(Sampler())(*batch(50, PARAMS, seed0=7)[:2], [DRAFT] * 50)
    assert torch.equal(a.sampled.token_ids, b.sampled.token_ids)
    assert a.num_emitted == b.num_emitted


def test_greedy_accepts_exactly_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    logits, b, _ = batch(2, greedy, draft=[0])
    out = RejectionSampler(Sampler())(logits, b, [[0], [0]])
    assert emitted(out, 2, 2) == [[0, 3], [0, 3]]  # argmax of ROW0 is 0, of ROW1 3
    logits, b, _ = batch(1, greedy, draft=[2])
    assert emitted(RejectionSampler(Sampler())(logits, b, [[2]]), 1, 2) == [[0]]


def test_unseeded_rows_follow_the_target_too() -> None:
    n = 4000
    params = SamplingParams(temperature=0.8, top_k=5)
    logits, b, _ = batch(n, params)
    b.generators = [None] * (2 * n)
    b.seeded_rows = ()
    sampler = Sampler(torch.Generator().manual_seed(3))
    runs = emitted(RejectionSampler(sampler)(logits, b, [DRAFT] * n), n, 2)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=V).float()
    assert tv(first, target(ROW0)) < 0.035
