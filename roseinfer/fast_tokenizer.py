"""FastTokenizer: a tokenizer saved by transformers, run by the ``tokenizers`` library
alone (no transformers import: ~1 s less at startup).

It reads a directory written by ``tokenizer_cache`` — transformers' ``save_pretrained``
files plus ``roseinfer_tokenizer.json`` (``META_FILE``), which records what the
transformers tokenizer answered for the things ``tokenizer.json`` does not hold: special
token ids, ``len()``, the chat template and special-token map, whether decoding cleans up
spaces.  Encoding and decoding then are what transformers 5's ``TokenizersBackend``
does: ``tokenizers`` ``encode`` / ``decode`` (plus the clean-up when it applies); the
chat template goes through ``chat_template.ChatTemplate``.  The cache checks, when it
writes an entry, that this gives the transformers tokenizer's results on probe texts,
and marks the entry transformers-only otherwise (``meta["fast"]``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from roseinfer.chat_template import ChatTemplate

META_FILE = "roseinfer_tokenizer.json"


def read_meta(directory: Path) -> dict[str, Any]:
    with open(directory / META_FILE, encoding="utf-8") as f:
        return json.load(f)


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation/contractions)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                     (" 're", "'re")):
        text = text.replace(old, new)
    return text


class FastTokenizer:
    """Encode / decode / chat template of a saved tokenizer (see the module docstring)."""

    def __init__(self, directory: Path, meta: Mapping[str, Any]) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        self.raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
        self.meta = dict(meta)
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.all_special_ids: list[int] = list(meta["all_special_ids"])
        self.length: int = int(meta["len"])
        self._clean_up: bool = bool(meta["clean_up"])
        template = meta.get("chat_template")
        self.chat_template = (ChatTemplate(template, meta["special_tokens_map"])
                              if isinstance(template, str) and template else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.raw.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("no chat template")
        return self.chat_template.render(messages, add_generation_prompt)

    def __len__(self) -> int:
        return self.length
