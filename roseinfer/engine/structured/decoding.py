"""StructuredDecoding: the engine's per-step hooks for constrained requests.

One engine step with constrained rows runs::

    job = structured.start(scheduled)        # masks of the completing constrained rows,
                                             # computed now or on a worker thread ...
    ... runner.execute(...) ...              # ... while the forward runs (``overlap``)
    masks = structured.finish(job, failed)   # join: GrammarMasks ([B, V] bool allowed)
    ... step_sampler.sample(..., masks) ...  # forbidden ids -> -inf, row-local
    structured.advance(scheduled, sampled, failed)  # each matcher consumes its token

``start`` returns None when no completing row of the step is constrained, and the engine
then skips the other two: unconstrained steps pay one scan of the scheduled chunks. A
matcher that is (or goes) into an error state puts its request in ``failed`` (the
engine's per-request failure path); its row is fully masked, so nothing is sampled
for it. The masks depend only on the matchers (advanced after the previous step's
sampling), so they may be computed before or during the forward.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.engine.structured.compiler import GrammarCompiler
from roseinfer.engine.structured.masks import MaskBuilder


@dataclass(slots=True)
class GrammarMasks:
    """The allowed tokens of one step's constrained requests: row ``row_of[req]`` of
    ``allowed`` ([B_c, V] bool)."""

    allowed: torch.Tensor
    row_of: dict[Request, int]

    def rows_for(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """[len(requests), V] bool for a batch of requests (all True on unconstrained
        rows), or None when none of them is constrained."""
        src = [self.row_of.get(r) for r in requests]
        if src == list(range(self.allowed.shape[0])):
            return self.allowed  # every constrained row, in order: the usual case
        dst = [k for k, i in enumerate(src) if i is not None]
        if not dst:
            return None
        out = torch.ones(len(requests), self.allowed.shape[1], dtype=torch.bool,
                         device=self.allowed.device)
        out[dst] = self.allowed[[src[k] for k in dst]]
        return out


@dataclass(slots=True)
class MaskJob:
    """The masks of one step's constrained rows, being computed."""

    requests: list[Request]
    bits: Future[np.ndarray] | np.ndarray


class StructuredDecoding:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, device: torch.device,
                 overlap: bool | None = None, mask_threads: int = 1) -> None:
        """``overlap``: compute the masks on a worker thread during the forward (else on
        the engine thread, before it); None = only when the forward leaves a core idle
        (an accelerator, or fewer torch threads than cores): on a CPU whose cores all
        run the forward, the worker slows it as much as the masks cost (measured: 16
        rows on 2 cores, ~1 ms of masks per ~50 ms step; overlapped runs 2% slower).
        ``mask_threads`` > 1 fills the rows on an llguidance thread pool: only worth it
        with cores the forward does not use (its idle workers spin, and slowed the
        forward 2x on 2 cores)."""
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.device = device
        if overlap is None:
            overlap = device.type != "cpu" or torch.get_num_threads() < _usable_cores()
        self.overlap = overlap
        self.mask_threads = mask_threads
        self._builder: MaskBuilder | None = None  # built with the first constrained step
        self._worker: ThreadPoolExecutor | None = None

    def start(self, scheduled: Sequence[ScheduledRequest]) -> MaskJob | None:
        """Begin computing the masks of the step's completing constrained rows."""
        requests = [s.request for s in scheduled if s.request.grammar is not None and s.completes]
        if not requests:
            return None
        builder = self._mask_builder()
        matchers = [r.grammar for r in requests]
        if not self.overlap:
            return MaskJob(requests, builder.fill(matchers))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roseinfer-masks")
        return MaskJob(requests, self._worker.submit(builder.fill, matchers))

    def finish(self, job: MaskJob, failed: dict[Request, str]) -> GrammarMasks:
        """The allowed tokens of each constrained request; a request whose matcher is in
        error goes to ``failed`` and gets an all-False row."""
        bits = job.bits.result() if isinstance(job.bits, Future) else job.bits
        assert self._builder is not None
        allowed = self._builder.to_allowed(bits, self.device)  # [B, V]
        for k, req in enumerate(job.requests):
            assert req.grammar is not None
            error = req.grammar.error()
            if error is not None:
                failed.setdefault(req, f"structured output: {error}")
                allowed[k] = False
        return GrammarMasks(allowed, {req: k for k, req in enumerate(job.requests)})

    def advance(self, scheduled: Sequence[ScheduledRequest], sampled: Sequence[Sequence[int]],
                failed: dict[Request, str]) -> None:
        """Each constrained request that got a token consumes it (before
        ``Scheduler.update``, which then finishes a request whose grammar completed).
        Constrained requests never draft, so a step gives each at most one token."""
        for s, tokens in zip(scheduled, sampled, strict=True):
            req = s.request
            if not tokens or req.grammar is None or req in failed or req.is_finished:
                continue
            error = req.grammar.accept(tokens[0])
            if error is not None:
                failed[req] = f"structured output: {error}"

    def _mask_builder(self) -> MaskBuilder:
        if self._builder is None:
            self._builder = MaskBuilder(self.compiler.ll_vocab_size, self.vocab_size,
                                        self.mask_threads)
        return self._builder


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)
