"""Output records returned by the engine and the offline API (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made (chat with tools): ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, object]:
        """OpenAI's shape, as an assistant message's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class CompletionOutput:
    """One sequence of a request. The engine's outputs carry deltas: ``delta_*`` is what
    is new since the previous output of the request. ``text``, ``token_ids`` and
    ``logprobs`` are the whole sequence once it finished (``finish_reason`` set) and
    empty while it runs, so outputs queued for a slow reader hold each piece of text
    once (memory linear in the output, not quadratic); a streaming consumer that wants
    the text so far joins the deltas itself."""

    index: int
    text: str  # the whole text once finished; "" while running
    token_ids: list[int]  # all generated ids once finished; [] while running
    # "stop", "length", "abort", "error" ("tool_calls": chat with tools); None while running
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # matched stop string / stop token id
    # per generated token: id -> Logprob, once finished ([] while running; None: not asked)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""  # text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # chat with tools: the calls (text: the rest)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the request failed in the engine (finish "error")
    embedding: list[float] | None = None  # an embedding request's vector, once finished


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``): its pooled final hidden state."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
