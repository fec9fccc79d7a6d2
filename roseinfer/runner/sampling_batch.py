"""SamplingBatch: the per-row sampling state of one step, built from the requests'
``SamplingParams`` (``SamplingBatch.from_requests``).

Rows are tensors over the batch (temperature, top-k/p, min-p, penalties), plus flags
that let the sampler's fast paths skip work. Greedy rows carry neutral values (top-k =
V, top-p = 1, min-p = 0), so the flags reflect the sampled rows only and a row's values
never change another's result. The sampler itself is in ``sampler.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
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


def is_plain_greedy(p: SamplingParams) -> bool:
    """True when a row of ``p`` samples its argmax of the raw logits: greedy, with no
    penalty, bias, allowed-token list or logprobs (min_tokens suppression and grammar
    masks are the caller's to rule out)."""
    return (p.temperature < _GREEDY_EPS and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias
            and p.allowed_token_ids is None and p.logprobs is None)


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
