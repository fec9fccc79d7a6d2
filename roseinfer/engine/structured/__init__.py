"""Constrained decoding (structured outputs) with llguidance.

``compiler``: ``SamplingParams.structured_outputs`` -> a compiled grammar (cached by key,
bounded LRU, owned by the engine); ``matcher``: one sequence's grammar state;
``masks``: the allowed-token bitmasks of a batch of matchers; ``decoding``: the engine's
per-step hooks (masks before sampling, advance after). Data flow: docs/CONTRACTS.md.
"""

from roseinfer.engine.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarError
from roseinfer.engine.structured.decoding import GrammarMasks, StructuredDecoding
from roseinfer.engine.structured.matcher import GrammarMatcher

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarMasks",
           "GrammarMatcher", "StructuredDecoding"]
