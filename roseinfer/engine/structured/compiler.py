"""GrammarCompiler: ``StructuredOutputsParams`` -> a compiled llguidance grammar, cached.

Owned by the engine (one per tokenizer) and shared with its ``RequestValidator``, so a
request's grammar is compiled on the caller's thread before it is queued; the engine
then only copies the compiled matcher (microseconds). Compiled grammars — and compile
errors, so a bad schema sent again is refused at once — are kept in a bounded LRU keyed
by ``StructuredOutputsParams.key``. Safe to call from several threads.

A grammar that compiles is also run for one step on a copy (``probe.probe_first_step``:
first mask, one token consumed) under ``GRAMMAR_LIMITS``, so a grammar llguidance cannot
run (lexer fuel, Earley items) is a compile error too, and its cost is bounded.

The llguidance tokenizer (the model's vocabulary as byte strings, ~0.5-1 s to build)
is built on first use, once per compiler. Token ids the tokenizer does not know (a model
vocabulary wider than the tokenizer's) are never allowed by any grammar.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roseinfer.engine.structured.lru import LRUCache
from roseinfer.engine.structured.matcher import GrammarMatcher
from roseinfer.engine.structured.probe import probe_first_step
from roseinfer.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

GRAMMAR_CACHE_SIZE = 256  # compiled grammars (and compile errors) kept per engine
MAX_ERROR_CHARS = 1000  # of an llguidance error message passed on to the client
# llguidance's parser limits, spelled out (its defaults): they bound both the compile
# and the probe's first step (``LLParserLimits`` documents each one's cost).
GRAMMAR_LIMITS = {
    "max_items_in_row": 2_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
    "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000,
}


class GrammarError(ValueError):
    """The schema / regex / grammar cannot be compiled, or this engine cannot constrain."""


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One compiled grammar; ``new_matcher()`` gives a sequence its own state."""

    key: tuple[str, str, bool]
    grammar: str  # llguidance's grammar text
    _prototype: llguidance.LLMatcher  # never advanced: copied per sequence

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        """``tokenizer``: the engine's ``roseinfer.tokenizer.Tokenizer`` (a Hugging Face
        fast tokenizer in ``.hf``), or None; ``eos_token_ids``: allowed when a grammar
        accepts."""
        self._tokenizer = tokenizer
        self._eos_token_ids = tuple(eos_token_ids)
        self._cache: LRUCache[tuple[str, str, bool], CompiledGrammar | GrammarError] = (
            LRUCache(cache_size))
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> LRUCache:
        return self._cache

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance view of the model's tokenizer (built once, on first use)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self._tokenizer, self._eos_token_ids)
            return self._ll_tokenizer

    @property
    def ll_vocab_size(self) -> int:
        return int(self.ll_tokenizer().vocab_size)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params``; ``GrammarError`` if it cannot be compiled."""
        result = self._cache.get_or_create(params.key, lambda: self._compile(params))
        if isinstance(result, GrammarError):
            raise GrammarError(str(result))
        return result

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar | GrammarError:
        import llguidance

        try:
            ll_tok = self.ll_tokenizer()
        except GrammarError as exc:
            return exc
        kind, spec, compact = params.key
        try:
            grammar = _grammar_text(kind, spec, compact)
        except ValueError as exc:
            return GrammarError(f"invalid {kind}: {_short(str(exc))}")
        limits = llguidance.LLParserLimits(verbose_errors=False, **GRAMMAR_LIMITS)
        try:
            matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0, limits=limits)
        except Exception as exc:  # noqa: BLE001 - documented never to raise; be safe
            return GrammarError(f"invalid {kind}: {_short(str(exc))}")
        if matcher.is_error():
            return GrammarError(f"invalid {kind}: {_short(matcher.get_error())}")
        problem = probe_first_step(matcher, int(ll_tok.vocab_size), self._eos_token_ids)
        if problem is not None:
            first_line = (problem.strip().splitlines() or ["unknown error"])[0]
            return GrammarError(f"{kind} cannot be run: {_short(first_line)}")
        return CompiledGrammar(params.key, grammar, matcher)


def _grammar_text(kind: str, spec: str, compact: bool) -> str:
    """llguidance's grammar for one kind (ValueError for text it cannot convert)."""
    import llguidance

    if kind in ("json", "json_object"):
        overrides = {"whitespace_flexible": False} if compact else None
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=overrides)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    raise ValueError(f"unknown structured output kind {kind!r}")


def build_ll_tokenizer(tokenizer: Any, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of ``tokenizer`` (its Hugging Face fast tokenizer's JSON,
    made consistent by ``_byte_level_fixed``)."""
    hf = getattr(tokenizer, "hf", None)
    if tokenizer is None or getattr(hf, "backend_tokenizer", None) is None:
        raise GrammarError("structured outputs need the model's Hugging Face fast tokenizer; "
                           "this engine has none")
    import llguidance

    eos = [t for t in eos_token_ids if 0 <= t < len(hf)]
    backend = copy.copy(hf.backend_tokenizer)  # as llguidance.hf.from_tokenizer does
    backend.no_padding()
    backend.no_truncation()
    try:
        return llguidance.LLTokenizer(_byte_level_fixed(backend.to_str()),
                                      eos_token=eos or hf.eos_token_id)
    except Exception as exc:  # noqa: BLE001 - llguidance refuses this tokenizer
        raise GrammarError(f"structured outputs are not available for this model's "
                           f"tokenizer: {_short(str(exc))}") from exc


def _byte_level_fixed(spec_json: str) -> str:
    """A byte-level BPE (GPT-2's ``Ġ`` / ``Ċ`` alphabet: a ``ByteLevel`` pre-tokenizer)
    never falls back to ``<0x..>`` byte tokens; transformers 5.17 wrote such GGUF
    vocabularies with ``byte_fallback`` on and a ``ByteFallback`` decoder first, and
    llguidance then reads each token's text as its bytes (``Ġdelta`` as ``c4 a0 delta``,
    not `` delta``). Turned back into a plain byte-level BPE for llguidance; any other
    tokenizer is returned unchanged."""
    spec = json.loads(spec_json)
    model = spec.get("model") or {}
    if not (model.get("byte_fallback") and _has_byte_level(spec.get("pre_tokenizer"))
            and "<0x00>" not in (model.get("vocab") or {})):
        return spec_json
    model["byte_fallback"] = False
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True}
    return json.dumps(spec)


def _has_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or [])


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
