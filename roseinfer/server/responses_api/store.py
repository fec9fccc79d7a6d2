"""Stored responses for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

A bounded in-memory LRU: at most ``max_responses`` entries and about ``max_bytes`` of
them (a response's size is its JSON's plus its conversation's), the least recently used
evicted first. Each entry keeps the response object and the whole conversation that
led to it (input items of every earlier turn, then its own output), so a continuation
never needs an evicted ancestor. Only responses created with ``store`` true are put
here. Used from the event loop only (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from roseinfer.server.responses_api.objects import ResponseObject
from roseinfer.server.responses_api.protocol import InputItem


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: tuple[InputItem, ...]  # every input item so far, then this output
    size: int


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[InputItem]) -> None:
        """Keep ``response`` (a too-large one is not kept), evicting the oldest."""
        size = len(response.model_dump_json()) + sum(
            len(item.model_dump_json()) for item in conversation)
        self.delete(response.id)
        if self.max_responses == 0 or size > self.max_bytes:
            return
        self._entries[response.id] = StoredResponse(response, tuple(conversation), size)
        self.bytes += size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
