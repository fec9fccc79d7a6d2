"""Batched token sampling for one engine step.

``SamplingBatch.from_requests`` (``sampling_batch.py``) turns the per-request
``SamplingParams`` of the running sequences into per-row tensors (plus flags that let
the fast paths skip work), and ``Sampler`` turns a ``[B, V]`` block of last-position
logits into one token per row. The steps live beside it, one concern each:
``penalties.py`` (2-3), ``sampling_filters.py`` (top-k / top-p / min-p),
``inverse_cdf.py`` (the draws); the masks of step 1 come from ``logit_constraints.py``. Everything is vectorised over the batch; the only per-row Python
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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from roseinfer.model.row_kernels import row_kernels_usable
from roseinfer.runner.inverse_cdf import sample_inverse_cdf, uniform_draws
from roseinfer.runner.penalties import apply_penalties
from roseinfer.runner.sampling_batch import SamplingBatch
from roseinfer.runner.sampling_filters import apply_min_p, apply_top_k_top_p


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
            values, token_ids = row_max(logits)  # = argmax (a NaN row picks its first NaN)
            return SamplerOutput(token_ids, None, None, torch.isfinite(values))

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


def greedy_tokens(logits: Tensor) -> tuple[list[int], list[bool]]:
    """The all-greedy, unconstrained batch's result without a ``SamplingBatch``: each row
    of [B, V] logits' argmax (``max`` along V: its first maximum, its first NaN in a row
    with one, as ``argmax``) and whether that entry is finite (False: nothing to sample),
    as ``Sampler`` gives them for such a batch."""
    values, ids = row_max(logits if logits.dtype == torch.float32 else logits.float())
    # math.isfinite on the Python floats, not torch.isfinite: right after a decode step
    # every distinct tensor op runs cache-cold (~50 us for this one, docs/performance.md).
    return ids.tolist(), [math.isfinite(v) for v in values.tolist()]


def row_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(values, ids), [B] each, of [B, V] logits: each row's first maximum, its first NaN
    in a row with one — torch's ``max(dim=-1)`` / ``argmax``, bit for bit. Float32 CPU
    logits take the C++ kernel (``row_argmax``: vectorised, ~10x torch's reduction over
    a 49152-token vocab), others torch."""
    if logits.dim() == 2 and logits.shape[1] > 0 and row_kernels_usable(logits):
        return torch.ops.roseinfer.row_argmax(logits)
    values, ids = logits.max(dim=-1)
    return values, ids


def _finite_at(x: Tensor, ids: Tensor) -> Tensor:
    """[B] bool: the chosen entry of each row of x [B, V] is finite (not -inf / NaN)."""
    return torch.isfinite(x.gather(1, ids.unsqueeze(1)).squeeze(1))
