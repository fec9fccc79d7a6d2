"""Tokenizer: a thin wrapper over a transformers fast tokenizer plus the chat template.

Sources:

* a Hugging Face directory (``tokenizer.json`` / ``tokenizer_config.json``), via
  ``AutoTokenizer``;
* a ``.gguf`` file: the vocabulary, merges, special tokens and chat template
  stored in its metadata, converted by transformers' GGUF tokenizer converter.
  ``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)`` is used instead
  of ``AutoTokenizer``: the latter also builds the model config through
  ``gguf.GGUFReader`` (~7 s for the bundled model) only to pick the tokenizer
  class, while the tokenizer itself comes from the same converter;
* a ``.pt``/``.pth`` file: the tokenizer files in its directory.

Nothing here touches the network (``local_files_only=True``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """Encode/decode and chat-template rendering for one model."""

    def __init__(self, hf: Any, name_or_path: str | None = None,
                 extra_eos_ids: Sequence[int] = ()) -> None:
        """Wrap a transformers tokenizer; ``extra_eos_ids`` join ``eos_token_ids``."""
        self.hf = hf
        self.name_or_path = name_or_path or str(getattr(hf, "name_or_path", ""))
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        for token_id in extra_eos_ids:
            if int(token_id) not in eos:
                eos.append(int(token_id))
        self._eos_token_ids = tuple(eos)

    @classmethod
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer for an HF directory, a GGUF file or a .pt file."""
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"Tokenizer source not found: {str(path)!r}")
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls._from_gguf(path)
        directory = path if path.is_dir() else path.parent
        if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
            ggufs = sorted(directory.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls._from_gguf(ggufs[0])
            raise FileNotFoundError(
                f"No tokenizer found for {path}: expected tokenizer.json/tokenizer_config.json "
                f"in {directory} or a .gguf file"
            )
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return cls(hf, str(path), _generation_config_eos(directory))

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        from transformers import PreTrainedTokenizerFast

        from roseinfer.model.gguf_loader import read_gguf_metadata

        hf = PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
        metadata = read_gguf_metadata(path)
        extra = [metadata[f"tokenizer.ggml.{key}"] for key in ("eot_token_id", "eom_token_id")
                 if metadata.get(f"tokenizer.ggml.{key}") is not None]
        return cls(hf, str(path), extra + _generation_config_eos(path.parent))

    # -- encoding / decoding -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's chat template (ValueError if it has none)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                f"Model {self.name_or_path} has no chat template; send a plain prompt instead"
            )
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    # -- properties ----------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS id plus generation_config.json / GGUF end-of-turn ids, deduplicated."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(self.hf.all_special_ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def _generation_config_eos(directory: Path) -> list[int]:
    """EOS ids from ``generation_config.json`` in ``directory`` (empty if absent)."""
    cfg_path = directory / "generation_config.json"
    if not cfg_path.is_file():
        return []
    with open(cfg_path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
