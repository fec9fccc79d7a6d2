"""Scheduler: decides which tokens of which requests run in the next step.

There are no separate prefill and decode phases: every request has
``num_computed_tokens`` catching up with ``num_tokens`` under one token budget
per step. Running requests go first (a decode is one token; an unfinished
prefill gets its next chunk), then waiting requests are admitted FCFS while the
budget, ``max_num_seqs`` and free KV blocks last. When a running request needs a
block and none is free, the newest running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed.

Speculative decoding: a decoding request may carry drafts (``Request.spec_token_ids``,
set by the engine's drafter before ``schedule``). After every running request has its
decode token or chunk, each decode takes as many of its drafts as the remaining budget
and free blocks allow (drafts never preempt anyone), before waiting requests are
admitted; its chunk is then 1 + d tokens. ``update`` appends the accepted drafts and the
token after them, stopping at the first that finishes the request, moves
``num_computed_tokens`` only over tokens whose K/V are right (the last appended token is
computed next step), and gives back the blocks of rejected drafts.

Held requests (backpressure): ``held`` names request groups whose reader has fallen
behind (a streaming client that does not read: ``AsyncEngine`` sets it before each
step). A held request keeps its place and its KV blocks but is not scheduled: no row of
the batch is spent on output nobody reads; a held request that was preempted stays
waiting. When blocks run out, held requests are preempted first (newest first). Holding
never changes a request's arithmetic, only when its next token is computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step, drafts included
    # Drafted tokens fed after the request's own (the last ``len`` of num_new_tokens);
    # only on a chunk that completes its request.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the request's tokens (so it samples)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk gets a sampled token: it completes a request that is not
        an embedding request (those pool their hidden rows instead)."""
        return self.completes and self.request.pooling is None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.held: frozenset[str] = frozenset()  # group ids not to schedule (backpressure)

    # ------------------------------------------------------------- admission
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len} (the prompt plus at least one generated token must fit)"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running requests, oldest first: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.group_id in self.held:
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not bm.allocate(req, num_new):
                j = self._victim_index()
                victim = self.running.pop(j)
                if j < i:  # a held request before req: req moved down by one
                    i -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing older needs its blocks

        # 2. Drafts of the scheduled decodes, while the budget and free blocks last.
        if not out.preempted:
            budget = self._schedule_drafts(out.scheduled, budget)

        # 3. Waiting requests, FCFS, unless this step had to preempt. A held request
        #    gives up its seat and blocks to a waiting one that needs them.
        blocked = bool(out.preempted)
        pending_hashes: set[int] = set()  # blocks being computed this step, not yet cached
        if self.waiting and budget > 0 and not blocked:  # only admission needs them
            for s in out.scheduled:
                pending_hashes.update(self._uncomputed_hashes(s.request))
        skipped: list[Request] = []
        while self.waiting and budget > 0 and not blocked:
            req = self.waiting[0]
            if req.group_id in self.held:
                skipped.append(self.waiting.popleft())  # preempted while held: stays out
                continue
            if len(self.running) >= self.max_num_seqs:
                if self._preempt_held(out):
                    continue  # its seat is free now (it waits at the front, held)
                break
            # An embedding request pools the hidden rows of every prompt position: no hits.
            cached = bm.find_cached_blocks(req) if req.pooling is None else []
            if self._waits_for_shared_prefix(req, len(cached), pending_hashes):
                skipped.append(self.waiting.popleft())  # its prefix is being computed now
                continue
            num_computed = len(cached) * bm.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if not bm.allocate(req, num_new, cached):
                if self._preempt_held(out):
                    continue  # its blocks are free now: try again
                break
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:  # first admission, not a resume
                req.num_cached_tokens = num_computed
                bm.record_prefix_lookup(req.num_tokens, num_computed)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            pending_hashes.update(self._uncomputed_hashes(req))
        self.waiting.extendleft(reversed(skipped))
        return out

    def _victim_index(self) -> int:
        """Index in ``running`` of the request to preempt: the newest held one, else the
        newest."""
        held = self.held
        if held:
            for j in range(len(self.running) - 1, -1, -1):
                if self.running[j].group_id in held:
                    return j
        return len(self.running) - 1

    def _preempt_held(self, out: SchedulerOutput) -> bool:
        """Preempt the newest held running request (for a waiting one); False if none."""
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j].group_id in self.held:
                victim = self.running.pop(j)
                self._preempt(victim)
                out.preempted.append(victim)
                return True
        return False

    @property
    def num_held(self) -> int:
        """Unfinished requests (running or waiting) that are held."""
        if not self.held:
            return 0
        return sum(1 for r in self.running if r.group_id in self.held) + sum(
            1 for r in self.waiting if r.group_id in self.held)

    def _schedule_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Extend each decode chunk by the drafts of its request that fit; returns the
        budget left. A request drafts at most what it may still generate, minus the one
        token sampled after its drafts."""
        for s in scheduled:
            req = s.request
            if not req.spec_token_ids or budget <= 0:
                continue
            drafts, req.spec_token_ids = req.spec_token_ids, []
            if s.num_new_tokens != 1 or not s.completes:
                continue
            room = min(req.params.max_tokens - req.num_output_tokens,
                       self.max_model_len - req.num_tokens) - 1
            d = min(len(drafts), budget, room)
            if d <= 0 or not self.block_manager.allocate(req, 1 + d):
                continue
            s.num_new_tokens += d
            s.spec_token_ids = drafts[:d]
            budget -= d
        return budget

    def _uncomputed_hashes(self, req: Request) -> list[int]:
        if not self.block_manager.enable_prefix_caching:
            return []
        self.block_manager.update_block_hashes(req)
        bs = self.block_manager.block_size
        first = req.num_computed_tokens // bs
        return req.block_hashes[first:]

    def _waits_for_shared_prefix(self, req: Request, num_hits: int, pending: set[int]) -> bool:
        """True if the request's next uncached block is being computed by another request."""
        if not pending or num_hits >= len(req.block_hashes):
            return False
        return req.block_hashes[num_hits] in pending

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- update
    def update(
        self, out: SchedulerOutput, sampled: Sequence[Sequence[int]]
    ) -> list[Request]:
        """Apply one step's results; return requests that received new tokens.

        ``sampled[i]`` holds the tokens for ``out.scheduled[i]`` when that chunk
        completed the request's tokens: one sampled token, or for a chunk with d drafts
        its accepted drafts (a prefix of them) and the token sampled after them; empty
        for a partial prefill chunk. Tokens are appended until one finishes the request:
        EOS / stop ids / a completed grammar (``"stop"``, even on the last allowed
        token) / length; stop strings are the engine's (detokenizer) call via
        ``finish_request``.
        """
        bm = self.block_manager
        advanced: list[Request] = []
        for s, tokens in zip(out.scheduled, sampled, strict=True):
            req = s.request
            if req.is_finished:  # aborted during the step
                continue
            num_drafts = len(s.spec_token_ids)
            req.num_computed_tokens += s.num_new_tokens - num_drafts
            if not tokens:
                if num_drafts:
                    bm.trim(req)
                bm.cache_full_blocks(req)
                continue
            stop: RequestStatus | None = None
            for j, token in enumerate(tokens):
                if j:  # tokens[j - 1] was the draft fed at this position: its K/V are right
                    req.num_computed_tokens += 1
                req.append_token(token)
                stop = self._stop_status(req, token)
                if stop is not None:
                    break
            if len(req.output_logprobs) > req.num_output_tokens:  # cut by a stop
                req.truncate_output(req.num_output_tokens)
            if num_drafts:
                bm.trim(req)
            bm.cache_full_blocks(req)
            advanced.append(req)
            if stop is not None:
                self.finish_request(req, stop)
        return advanced

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        """How ``token``, just appended, finishes the request (None: it goes on); sets
        ``stop_reason`` / ``stopped_by_grammar``."""
        p = req.params
        past_min = req.num_output_tokens >= p.min_tokens
        if past_min and not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if past_min and token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.terminated:  # complete: "stop"
            req.stopped_by_grammar = token not in req.eos_token_ids
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request in any state and free its blocks at once."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status
        self.requests.pop(req.request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req
