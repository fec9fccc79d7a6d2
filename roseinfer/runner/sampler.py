"""Batched token sampling for one engine step.

``SamplingBatch.from_requests`` turns the per-request ``SamplingParams`` of the
running sequences into per-row tensors (plus flags that let the fast paths skip
work), and ``Sampler`` turns a ``[B, V]`` block of last-position logits into one
token per row. Everything is vectorised over the batch; the only per-row Python
loop draws the noise of *seeded* rows from their own generators, so that a
seeded row yields the same tokens whatever else is in the batch.

Processing order (vLLM / HF / OpenAI conventions):

1. masking to ``-inf``: ``suppress_token_ids`` (min_tokens: the engine passes EOS +
   stop_token_ids for rows below ``min_tokens``), then every id outside the row's
   ``allowed_mask`` (structured outputs: what its grammar allows next) or outside
   ``SamplingParams.allowed_token_ids``;
1b. ``SamplingParams.logit_bias`` added to its row (OpenAI: before sampling; a
   forbidden id stays forbidden);
2. repetition penalty (HF): over prompt AND output tokens,
   ``logit > 0 ? logit / p : logit * p``;
3. presence / frequency penalties (OpenAI): over OUTPUT tokens only,
   ``logit -= presence * (count > 0) + frequency * count``;
4. greedy rows: argmax of the penalised logits;
5. sampled rows: ``/ temperature`` -> top-k -> top-p -> min-p -> softmax -> one
   U[0, 1) draw per row (the row's own generator when seeded) mapped through the
   inverse CDF (``sample_inverse_cdf``).

Logprobs are always those of the raw model distribution (``log_softmax`` of the
logits passed in: before masks, bias and penalties), as vLLM reports them by default;
top logprobs are ordered by value, equal values by lowest id (``top_logprobs``).
Every step above is row-local, bitwise: a row's token, logprobs and validity never
depend on the other rows (flags switched on by other rows apply neutral values to it:
top-k = V, top-p = 1, min-p = 0, penalties 1 / 0 / 0, which leave its logits unchanged),
as ``tests/runner/test_sampler_row_local.py`` checks.

A row that cannot be sampled — every token masked, or a distribution that is not
finite (NaN / inf after penalties or temperature) — is flagged in
``SamplerOutput.valid`` instead of yielding a token; token ids are always inside
``[0, V)``. The engine fails that row's request alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F
from torch import Tensor

from roseinfer.runner.logit_constraints import combined_allowed_mask, logit_bias_entries
from roseinfer.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (dividing by ~0 overflows).
_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for a batch of B sequences over a vocab of V."""

    temperature: Tensor  # [B] float32, 1.0 on greedy rows
    top_k: Tensor  # [B] int64 in [1, V]; V where disabled or greedy
    top_p: Tensor  # [B] float32 in (0, 1]; 1.0 where greedy
    min_p: Tensor  # [B] float32 in [0, 1]; 0.0 where greedy
    repetition_penalty: Tensor  # [B] float32 (1.0 = off)
    presence_penalty: Tensor  # [B] float32 (0.0 = off)
    frequency_penalty: Tensor  # [B] float32 (0.0 = off)
    greedy: Tensor  # [B] bool
    generators: list[torch.Generator | None]  # None = unseeded row (default RNG)
    seeded_rows: tuple[int, ...]  # sampled (non-greedy) rows with a generator
    output_token_counts: Tensor | None  # [B, V] float32 counts of output tokens; None if no penalty
    seen_token_mask: Tensor | None  # [B, V] bool, prompt or output token; None if no penalty
    suppress_mask: Tensor | None  # [B, V] bool, True = forbidden; None if nothing suppressed
    allowed_mask: Tensor | None  # [B, V] bool, True = allowed; None if no row restricts
    logit_bias: tuple[Tensor, Tensor, Tensor] | None  # (rows, ids) int64, bias float32; [N] each
    max_num_logprobs: int | None  # max `logprobs` over rows; None = nobody asked
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    any_topk: bool
    any_topp: bool
    any_minp: bool
    any_penalty: bool

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @property
    def any_suppress(self) -> bool:
        return self.suppress_mask is not None or self.allowed_mask is not None

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        suppress_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
        allowed_mask: Tensor | None = None,
    ) -> SamplingBatch:
        """Build the batch; every sequence argument has one entry per row.

        ``allowed_mask``: [B, V] bool, the only ids each row may sample (structured
        outputs; all True on unconstrained rows), or None. Token ids of ``allowed_token_ids`` / ``logit_bias`` outside
        ``[0, V)`` raise ValueError (the engine validates them before queueing).
        """
        b, v = len(params), int(vocab_size)
        for name, seq in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
            ("suppress_token_ids", suppress_token_ids),
        ):
            if len(seq) != b:
                raise ValueError(f"{name} has {len(seq)} rows, expected {b}")
        if b == 0 or v <= 0:
            raise ValueError(f"need a non-empty batch and vocab, got B={b}, V={v}")

        greedy = [p.temperature < _GREEDY_EPS for p in params]
        # Neutral values on greedy rows so the flags only reflect sampled rows.
        temperature, top_k, top_p, min_p = [1.0] * b, [v] * b, [1.0] * b, [0.0] * b
        for i, p in enumerate(params):
            if not greedy[i]:
                temperature[i], top_p[i], min_p[i] = p.temperature, p.top_p, p.min_p
                top_k[i] = v if p.top_k <= 0 else min(p.top_k, v)
        rep = [float(p.repetition_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        freq = [float(p.frequency_penalty) for p in params]
        any_penalty = any(r != 1.0 for r in rep) or any(pres) or any(freq)

        counts = seen = None
        if any_penalty:
            counts = _token_counts(output_token_ids, v, device)
            seen = _token_counts(prompt_token_ids, v, device) > 0
            seen |= counts > 0
        suppress = None
        if any(len(ids) for ids in suppress_token_ids):
            suppress = _token_counts(suppress_token_ids, v, device) > 0

        requested = [p.logprobs for p in params if p.logprobs is not None]

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=f32(temperature),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=f32(top_p),
            min_p=f32(min_p),
            repetition_penalty=f32(rep),
            presence_penalty=f32(pres),
            frequency_penalty=f32(freq),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            seeded_rows=tuple(
                i for i, g in enumerate(generators) if g is not None and not greedy[i]
            ),
            output_token_counts=counts,
            seen_token_mask=seen,
            suppress_mask=suppress,
            allowed_mask=combined_allowed_mask(params, allowed_mask, v, device),
            logit_bias=logit_bias_entries(params, v, device),
            max_num_logprobs=max(requested) if requested else None,
            vocab_size=v,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_topk=any(k < v for k in top_k),
            any_topp=any(p < 1.0 for p in top_p),
            any_minp=any(p > 0.0 for p in min_p),
            any_penalty=any_penalty,
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: Tensor  # [B] int64, always in [0, V)
    logprobs: Tensor | None  # [B] float32 raw logprob of the sampled token
    top_logprobs: tuple[Tensor, Tensor] | None  # ([B, N] int64 ids, [B, N] float32), raw
    valid: Tensor | None = None  # [B] bool: False = nothing could be sampled; None = all valid


class Sampler:
    """Picks one token per row from ``[B, V]`` float logits.

    ``generator`` is the RNG of unseeded sampled rows (the engine seeds it from
    ``EngineConfig.seed``); None uses torch's default RNG.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.batch_size, batch.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != "
                f"(B={batch.batch_size}, V={batch.vocab_size})"
            )
        logits = logits.float()  # no copy when already float32
        plain = not (batch.any_penalty or batch.any_suppress or batch.logit_bias is not None)
        if batch.all_greedy and plain and batch.max_num_logprobs is None:
            token_ids = logits.argmax(dim=-1)  # a NaN / +inf row picks a non-finite entry
            return SamplerOutput(token_ids, None, None, _finite_at(logits, token_ids))

        # Out-of-place below: the caller's logits are never modified.
        x = logits  # [B, V]
        if batch.suppress_mask is not None:
            x = x.masked_fill(batch.suppress_mask, float("-inf"))
        if batch.allowed_mask is not None:
            x = torch.where(batch.allowed_mask, x, float("-inf"))
        if batch.logit_bias is not None:
            rows, ids, bias = batch.logit_bias
            x = x.index_put((rows, ids), bias, accumulate=True)
        if batch.any_penalty:
            assert batch.output_token_counts is not None and batch.seen_token_mask is not None
            x = apply_penalties(
                x,
                batch.seen_token_mask,
                batch.output_token_counts,
                batch.repetition_penalty,
                batch.presence_penalty,
                batch.frequency_penalty,
            )

        if batch.all_greedy:
            token_ids = x.argmax(dim=-1)
            valid = _finite_at(x, token_ids)
        else:
            token_ids, valid = self._sample(x, batch)
            if batch.any_greedy:
                greedy_ids = x.argmax(dim=-1)
                token_ids = torch.where(batch.greedy, greedy_ids, token_ids)
                valid = torch.where(batch.greedy, _finite_at(x, greedy_ids), valid)

        logprobs = top = None
        if batch.max_num_logprobs is not None:
            raw = torch.log_softmax(logits, dim=-1)  # [B, V]
            logprobs = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
            if batch.max_num_logprobs > 0:
                top = top_logprobs(raw, min(batch.max_num_logprobs, raw.shape[1]))
        return SamplerOutput(token_ids, logprobs, top, valid)

    def _sample(self, x: Tensor, batch: SamplingBatch) -> tuple[Tensor, Tensor]:
        """Temperature, top-k/top-p/min-p, then one inverse-CDF draw per row. x: [B, V]."""
        x = x / batch.temperature.unsqueeze(1)
        if batch.any_topk or batch.any_topp:
            x = apply_top_k_top_p(
                x,
                batch.top_k if batch.any_topk else None,
                batch.top_p if batch.any_topp else None,
            )
        if batch.any_minp:
            x = apply_min_p(x, batch.min_p)
        probs = torch.softmax(x, dim=-1)  # [B, V]
        u = uniform_draws(probs, batch.generators, batch.seeded_rows, self.generator)  # [B]
        return sample_inverse_cdf(probs, u, with_validity=True)


def apply_penalties(
    logits: Tensor,
    seen_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """Repetition (HF, prompt+output) then presence/frequency (OpenAI, output).

    logits [B, V]; seen_mask [B, V] bool; output_counts [B, V] float;
    penalties [B]. Returns a new [B, V] tensor.
    """
    rep = torch.where(seen_mask, repetition_penalty.unsqueeze(1), 1.0)  # [B, V]
    x = torch.where(logits > 0, logits / rep, logits * rep)
    x = x - frequency_penalty.unsqueeze(1) * output_counts
    return x - presence_penalty.unsqueeze(1) * (output_counts > 0).to(x.dtype)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask (to -inf) everything outside the per-row top-k, then the top-p nucleus.

    logits [B, V]; top_k [B] int64 in [1, V] (V = off); top_p [B] in (0, 1].
    Top-k keeps exactly k tokens even with ties. Top-p (on the top-k-renormalised
    distribution) keeps the smallest prefix of the sorted tokens whose cumulative
    probability reaches top_p; the top token is always kept. Returns a new tensor.
    """
    sorted_x, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)  # [V]
        sorted_x = sorted_x.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_x, dim=-1)  # [B, V]
        cum = probs.cumsum(dim=-1)  # [B, V]
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # mass above
        drop = before >= top_p.unsqueeze(1)
        drop &= (top_p < 1.0).unsqueeze(1)  # rounding must not trim top_p=1 rows
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_x)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose prob < min_p * max prob. logits [B, V]; min_p [B]."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def uniform_draws(
    probs: Tensor,
    generators: Sequence[torch.Generator | None],
    seeded_rows: Sequence[int],
    default_generator: torch.Generator | None = None,
) -> Tensor:
    """One U[0, 1) draw per row of probs [B, V] -> [B] float64.

    Unseeded rows share one draw of B values from ``default_generator`` (torch's
    default RNG when None); each row in ``seeded_rows`` draws from
    ``generators[row]``, so a seeded row's token depends only on its generator,
    never on the batch around it (greedy rows are left out of ``seeded_rows`` and
    leave their generator untouched).
    """
    b = probs.shape[0]
    u = torch.empty(b, dtype=torch.float64, device=probs.device)
    if len(seeded_rows) < b:
        u.uniform_(generator=default_generator)
    for i in seeded_rows:
        u[i : i + 1].uniform_(generator=generators[i])
    return u


