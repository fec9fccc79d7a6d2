"""StructuredOutputsParams: what a request's output must match (frozen, validated).

Exactly one kind is set (vLLM's names): ``json`` (a JSON schema, as a dict or its JSON
text), ``json_object`` (True: any JSON object), ``regex``, ``choice`` (the output is
one of the strings) or ``grammar`` (a context-free grammar in llguidance's Lark-like
syntax; GBNF is converted). Only types and sizes are checked here; whether the schema /
regex / grammar compiles is decided by the engine before the request is queued
(``RequestValidator``), since compiling needs the model's tokenizer.

``key`` is the canonical form (kind, spec text, options) the engine caches compiled
grammars by: two params with the same key share one compiled grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Documented bounds (docs/CONTRACTS.md); the HTTP layer uses the same numbers.
MAX_SCHEMA_CHARS = 65_536  # a JSON schema, serialised compactly
MAX_GRAMMAR_CHARS = 65_536
MAX_REGEX_CHARS = 4_096
MAX_CHOICES = 1_024
MAX_CHOICE_CHARS = 1_024  # characters per choice

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # json / json_object: no whitespace between tokens
    # Canonical (kind, spec, options), filled in by validation.
    key: tuple[str, str, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, (str, bytes, Mapping)):
            try:
                object.__setattr__(self, "choice", tuple(self.choice))
            except TypeError:
                pass  # refused below with the field's name
        object.__setattr__(self, "key", (self.kind, self._spec(), self.disable_any_whitespace))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def kind(self) -> str:
        """The one kind that is set (ValueError unless exactly one is)."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of "
                             f"{', '.join(KINDS)}; got {len(given)} ({', '.join(given) or 'none'})")
        return given[0]

    def _spec(self) -> str:
        """Validate the kind's value; return its canonical text."""
        if not isinstance(self.disable_any_whitespace, bool):
            raise _bad("disable_any_whitespace", "must be a bool", self.disable_any_whitespace)
        kind = self.kind
        if kind == "json":
            return _schema_text(self.json)
        if kind == "json_object":
            if self.json_object is not True:
                raise _bad("json_object", "must be True or None", self.json_object)
            return '{"type":"object"}'
        if kind == "regex":
            return _text("regex", self.regex, MAX_REGEX_CHARS)
        if kind == "grammar":
            return _text("grammar", self.grammar, MAX_GRAMMAR_CHARS)
        return _choice_text(self.choice)


def _bad(name: str, why: str, value: object) -> ValueError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return ValueError(f"StructuredOutputsParams.{name} {why}, got {shown}")


def _text(name: str, value: object, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(name, "must be a non-empty string", value)
    if len(value) > limit:
        raise ValueError(f"StructuredOutputsParams.{name} must be at most {limit} characters, "
                         f"got {len(value)}")
    return value


def _schema_text(schema: object) -> str:
    """Compact JSON text of a schema given as a dict or as JSON text (key order kept:
    it is the order properties are generated in)."""
    if isinstance(schema, str):
        if len(schema) > 4 * MAX_SCHEMA_CHARS:
            raise ValueError(f"StructuredOutputsParams.json must be at most {MAX_SCHEMA_CHARS} "
                             f"characters, got {len(schema)}")
        try:
            schema = json.loads(schema, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise _bad("json", "must be a JSON schema object (a dict or its JSON text)", schema)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"StructuredOutputsParams.json is not JSON-serialisable: {exc}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"StructuredOutputsParams.json must be at most {MAX_SCHEMA_CHARS} "
                         f"characters as compact JSON, got {len(text)}")
    return text


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _choice_text(choice: object) -> str:
    if not isinstance(choice, tuple) or not choice:
        raise _bad("choice", "must be a non-empty list of strings", choice)
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"StructuredOutputsParams.choice must hold at most {MAX_CHOICES} "
                         f"strings, got {len(choice)}")
    for c in choice:
        if not isinstance(c, str) or not c:
            raise _bad("choice", "must hold non-empty strings", c)
        if len(c) > MAX_CHOICE_CHARS:
            raise ValueError(f"StructuredOutputsParams.choice strings must be at most "
                             f"{MAX_CHOICE_CHARS} characters, got {len(c)}")
    return json.dumps(list(choice), ensure_ascii=False)

