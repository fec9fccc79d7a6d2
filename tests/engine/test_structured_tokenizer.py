"""The llguidance tokenizer reads each token's real bytes. transformers 5.17 converted
the default model's GGUF (a GPT-2 byte-level BPE) into a tokenizer.json with
``byte_fallback: true`` and a ``ByteFallback`` decoder first; llguidance then took
``Ġdelta`` as the bytes ``c4 a0 d e l t a`` instead of `` delta``, and constrained
requests needing such a token failed ("forced bytes: got ' '"). Seen on a machine with
transformers 5.17; reproduced here by writing that JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import transformers
from tokenizers import Tokenizer

from roseinfer.engine.structured.compiler import build_ll_tokenizer
from tests.engine.structured_helpers import real_tokenizer


def _as_transformers_517_wrote_it(tok: Tokenizer) -> Tokenizer:
    spec = json.loads(tok.to_str())
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": True}]}
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("quirk", [False, True], ids=["as-is", "transformers-5.17"])
def test_byte_level_tokens_are_their_bytes(quirk: bool) -> None:
    hf = real_tokenizer().hf
    backend = hf.backend_tokenizer
    if quirk:
        backend = _as_transformers_517_wrote_it(backend)
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    ll = build_ll_tokenizer(SimpleNamespace(hf=wrapped), [hf.eos_token_id])
    for text in (" delta", " Paris", "\n\n", "é", " 中文"):
        ids = hf.encode(text, add_special_tokens=False)
        assert b"".join(ll.decode_bytes([i]) for i in ids) == text.encode(), (text, ids)


def test_a_byte_fallback_vocabulary_is_left_alone() -> None:
    """A SentencePiece-style vocabulary (``<0x..>`` byte tokens, ``▁`` for spaces) keeps
    its byte fallback: ``▁hi`` is `` hi``, ``<0x41>`` the byte ``A``."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x41>": 3, "▁hi": 4, "▁": 5, "h": 6, "i": 7, "hi": 8}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁",
                                             "prepend_scheme": "first", "split": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [["h", "i"], ["▁", "hi"]]},
    }
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    ll = build_ll_tokenizer(SimpleNamespace(hf=wrapped), [2])
    assert ll.decode_bytes([4]) == b" hi"
    assert ll.decode_bytes([3]) == b"A"
