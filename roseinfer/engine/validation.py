"""RequestValidator: every check that needs the model, in one place, before queueing.

``SamplingParams`` validates what it can alone (types, finite numbers, ranges, sizes).
What depends on the model — the vocabulary, the context length, whether there is a
tokenizer — is checked here, by the offline API (``LLMEngine.add_request``) and by the
HTTP layer (before ``AsyncEngine.add_requests``) alike, so a request that passes never
makes the engine loop raise. Errors are ``InvalidRequestError`` (a ``ValueError``)
naming the offending field in ``param``.

Structured outputs are compiled here (``grammars``, the engine's cache), so an invalid
schema / regex / grammar, or a feature llguidance does not support, is refused with
``param="structured_outputs"`` before anything is queued. The validator's fields never
change; the compiler is thread-safe, so handler threads may call ``check_params``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from roseinfer.engine.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarError
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_outputs import StructuredOutputsParams


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool
    grammars: GrammarCompiler | None = None  # None: structured outputs are refused

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Every id must be an int inside the vocabulary."""
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"{param}: token id {t!r} is outside the vocabulary [0, {vocab})", param)

    def check_prompt(self, prompt_ids: Sequence[int], param: str = "prompt") -> None:
        if not prompt_ids:
            raise InvalidRequestError(f"{param}: the prompt is empty", param)
        self.check_token_ids(prompt_ids, param)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"{param}: the prompt has {len(prompt_ids)} tokens but max_model_len is "
                f"{self.max_model_len} (the prompt plus at least one generated token must fit)",
                param)

    def check_params(self, params: SamplingParams) -> None:
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")
        params.stop_strings  # noqa: B018 - compiled here, off the engine thread
        if params.allowed_token_ids is not None:
            self.check_token_ids(params.allowed_token_ids, "allowed_token_ids")
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar (from the engine's cache once compiled), or
        ``InvalidRequestError`` naming ``structured_outputs``."""
        if self.grammars is None or not self.has_tokenizer:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none",
                                      "structured_outputs")
        try:
            return self.grammars.compile(spec)
        except GrammarError as exc:
            raise InvalidRequestError(f"structured_outputs: {exc}", "structured_outputs") from None

    def check(self, prompt_ids: Sequence[int], params: SamplingParams,
              prompt_param: str = "prompt") -> None:
        """Raise ``InvalidRequestError`` unless the engine can run this request."""
        self.check_prompt(prompt_ids, prompt_param)
        self.check_params(params)