def top_logprobs(raw: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n largest entries of each row of raw [B, V] -> ([B, n] int64 ids, [B, n] values):
    largest first, equal values by lowest id (NaN first), as a stable descending sort.

    ``topk`` alone is not enough: among equal values its choice and order depend on k,
    and k is the largest ``logprobs`` of the batch, so a row's top-m (m < k) would
    depend on the other rows. With one extra entry, a row whose n + 1 largest values
    are distinct (and not NaN) has a unique answer; the others (rare) stable-sort the
    ids whose value reaches their (n + 1)-th largest, in id order.
    """
    values, ids = raw.topk(min(n + 1, raw.shape[1]), dim=-1)  # [B, n(+1)], sorted
    ambiguous = (values[:, 1:] == values[:, :-1]).any(-1) | values.isnan().any(-1)  # [B]
    for r in ambiguous.nonzero().flatten().tolist():
        row = raw[r]
        cand = (torch.arange(row.shape[0], device=row.device) if bool(row.isnan().any())
                else (row >= values[r, -1]).nonzero().flatten())  # ascending ids
        sorted_values, order = row[cand].sort(descending=True, stable=True)
        values[r, :n], ids[r, :n] = sorted_values[:n], cand[order[:n]]
    return ids[:, :n], values[:, :n]


def _finite_at(x: Tensor, ids: Tensor) -> Tensor:
    """[B] bool: the chosen entry of each row of x [B, V] is finite (not -inf / NaN)."""
    return torch.isfinite(x.gather(1, ids.unsqueeze(1)).squeeze(1))


def sample_inverse_cdf(probs: Tensor, u: Tensor, chunk: int = 1024,
                       with_validity: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Token per row whose CDF interval holds u: probs [B, V] (rows sum to ~1), u [B].

    Picks the first index whose running sum exceeds u * total, in two levels: the
    chunk (of ``chunk`` tokens) from the running sum of chunk sums, then the token
    from the running sum inside that one chunk.  A full [B, V] cumsum is a serial
    pass (~1 ns per element); this reads probs once with a vectorised sum.  A
    zero-probability token (masked by top-k/top-p/min-p, or padding) has an empty
    interval and is never picked, rounding included.  One uniform per row replaces
    V exponential draws (~1 ms per row at V = 49k).

    A row whose total is not a positive finite number (all zero, NaN, inf) cannot
    be sampled: its id is still clamped into ``[0, V)``, and ``with_validity=True``
    also returns the [B] bool mask of rows that were sampled properly.
    """
    b, v = probs.shape
    n = -(-v // chunk)
    if n * chunk != v:
        probs = F.pad(probs, (0, n * chunk - v))
    blocks = probs.view(b, n, chunk)  # [B, n, C]
    sums = blocks.sum(-1).double()  # [B, n]
    cdf = sums.cumsum(-1)  # [B, n]
    target = u * cdf[:, -1]  # [B], below the row total
    k = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [B]
    k = torch.minimum(k, _last_nonzero(sums))  # rounding at the very top
    rows = torch.arange(b, device=probs.device)
    before = torch.where(k > 0, cdf[rows, (k - 1).clamp(min=0)], 0.0)  # [B]
    block = blocks[rows, k]  # [B, C]
    inner = block.cumsum(-1, dtype=torch.float64)  # [B, C]
    rest = (target - before).clamp(min=0.0).unsqueeze(1)  # [B, 1]
    j = torch.searchsorted(inner, rest, right=True).squeeze(1)  # [B]
    j = torch.minimum(j, _last_nonzero(block))  # rounding past the chunk's own sum
    ids = (k * chunk + j).clamp_(0, v - 1)
    if not with_validity:
        return ids
    total = cdf[:, -1]
    return ids, torch.isfinite(total) & (total > 0)


def _last_nonzero(x: Tensor) -> Tensor:
    """Index of the last entry > 0 in each row of x [B, N] (0 for an all-zero row)."""
    n = x.shape[1]
    return (n - 1 - (x > 0).flip(-1).to(torch.uint8).argmax(-1)).clamp(min=0)


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] float32 occurrence counts of each row's token ids (one scatter_add)."""
    b = len(rows)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)  # [B]
    flat = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64)  # [sum(len)]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}), got {int(flat.min())}..{int(flat.max())}"
        )
    row_of = torch.repeat_interleave(torch.arange(b), lengths)  # [sum(len)]
    index = (row_of * vocab_size + flat).to(device)
    counts = torch.zeros(b * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(b, vocab_size)
