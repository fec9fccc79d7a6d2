"""Tests for roseinfer.tokenizer.Tokenizer: the bundled GGUF (ids, chat template, round trips,
equality with transformers' AutoTokenizer GGUF path) and tiny HF tokenizer directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from roseinfer.model.loader import default_model_path
from roseinfer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see!",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12345678))",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 mixed with text",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Ünïcödé àccents — “quotes” … ß",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def test_gguf_tokenizer_basics(tok: Tokenizer) -> None:
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.name_or_path.endswith(".gguf")
    assert tok.hf is not None


def test_gguf_chat_template(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "x"}],
                                        add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # special tokens stay whole


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    if "<|" not in text:
        assert tok.decode(ids) == text


def test_same_ids_as_transformers_autotokenizer(tok: Tokenizer) -> None:
    """Our GGUF path skips AutoTokenizer's config parse but must tokenize identically."""
    from transformers import AutoTokenizer

    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                        local_files_only=True)
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special), text
    ids = tok.encode(" ".join(TEXTS))
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert set(tok.all_special_ids) == set(ref.all_special_ids) and tok.vocab_size == len(ref)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def _tiny_hf_tokenizer(directory: Path, chat_template: str | None) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<eot>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world, hello there"] * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 additional_special_tokens=["<eot>"])
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(directory)


def test_hf_dir_tokenizer(tmp_path: Path) -> None:
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    _tiny_hf_tokenizer(tmp_path, template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = Tokenizer.from_model_path(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.eos_token_ids == (1, 2)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi</s>[assistant]"
    # a .pt file loads the tokenizer from its directory
    torch.save({}, tmp_path / "model.pt")
    assert Tokenizer.from_model_path(tmp_path / "model.pt").encode("hello") == tok.encode("hello")


def test_no_chat_template_raises(tmp_path: Path) -> None:
    _tiny_hf_tokenizer(tmp_path, None)
    tok = Tokenizer.from_model_path(tmp_path)
    assert tok.eos_token_ids == (1,)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        Tokenizer.from_model_path(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        Tokenizer.from_model_path(tmp_path)
