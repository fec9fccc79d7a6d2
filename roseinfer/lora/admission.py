"""Requests with an adapter wait here until their adapter is resident.

``LLMEngine.add_request`` hands a sequence with a ``lora_request`` to ``add``; before
each step ``admit`` moves every waiting sequence whose adapter is (or can be made)
resident into the scheduler, in arrival order.  An adapter is pinned while any
unfinished sequence in the scheduler uses it, so a running (or preempted) request's
adapter is never evicted; a sequence whose adapter finds no free slot waits for one.
"""

from __future__ import annotations

from collections import deque

from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import Scheduler
from roseinfer.lora.manager import LoRAManager


class LoRAAdmission:
    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.pending: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self.pending.append(request)

    def admit(self, scheduler: Scheduler) -> None:
        """Move the admissible pending sequences into ``scheduler`` (aborted ones are
        dropped)."""
        if not self.pending:
            return
        pinned = {r.lora_request.lora_int_id for r in scheduler.requests.values()
                  if r.lora_request is not None and not r.is_finished}
        kept: deque[Request] = deque()
        for req in self.pending:
            lora = req.lora_request
            if req.is_finished or lora is None:
                continue
            if self.manager.make_resident(lora, pinned):
                pinned.add(lora.lora_int_id)
                scheduler.add_request(req)
            else:
                kept.append(req)
        self.pending = kept

    def in_use(self, lora_int_id: int, scheduler: Scheduler) -> bool:
        """Whether any unfinished sequence (waiting here or in the scheduler) uses it."""
        reqs = list(self.pending) + list(scheduler.requests.values())
        return any(r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
                   and not r.is_finished for r in reqs)
