"""Chat templates rendered as transformers renders them, without importing transformers.

``ChatTemplate(template, special_tokens).render(messages, add_generation_prompt)`` is
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` of
transformers 5 (``tokenization_utils_base.apply_chat_template`` and
``utils/chat_template_utils.py``): the same Jinja environment (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a no-op ``{% generation %}`` block, the ``tojson``
filter without HTML escaping, ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace`` as transformers restricts them) and the same inputs: message keys whose
value is None dropped, values reduced to plain JSON types, reasoning fields aliased, the
special tokens (``bos_token``...) as variables.  Importing transformers costs ~1.2 s;
this costs jinja2's ~0.1 s, and only when a template is rendered.
Tools and documents are not handled here (``Tokenizer.hf`` renders those).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """transformers' ``_plain_template_data``: JSON types only, anything else a label."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "item", None)) and type(value).__module__ == "numpy":
        return _plain(value.item())  # numpy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    """transformers' ``_alias_reasoning_fields``."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS
                              if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _environment() -> Any:
    """transformers' ``_cached_compile_jinja_template`` environment."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers
        records assistant spans there, only when asked to)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body
                                          ).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's Namespace signature
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, but got {name!r}. Please rename the attribute.")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


class ChatTemplate:
    """One model's chat template (compiled on first use)."""

    def __init__(self, template: str, special_tokens: Mapping[str, Any]) -> None:
        """``special_tokens``: transformers' ``special_tokens_map`` (``bos_token``...)."""
        self.template = template
        self.special_tokens = dict(special_tokens)
        self._compiled: Any = None

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (a non-empty list of dicts)."""
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. "
                             "Provide at least one message.")
        if self._compiled is None:
            self._compiled = _environment().from_string(self.template)
        chat = _plain([{k: v for k, v in m.items() if v is not None} for m in messages])
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        return self._compiled.render(messages=_alias_reasoning(chat), tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **_plain(self.special_tokens))
