"""Tokenizer: encode / decode and the chat template of one model.

Sources:

* a Hugging Face directory (``tokenizer.json`` / ``tokenizer_config.json``), via
  transformers' ``AutoTokenizer``;
* a ``.gguf`` file: the vocabulary, merges, special tokens and chat template stored in
  its metadata, converted by transformers' GGUF tokenizer converter once and kept in the
  tokenizer cache (``tokenizer_cache``); later starts read that with the ``tokenizers``
  library alone (``fast_tokenizer``, chat templates through ``chat_template``), and
  transformers is imported only if something asks for ``.hf`` (structured outputs,
  tools).  With the cache off (``cache=False``, ``$ROSEINFER_WEIGHT_CACHE=0``)
  transformers converts it in memory on every start, as it did before;
* a ``.pt``/``.pth`` file: the tokenizer files in its directory.

Nothing here touches the network (``local_files_only=True``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from roseinfer.fast_tokenizer import FastTokenizer, read_meta

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """Encode/decode and chat-template rendering for one model."""

    def __init__(self, hf: Any, name_or_path: str | None = None,
                 extra_eos_ids: Sequence[int] = (), *, fast: FastTokenizer | None = None,
                 load_hf: Callable[[], Any] | None = None) -> None:
        """Wrap a transformers tokenizer ``hf``, or a ``fast`` one (then ``hf`` may be None
        and ``load_hf`` makes the transformers one on first use of ``.hf``);
        ``extra_eos_ids`` join ``eos_token_ids``."""
        if hf is None and fast is None:
            raise ValueError("Tokenizer needs a transformers or a fast tokenizer")
        self._hf = hf
        self._fast = fast
        self._load_hf = load_hf
        self._hf_lock = threading.Lock()  # .hf may be first asked for by two threads
        self.name_or_path = name_or_path or str(getattr(hf, "name_or_path", ""))
        eos_id = self.eos_token_id
        eos = [eos_id] if eos_id is not None else []
        for token_id in extra_eos_ids:
            if int(token_id) not in eos:
                eos.append(int(token_id))
        self._eos_token_ids = tuple(eos)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (loaded on first use when the fast one serves)."""
        if self._hf is None:
            if self._load_hf is None:
                raise AttributeError("this tokenizer has no transformers counterpart")
            with self._hf_lock:
                if self._hf is None:
                    self._hf = self._load_hf()
        return self._hf

    @property
    def uses_transformers(self) -> bool:
        """Whether encoding goes through transformers (False: the ``tokenizers`` path)."""
        return self._fast is None

    @classmethod
    def from_model_path(cls, path: str | Path, cache: bool | None = None) -> Tokenizer:
        """Load the tokenizer for an HF directory, a GGUF file or a .pt file.

        ``cache``: use the tokenizer cache for GGUF files (None: unless
        ``$ROSEINFER_WEIGHT_CACHE`` turns caching off)."""
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"Tokenizer source not found: {str(path)!r}")
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls._from_gguf(path, cache)
        directory = path if path.is_dir() else path.parent
        if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
            ggufs = sorted(directory.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls._from_gguf(ggufs[0], cache)
            raise FileNotFoundError(
                f"No tokenizer found for {path}: expected tokenizer.json/tokenizer_config.json "
                f"in {directory} or a .gguf file"
            )
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return cls(hf, str(path), _generation_config_eos(directory))

    @classmethod
    def _from_gguf(cls, path: Path, cache: bool | None) -> Tokenizer:
        from roseinfer.model.cache_key import cache_enabled
        from roseinfer.tokenizer_cache import (
            convert_gguf_tokenizer,
            gguf_end_of_turn_ids,
            gguf_tokenizer_dir,
        )

        entry = gguf_tokenizer_dir(path) if cache_enabled(cache) else None
        if entry is None:  # no cache: transformers converts it now
            hf = convert_gguf_tokenizer(path)
            extra = gguf_end_of_turn_ids(path) + _generation_config_eos(path.parent)
            return cls(hf, str(path), extra)
        meta = read_meta(entry)
        extra = list(meta["extra_eos_ids"]) + _generation_config_eos(path.parent)

        def load_hf() -> Any:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)

        if not meta["fast"]:
            return cls(load_hf(), str(path), extra)
        return cls(None, str(path), extra, fast=FastTokenizer(entry, meta), load_hf=load_hf)

    # -- encoding / decoding -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        if self._fast is not None:
            return self._fast.convert_ids_to_tokens(ids)  # type: ignore[return-value]
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's chat template (ValueError if it has none)."""
        has_template = (self._fast.chat_template is not None if self._fast is not None
                        else bool(getattr(self.hf, "chat_template", None)))
        if not has_template:
            raise ValueError(
                f"Model {self.name_or_path} has no chat template; send a plain prompt instead"
            )
        if self._fast is not None:
            return self._fast.apply_chat_template(messages, add_generation_prompt)
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    # -- properties ----------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._fast.bos_token_id if self._fast is not None else self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._fast.eos_token_id if self._fast is not None else self.hf.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS id plus generation_config.json / GGUF end-of-turn ids, deduplicated."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._fast) if self._fast is not None else len(self.hf)

    @property
    def all_special_ids(self) -> frozenset[int]:
        if self._fast is not None:
            return frozenset(self._fast.all_special_ids)
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
