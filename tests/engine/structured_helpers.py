"""Helpers for the structured-output engine tests: a tiny random Llama with the default
model's real tokenizer (so llguidance sees a real 49,152-token vocabulary), a spy that
checks every constrained row's sampled token against the mask it was sampled under,
and a replay of outputs through a fresh matcher."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.request import Request
from roseinfer.model.config import ModelConfig
from roseinfer.model.loader import default_model_path
from roseinfer.model.registry import create_model
from roseinfer.outputs import CompletionOutput
from roseinfer.structured_outputs import StructuredOutputsParams
from roseinfer.tokenizer import Tokenizer
from tests.engine.tiny_models import engine_device, tiny_hf_llama

TOKENIZER_VOCAB = 49152  # the default model's


@functools.cache
def real_tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@functools.cache
def tiny_weights(vocab: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    hf = tiny_hf_llama(vocab=vocab, max_positions=1024)
    return ModelConfig.from_hf_dict(hf.config.to_dict()), hf.state_dict()


def tiny_engine(vocab: int = TOKENIZER_VOCAB, **options) -> LLMEngine:
    """An engine over a tiny random Llama (``vocab`` logits) with the real tokenizer."""
    model_config, state = tiny_weights(vocab)
    options.setdefault("device", engine_device())
    model = create_model(model_config, torch.float32, torch.device(options["device"]))
    model.load_weights(state.items())
    options.setdefault("num_threads", 1)
    options.setdefault("quantization", "none")
    options.setdefault("block_size", 4)
    options.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(**options), model=model, model_config=model_config,
                     tokenizer=real_tokenizer())


@dataclass
class MaskSpy:
    """Wraps ``engine.step_sampler.sample``: every constrained row's sampled token must
    be allowed by its mask, and EOS allowed exactly when its matcher accepts."""

    engine: LLMEngine
    checked: int = 0
    eos_allowed: int = 0
    errors: list[str] = field(default_factory=list)
    requests: set[Request] = field(default_factory=set)

    def __post_init__(self) -> None:
        inner = self.engine.step_sampler.sample
        eos = self.engine.eos_token_ids

        def sample(scheduled, logits, failed, masks=None):  # noqa: ANN001, ANN202
            accepting = {}
            if masks is not None:
                for req in masks.row_of:
                    accepting[req] = req.grammar.ll.is_accepting()
            tokens = inner(scheduled, logits, failed, masks)
            if masks is None:
                return tokens
            for s, toks in zip(scheduled, tokens, strict=True):
                req: Request = s.request
                row = masks.row_of.get(req)
                if row is None or not toks:
                    continue
                assert len(toks) == 1, "a constrained request never drafts"
                tok = toks[0]
                allowed = masks.allowed[row]
                self.requests.add(req)
                self.checked += 1
                if not bool(allowed[tok]):
                    self.errors.append(f"{req.request_id}: token {tok} not allowed")
                if bool(allowed[list(eos)].any()) != accepting[req]:
                    self.errors.append(f"{req.request_id}: EOS allowed != accepting")
                self.eos_allowed += int(bool(allowed[list(eos)].any()))
                if allowed.shape[0] > TOKENIZER_VOCAB and bool(allowed[TOKENIZER_VOCAB:].any()):
                    self.errors.append(f"{req.request_id}: an id beyond the tokenizer allowed")
            return tokens

        self.engine.step_sampler.sample = sample  # type: ignore[method-assign]

    def assert_matchers_in_step(self) -> None:
        """Each matcher consumed exactly its sequence's sampled tokens, once each (not the
        prompt, not again after a preemption)."""
        for req in self.requests:
            assert req.grammar is not None
            assert req.grammar.num_tokens == req.num_output_tokens, req.request_id


def replay(engine: LLMEngine, spec: StructuredOutputsParams, out: CompletionOutput) -> bool:
    """Feed the output's tokens to a fresh matcher: all must be accepted; returns whether
    the grammar accepts at the end."""
    matcher = engine.grammars.compile(spec).new_matcher()
    for tok in out.token_ids:
        assert matcher.accept(tok) is None, (out.text, tok)
    return matcher.ll.is_accepting()
