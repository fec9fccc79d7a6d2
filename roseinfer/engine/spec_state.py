"""SpecState: one sequence's n-gram drafter and its decayed acceptance estimate.

Owned by its ``Request`` (``Request.spec``), driven by ``SpecDecoding``
(``spec_decode.py``, which explains the adaptive scheme); below both, so the request
record can name it without importing the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

from roseinfer.engine.ngram import NgramIndex

_DECAY = 0.7  # weight of the past per verification (~3 steps of memory)
_SHADOW_HORIZON = 3  # a shadow confirmed this far counts as a verification
_PRIOR_RATE, _PRIOR_WEIGHT = 0.8, 1.0  # a fresh request's assumed acceptance


@dataclass(slots=True)
class SpecState:
    """One sequence's drafter: its n-gram index and its recent acceptance."""

    index: NgramIndex
    accepted: float = _PRIOR_RATE * _PRIOR_WEIGHT  # decayed accepted drafts
    verified: float = _PRIOR_WEIGHT  # decayed drafts verified (accepted, or the first rejected)
    shadow: list[int] | None = None  # drafts not fed, checked against what comes instead
    shadow_at: int = 0  # the request's output length when the shadow was drafted

    @property
    def rate(self) -> float:
        return self.accepted / self.verified

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``drafted`` drafts (a prefix) were accepted."""
        self.accepted = _DECAY * self.accepted + accepted
        self.verified = _DECAY * self.verified + accepted + (accepted < drafted)

    def check_shadow(self, output: list[int]) -> None:
        """Score the shadow drafts against the tokens generated since (``output``: the
        request's output ids) once those refute them or confirm ``_SHADOW_HORIZON`` of
        them (a request that became predictable drafts again a few steps later)."""
        shadow = self.shadow
        if shadow is None:
            return
        shadow = shadow[:_SHADOW_HORIZON]
        actual = output[self.shadow_at:self.shadow_at + len(shadow)]
        accepted = 0
        while accepted < len(actual) and actual[accepted] == shadow[accepted]:
            accepted += 1
        if accepted < len(actual) or accepted == len(shadow):  # refuted, or confirmed
            self.observe(len(shadow), accepted)
            self.shadow = None
