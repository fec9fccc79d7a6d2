"""StepSampler: the tokens of each request whose chunk completed, with per-row failures.

The engine hands it the step's completing chunks and their logits; it samples them
as one batch. A chunk with speculative drafts has one row per draft before its last
row: row j is sampled as the request's next token after its first j drafts (its
output-so-far, min_tokens suppression and penalties see them), and
``RejectionSampler`` keeps the drafts its rows agree with, plus one more token. A
row that cannot yield a token — logits that are NaN / +inf, every
token masked, or sampling code that raises for that row (the batch is then retried
chunk by chunk) — is reported in ``failed`` with the reason, and only that request fails.
The sampler flags such rows itself (``SamplerOutput.valid``, from values it computes
anyway), so healthy steps pay no extra pass over the logits.

``masks`` (structured outputs) gives the allowed tokens of constrained requests;
they join each row's own constraints (``allowed_token_ids``, ``logit_bias``,
min_tokens suppression) in the ``SamplingBatch``, row by row. Constrained requests
never draft (their masks hold for their next token only).
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
from roseinfer.runner.rejection_sampler import RejectionSampler
from roseinfer.runner.sampler import Sampler, SamplerOutput, SamplingBatch, greedy_tokens
from roseinfer.runner.sampling_batch import is_plain_greedy

if TYPE_CHECKING:
    from roseinfer.engine.structured.decoding import GrammarMasks

logger = logging.getLogger(__name__)


class StepSampler:
    def __init__(self, sampler: Sampler, logprobs: LogprobBuilder, vocab_size: int,
                 device: torch.device) -> None:
        self.sampler = sampler
        self.verifier = RejectionSampler(sampler)
        self.logprobs = logprobs
        self.vocab_size = vocab_size
        self.device = device

    def sample(self, scheduled: list[ScheduledRequest], logits: StepLogits | None,
               failed: dict[Request, str],
               masks: GrammarMasks | None = None) -> list[list[int]]:
        """The new tokens of each chunk that completes its request: one sampled token,
        or for a chunk with drafts its accepted drafts and the token after them; []
        for the other chunks and failed rows. ``masks``: the allowed tokens of
        constrained requests."""
        result: list[list[int]] = [[] for _ in scheduled]
        chunks = [i for i, s in enumerate(scheduled) if s.samples]
        if not chunks or logits is None:
            return result
        requests = [scheduled[i].request for i in chunks]
        if logits.greedy is not None:  # a greedy step's tokens, from the model (execute)
            ids, finite = logits.greedy
            for k, (token, ok) in enumerate(zip(ids, finite, strict=True)):
                if ok:
                    result[chunks[k]] = [token]
                else:
                    failed[requests[k]] = "the model produced non-finite logits (NaN or inf)"
            return result
        x = logits.sample_logits  # [R, V]: 1 + d rows per completing chunk
        drafts = [scheduled[i].spec_token_ids for i in chunks]
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        try:
            emitted = self._sample_chunks(x, requests, drafts, masks)
        except Exception:  # noqa: BLE001 - retried chunk by chunk: only culprits fail
            logger.exception("sampling failed for a batch of %d; retrying row by row",
                             len(requests))
            emitted = []
            for k, req in enumerate(requests):
                try:
                    emitted += self._sample_chunks(x[starts[k]:starts[k + 1]], [req],
                                                   [drafts[k]], masks)
                except Exception as exc:  # noqa: BLE001
                    failed[req] = f"sampling failed: {describe(exc)}"
                    emitted.append([])
        for k, tokens in enumerate(emitted):
            if tokens:
                result[chunks[k]] = tokens
            elif requests[k] not in failed:  # the sampler flagged the row (rare: check why)
                failed[requests[k]] = (
                    "the model produced non-finite logits (NaN or inf)"
                    if not bool(torch.isfinite(x[starts[k]]).all()) else
                    "no token can be sampled: every token is masked or the distribution "
                    "is not finite")
        return result

    @staticmethod
    def greedy_only(scheduled: list[ScheduledRequest]) -> bool:
        """Whether every chunk this step samples takes its argmax: plain greedy, no
        drafts, no stop tokens held back by ``min_tokens`` (grammar masks are the
        caller's to rule out): ``_sample_chunks``' all-greedy case, which the runner may
        then answer with tokens alone (``ModelRunner.execute(greedy=True)``)."""
        chunks = [s for s in scheduled if s.samples]
        return bool(chunks) and all(
            not s.spec_token_ids and is_plain_greedy(s.request.params)
            and not _held_back(s.request, 0) for s in chunks)

    def _sample_chunks(self, logits: torch.Tensor, requests: list[Request],
                       drafts: list[list[int]], masks: GrammarMasks | None
                       ) -> list[list[int]]:
        """The emitted tokens of each chunk ([] where its first row had nothing to
        sample); ``logits`` holds 1 + len(drafts[k]) rows for ``requests[k]``."""
        rows: list[tuple[Request, list[int]]] = [  # (request, drafts before this row)
            (r, d[:j]) for r, d in zip(requests, drafts, strict=True) for j in range(len(d) + 1)]
        suppress = [_held_back(r, len(before)) for r, before in rows]
        if (masks is None and len(rows) == len(requests) and not any(suppress)
                and all(is_plain_greedy(r.params) for r in requests)):
            # Greedy rows, nothing to mask or penalise: one max over the logits (the
            # sampler's all-greedy result, without building a SamplingBatch).
            ids, finite = greedy_tokens(logits)
            return [[t] if ok else [] for t, ok in zip(ids, finite, strict=True)]
        row_requests = [r for r, _ in rows]
        batch = SamplingBatch.from_requests(
            [r.params for r in row_requests], [r.prompt_token_ids for r in row_requests],
            [r.output_token_ids + before if before else r.output_token_ids
             for r, before in rows],
            [r.generator for r in row_requests],
            suppress, self.vocab_size, self.device,
            allowed_mask=masks.rows_for(row_requests) if masks is not None else None,
        )
        out = self.verifier(logits, batch, drafts)
        tokens: list[int] = out.sampled.token_ids.tolist()
        logprobs = _LogprobRows(out.sampled)
        emitted: list[list[int]] = []
        start = 0
        for req, d, n in zip(requests, drafts, out.num_emitted, strict=True):
            emitted.append(tokens[start:start + n])
            if req.params.logprobs is not None:
                for k in range(start, start + n):
                    lp, top = logprobs.row(k, req.params.logprobs)
                    req.output_logprobs.append(self.logprobs.sampled_entry(tokens[k], lp, top))
                    req.cumulative_logprob += lp
            start += len(d) + 1
        return emitted


def _held_back(r: Request, drafts_before: int) -> list[int]:
    """The tokens a row of ``r`` may not sample yet (its EOS and stop ids while fewer than
    ``min_tokens`` are out, counting the drafts before the row)."""
    if r.num_output_tokens + drafts_before >= r.params.min_tokens:
        return []
    return list(r.eos_token_ids if not r.params.ignore_eos else ()) + list(r.params.stop_token_ids)


class _LogprobRows:
    """The sampler's logprobs as Python lists (converted once, on first use)."""

    def __init__(self, out: SamplerOutput) -> None:
        self._out = out
        self._lps: list[float] | None = None
        self._tops: tuple[list[list[int]], list[list[float]]] | None = None

    def row(self, k: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """Row k's sampled-token logprob and its top ``n`` (id, logprob)."""
        out = self._out
        assert out.logprobs is not None, "logprobs were asked for, so the sampler made them"
        if self._lps is None:
            self._lps = out.logprobs.tolist()
            if out.top_logprobs is not None:
                self._tops = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist())
        tops = self._tops
        top = list(zip(tops[0][k][:n], tops[1][k][:n], strict=True)) if tops else []
        return self._lps[k], top
