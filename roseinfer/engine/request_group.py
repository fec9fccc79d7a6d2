"""RequestGroup: one user request as the engine tracks it, and the outputs it reports.

A request with ``n`` sequences runs as n ``Request`` objects (children); the group owns
their detokenizers, the text and the number of output tokens sent so far for each, its
prompt logprobs and its first failure, and builds the ``RequestOutput`` of a step: what is new since the previous output (text,
token ids and logprobs; a step may bring a sequence several tokens with speculative
decoding), plus a sequence's whole text, ids and logprobs once it finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.engine.detokenizer import IncrementalDetokenizer
from roseinfer.engine.logprobs import PromptLogprobs
from roseinfer.engine.request import Request
from roseinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from roseinfer.sampling_params import SamplingParams


@dataclass(eq=False)
class RequestGroup:
    """One user request: its n sequences, their detokenizers and what was sent so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    texts: list[str] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # output tokens of each sequence sent so far
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None  # the first failure of one of its sequences

    def output(self, deltas: dict[int, tuple[str, int]], finished: bool,
               now: float) -> RequestOutput:
        """``deltas[i]``: sequence i's new text and how many of its tokens were sent
        before this output (sequences without an entry have nothing new)."""
        outs = []
        for i, child in enumerate(self.children):
            delta_text, sent = deltas.get(i, ("", child.num_output_tokens))
            done = child.finish_reason is not None
            logprobs = None
            delta_lp = None
            if child.params.logprobs is not None:
                delta_lp = child.output_logprobs[sent:]  # built once per token (StepSampler)
                logprobs = child.output_logprobs if done else []
            # While running only the deltas: a queued output must not hold the whole
            # text so far (a slow stream's outputs would take memory quadratic in length).
            outs.append(CompletionOutput(
                index=i, text=self.texts[i] if done else "",
                token_ids=child.output_token_ids if done else [],
                finish_reason=child.finish_reason, stop_reason=child.stop_reason,
                logprobs=logprobs,
                cumulative_logprob=child.cumulative_logprob if logprobs is not None else None,
                delta_text=delta_text,
                delta_token_ids=child.output_token_ids[sent:],
                delta_logprobs=delta_lp,
            ))
        if finished:
            self.metrics.finished_time = now
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, outputs=outs, finished=finished,
            num_cached_tokens=self.children[0].num_cached_tokens, metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs, error=self.error,
            embedding=self.children[0].embedding,
        )
