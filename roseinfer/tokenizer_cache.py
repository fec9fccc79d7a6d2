"""The GGUF tokenizer cache: a GGUF's tokenizer converted once by transformers, saved.

Converting the vocabulary, merges and special tokens in a GGUF's metadata goes through
transformers' GGUF converter (~4 s for the default model, plus ~1 s to import
transformers).  The first start saves the result under
``<cache root>/tokenizers/<slot>-<key>/`` (``cache_key``: the GGUF's identity, the
transformers version, this file's code): transformers' ``save_pretrained`` files and
``fast_tokenizer.META_FILE``, which records the answers ``FastTokenizer`` needs and a
CRC-32 of each file.  Later starts read it with ``tokenizers`` alone (~0.1 s), exactly
the converted tokenizer (the entry is written only after ``FastTokenizer`` reproduced
the transformers tokenizer on probe texts; otherwise it is marked transformers-only and
transformers loads the saved files, still without the GGUF conversion).

An entry is written in a temporary directory and renamed into place; one that fails
its checks (key, checksums, unreadable) is replaced, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

from roseinfer.fast_tokenizer import META_FILE, FastTokenizer, read_meta
from roseinfer.model.cache_key import (
    cache_root,
    code_fingerprint,
    entry_name,
    slot_of,
    source_fingerprint,
)
from roseinfer.model.progress import step

logger = logging.getLogger("roseinfer.tokenizer")

TOKENIZER_CACHE_VERSION = 1
# Texts the saved tokenizer must encode and decode as transformers does before it is used
# without transformers: ASCII, code, emoji, CJK, accents, whitespace runs, special tokens.
PROBE_TEXTS = (
    "Hello world", "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see!",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12345678))",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 mixed with text", "中文测试，日本語のテキスト、한국어 텍스트",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ", "Ünïcödé àccents — “quotes” … ß",
    " don't , isn't . ok ? ", "",
)


def _file_crcs(directory: Path) -> dict[str, int]:
    return {p.name: zlib.crc32(p.read_bytes()) for p in sorted(directory.iterdir())
            if p.is_file() and p.name != META_FILE}


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def gguf_tokenizer_dir(gguf: Path) -> Path | None:
    """The cache entry of ``gguf``'s tokenizer, converted on the first call; None if it
    cannot be written (the caller converts in memory)."""
    key = {"cache_format": TOKENIZER_CACHE_VERSION, "source": source_fingerprint(gguf),
           "transformers": _transformers_version(), "code": code_fingerprint(("tokenizer_cache.py",))}
    root = cache_root() / "tokenizers"
    entry = root / entry_name(gguf, {"kind": "tokenizer"}, key)
    if entry.is_dir():
        problem = _check(entry, key)
        if problem is None:
            return entry
        logger.warning("tokenizer cache entry %s is %s: converting the tokenizer again",
                       entry, problem)
        _remove(entry)
    try:
        _write(entry, gguf, key)
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation
        logger.warning("could not write the tokenizer cache entry %s (%s)", entry, exc)
        return None
    return entry


def _check(entry: Path, key: dict[str, Any]) -> str | None:
    """None if the entry is sound, else what is wrong with it."""
    try:
        meta = read_meta(entry)
        if meta.get("key") != json.loads(json.dumps(key)):
            return "for another key"
        if _file_crcs(entry) != meta["files"]:
            return "corrupt (checksums differ)"
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt
        return f"unreadable ({exc})"
    return None


def convert_gguf_tokenizer(gguf: Path) -> Any:
    """transformers' tokenizer of a GGUF file (the slow conversion)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                   local_files_only=True)


def gguf_end_of_turn_ids(gguf: Path) -> list[int]:
    """End-of-turn / end-of-message ids a GGUF names besides EOS."""
    from roseinfer.model.gguf_loader import read_gguf_metadata

    metadata = read_gguf_metadata(gguf)
    return [int(metadata[f"tokenizer.ggml.{k}"]) for k in ("eot_token_id", "eom_token_id")
            if metadata.get(f"tokenizer.ggml.{k}") is not None]


def describe(hf: Any) -> dict[str, Any]:
    """What ``FastTokenizer`` needs from a transformers tokenizer besides its files."""
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    force = getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False)
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return {"class": type(hf).__name__, "bos_token_id": hf.bos_token_id,
            "eos_token_id": hf.eos_token_id, "all_special_ids": list(hf.all_special_ids),
            "len": len(hf), "special_tokens_map": dict(hf.special_tokens_map),
            "chat_template": template,
            "clean_up": bool(hf.clean_up_tokenization_spaces) and (not bpe or bool(force))}


def reproduces(fast: FastTokenizer, hf: Any) -> bool:
    """Whether ``fast`` encodes, decodes and renders the chat template as ``hf`` does."""
    for text in PROBE_TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            if fast.encode(text, add_special_tokens=special) != ids:
                return False
            for skip in (True, False):
                if fast.decode(ids, skip_special_tokens=skip) != hf.decode(
                        ids, skip_special_tokens=skip):
                    return False
    if fast.chat_template is not None:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
        for prompt in (True, False):
            if fast.apply_chat_template(messages, prompt) != hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=prompt):
                return False
    return True


def _write(entry: Path, gguf: Path, key: dict[str, Any]) -> None:
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir(parents=True)  # an unwritable cache fails here, before the conversion
    try:
        with step(f"converting the tokenizer of {gguf.name} (once, kept in {entry.parent})"):
            hf = convert_gguf_tokenizer(gguf)
        hf.save_pretrained(str(tmp))
        meta = {**describe(hf), "key": key, "extra_eos_ids": gguf_end_of_turn_ids(gguf),
                "files": _file_crcs(tmp)}
        meta["fast"] = reproduces(FastTokenizer(tmp, meta), hf)
        if not meta["fast"]:
            logger.warning("%s: the tokenizers-only path differs from transformers for this "
                           "tokenizer; it will be loaded through transformers", gguf.name)
        (tmp / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # else another process wrote it first: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for other in entry.parent.glob(f"{slot_of(entry.name)}-*"):
        if other != entry and other.is_dir():
            _remove(other)


def _remove(directory: Path) -> None:
    """Delete an entry directory (renamed away first, so no reader sees it half gone)."""
    trash = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.trash")
    try:
        os.rename(directory, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
