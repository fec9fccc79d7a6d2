"""SamplingParams: per-request generation settings (frozen, validated).

The field names and defaults follow vLLM so users feel at home; temperature 0
means greedy. Every invalid value raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive int")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not _is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not _is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an int or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an int >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative ints")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0 or value > 20):
                raise bad(name, "must be None or an int in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
