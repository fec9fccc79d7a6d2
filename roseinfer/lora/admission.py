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
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.lora.manager import LoRAManager
from roseinfer.lora.request import LoRARequest


def check_lora_request(admission: LoRAAdmission | None, lora: LoRARequest | None) -> None:
    """InvalidRequestError (param ``lora_request``) unless the engine (its admission
    queue, None without LoRA) can run ``lora``: checked against the model, nothing loaded."""
    if lora is None:
        return
    if not isinstance(lora, LoRARequest):
        raise InvalidRequestError("lora_request must be a LoRARequest", "lora_request")
    if admission is None:
        raise InvalidRequestError("LoRA adapters are not enabled on this engine "
                                  "(enable_lora=True)", "lora_request")
    try:
        admission.manager.check(lora)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "lora_request") from None


class LoRAAdmission:
    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.pending: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self.pending.append(request)

    def admit(self, scheduler: Scheduler) -> dict[Request, str]:
        """Move the admissible pending sequences into ``scheduler`` (aborted ones are
        dropped); returns those whose adapter could not be loaded (its files changed or
        went away since the check), with why: the engine fails their requests."""
        failed: dict[Request, str] = {}
        if not self.pending:
            return failed
        pinned = {r.lora_request.lora_int_id for r in scheduler.requests.values()
                  if r.lora_request is not None and not r.is_finished}
        kept: deque[Request] = deque()
        for req in self.pending:
            lora = req.lora_request
            if req.is_finished or lora is None:
                continue
            try:
                resident = self.manager.make_resident(lora, pinned)
            except (ValueError, OSError, RuntimeError) as exc:
                failed[req] = f"LoRA adapter {lora.lora_name!r} could not be loaded: {exc}"
                continue
            if resident:
                pinned.add(lora.lora_int_id)
                scheduler.add_request(req)
            else:
                kept.append(req)
        self.pending = kept
        return failed

    def in_use(self, lora_int_id: int, scheduler: Scheduler) -> bool:
        """Whether any unfinished sequence (waiting here or in the scheduler) uses it."""
        reqs = list(self.pending) + list(scheduler.requests.values())
        return any(r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
                   and not r.is_finished for r in reqs)
