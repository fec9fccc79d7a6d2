"""StepSampler: one token per request whose chunk completed, with per-row failures.

The engine hands it the step's completing chunks and their logits; it samples them
as one batch. A row that cannot yield a token — logits that are NaN / +inf, every
token masked, or sampling code that raises for that row (the batch is then retried
row by row) — is reported in ``failed`` with the reason, and only that request fails.
The sampler flags such rows itself (``SamplerOutput.valid``, from values it computes
anyway), so healthy steps pay no extra pass over the logits.

``masks`` (structured outputs) gives the allowed tokens of constrained requests;
they join each row's own constraints (``allowed_token_ids``, ``logit_bias``,
min_tokens suppression) in the ``SamplingBatch``, row by row.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from roseinfer.engine.fault_isolation import describe
from roseinfer.engine.logprobs import LogprobBuilder
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.runner.model_runner import StepLogits
from roseinfer.runner.sampler import Sampler, SamplerOutput, SamplingBatch

if TYPE_CHECKING:
    from roseinfer.engine.structured.decoding import GrammarMasks

logger = logging.getLogger(__name__)


class StepSampler:
    def __init__(self, sampler: Sampler, logprobs: LogprobBuilder, vocab_size: int,
                 device: torch.device) -> None:
        self.sampler = sampler
        self.logprobs = logprobs
        self.vocab_size = vocab_size
        self.device = device

    def sample(self, scheduled: list[ScheduledRequest], logits: StepLogits | None,
               failed: dict[Request, str],
               masks: GrammarMasks | None = None) -> list[int | None]:
        """One token per chunk that completes its request (None for the others);
        ``masks``: the allowed tokens of constrained requests."""
        result: list[int | None] = [None] * len(scheduled)
        rows = [i for i, s in enumerate(scheduled) if s.completes]
        if not rows or logits is None:
            return result
        x = logits.sample_logits  # [N, V], one row per completing chunk
        requests = [scheduled[i].request for i in rows]
        try:
            tokens = self._sample_rows(x, requests, masks)
        except Exception:  # noqa: BLE001 - retried row by row: only culprits fail
            logger.exception("sampling failed for a batch of %d; retrying row by row",
                             len(requests))
            tokens = []
            for j, req in enumerate(requests):
                try:
                    tokens += self._sample_rows(x[j:j + 1], [req], masks)
                except Exception as exc:  # noqa: BLE001
                    failed[req] = f"sampling failed: {describe(exc)}"
                    tokens.append(None)
        for k, token in enumerate(tokens):
            if token is not None:
                result[rows[k]] = token
            elif requests[k] not in failed:  # the sampler flagged the row (rare: check why)
                failed[requests[k]] = (
                    "the model produced non-finite logits (NaN or inf)"
                    if not bool(torch.isfinite(x[k]).all()) else
                    "no token can be sampled: every token is masked or the distribution "
                    "is not finite")
        return result

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request],
                     masks: GrammarMasks | None) -> list[int | None]:
        """Sample one token per row; None where the row had nothing to sample."""
        suppress = [
            list(r.eos_token_ids if not r.params.ignore_eos else ()) + list(r.params.stop_token_ids)
            if r.num_output_tokens < r.params.min_tokens else []
            for r in requests
        ]
        batch = SamplingBatch.from_requests(
            [r.params for r in requests], [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests], [r.generator for r in requests],
            suppress, self.vocab_size, self.device,
            allowed_mask=masks.rows_for(requests) if masks is not None else None,
        )
        out = self.sampler(logits, batch)
        tokens: list[int | None] = list(out.token_ids.tolist())
        valid = out.valid.tolist() if out.valid is not None else [True] * len(tokens)
        self._add_sampled_logprobs(out, requests, tokens, valid)
        return [t if ok else None for t, ok in zip(tokens, valid, strict=True)]

    def _add_sampled_logprobs(self, out: SamplerOutput, requests: list[Request],
                              tokens: list[int | None], valid: list[bool]) -> None:
        if out.logprobs is None:
            return
        lps = out.logprobs.tolist()
        tops = None
        if out.top_logprobs is not None:
            tops = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist())
        for k, req in enumerate(requests):
            if req.params.logprobs is None or not valid[k]:
                continue
            n = req.params.logprobs
            top = list(zip(tops[0][k][:n], tops[1][k][:n], strict=True)) if tops else []
            req.output_logprobs.append(self.logprobs.sampled_entry(tokens[k], lps[k], top))
            req.cumulative_logprob += lps[k]
