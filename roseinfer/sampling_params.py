"""SamplingParams: per-request generation settings (frozen, validated).

The field names and defaults follow vLLM so users feel at home; temperature 0
means greedy. Every invalid value raises ValueError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from roseinfer.stop_strings import StopStrings
from roseinfer.structured_outputs import StructuredOutputsParams

# Documented bounds (docs/reliability.md, "Limits"); the HTTP layer uses the same numbers.
MAX_N = 64  # sequences per prompt
MAX_LOGPROBS = 20  # logprobs / prompt_logprobs / top_logprobs
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 2048  # entries of logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| (OpenAI's range)
MAX_ALLOWED_TOKEN_IDS = 131072


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constraints on the output, applied to that row's logits before sampling (logprobs
    # stay those of the raw model distribution): a grammar / JSON schema / regex / choice
    # (see roseinfer.structured_outputs), a bias added per token id (OpenAI's logit_bias,
    # values in [-100, 100]), and vLLM's allowed_token_ids (every other id is masked).
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Accept lists / single strings for convenience; store tuples.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        stop_ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        self._validate()
        self._validate_constraints()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an int in [1, {MAX_N}]")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive int")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_num(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be in [0.01, 100]")
        if not _is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not _is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be None or an int in [0, 2**63)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an int >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative ints")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an int in [0, {MAX_LOGPROBS}]")

    def _validate_constraints(self) -> None:
        """structured_outputs, logit_bias and allowed_token_ids (stored normalised: a dict
        of int -> float, a tuple of ints)."""
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be a "
                             f"StructuredOutputsParams, got {type(self.structured_outputs)}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> "
                                 f"bias, got {type(bias).__name__}")
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"SamplingParams.logit_bias must hold at most {MAX_LOGIT_BIAS} "
                                 f"entries, got {len(bias)}")
            for t, b in bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids "
                                     f"(ints >= 0), got {t!r}")
                if not _is_num(b) or abs(b) > MAX_LOGIT_BIAS_VALUE:
                    raise ValueError(f"SamplingParams.logit_bias values must be finite numbers "
                                     f"in [-100, 100], got {b!r} for token {t}")
            object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in bias.items()})
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, (str, bytes, dict)) or not hasattr(allowed, "__len__"):
                raise ValueError("SamplingParams.allowed_token_ids must be a list of token ids, "
                                 f"got {type(allowed).__name__}")
            if not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"SamplingParams.allowed_token_ids must hold 1 to "
                                 f"{MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}")
            if not all(_is_int(t) and t >= 0 for t in allowed):
                raise ValueError("SamplingParams.allowed_token_ids must be token ids (ints >= 0)")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))

    @cached_property
    def stop_strings(self) -> StopStrings:
        """``stop`` compiled for matching (linear in its length); built once per params
        object, by the first caller: the server's validation, before queueing."""
        return StopStrings.compile(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    """A finite int or float (NaN and +-inf are refused, bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
