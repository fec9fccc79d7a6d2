"""SpeculativeConfig: the options of n-gram (prompt lookup) speculative decoding.

vLLM's shape, given as ``LLM(..., speculative_config={...})``, ``EngineConfig(
speculative_config=...)`` or ``--speculative-config '<json>'``::

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}

``num_speculative_tokens`` (k, required) is the most tokens drafted per request and
step; a draft is the k tokens that followed the latest earlier occurrence of the
sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``
(either defaults to the other; both absent: 5 and 5, as vLLM). ``disable_by_batch_size``
(vLLM's name): no drafting in a step with more running sequences than this. ``adaptive``
(roseinfer's own, default true): each request drafts fewer tokens, or none for a while,
when its drafts keep being rejected (``roseinfer.engine.spec_decode``). An unknown key
or a bad value is a ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64
_DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor _max is given


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be "
                f"<= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be a bool, got "
                             f"{self.adaptive!r}")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's dict; ``prompt_lookup_min`` / ``_max`` default to each other."""
        if not isinstance(options, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        for key in options:
            if key not in known:
                raise ValueError(f"speculative_config.{key} is not a supported option "
                                 f"(supported: {', '.join(sorted(known))})")
        if options.get("method") not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got "
                             f"{options.get('method')!r}")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        values = dict(options)
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        values["prompt_lookup_min"] = high if low is None else low
        values["prompt_lookup_max"] = low if high is None else high
        return cls(**values)

    @classmethod
    def coerce(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None
               ) -> SpeculativeConfig | None:
        """A config from itself, a dict, JSON text (the CLI flag) or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
            if value is None:
                return None
        return cls.from_dict(value)  # type: ignore[arg-type]


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{name} must be an int {bound}, got {value!r}")
