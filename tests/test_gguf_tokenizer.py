"""The GGUF tokenizer without transformers (roseinfer/tokenizer_cache.py, fast_tokenizer.py,
chat_template.py): converted once, then read with ``tokenizers`` alone, giving exactly
the transformers tokenizer's ids, text and chat prompts; damaged entries are rebuilt."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from roseinfer.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}{{ bos_token }}[{{ m['role'] | upper }}] {{ m['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see!",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12345678))",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 mixed with text", "中文测试，日本語のテキスト、한국어 텍스트",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ", "<|im_start|>user\nhi<|im_end|>\n",
    "Ünïcödé àccents — “quotes” … ß", "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "中文?"}],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": ""}],
]


pytestmark = pytest.mark.usefixtures("private_cache_dir")  # tests/conftest.py


def _tiny_gguf(path: Path) -> Path:
    """A GGUF holding only a byte-level BPE vocabulary (GPT-2 style) and a chat template."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "<eot>"] + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell"])
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_token_types([3, 3, 3] + [1] * 259)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_uint32("tokenizer.ggml.eot_token_id", 2)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same(tok: Tokenizer, ref: Tokenizer, texts: list[str]) -> None:
    assert not tok.uses_transformers and ref.uses_transformers
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip), text
            assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids, tok.vocab_size) == (
        ref.bos_token_id, ref.eos_token_id, ref.eos_token_ids, ref.vocab_size)
    assert tok.all_special_ids == ref.all_special_ids
    for conv in CONVERSATIONS:
        for prompt in (True, False):
            assert tok.apply_chat_template(conv, prompt) == ref.apply_chat_template(conv, prompt)


def _entry(cache: Path) -> Path:
    (entry,) = (cache / "tokenizers").iterdir()
    return entry


def test_tiny_gguf_fast_path_equals_transformers(tmp_path: Path, private_cache_dir: Path) -> None:
    path = _tiny_gguf(tmp_path / "tok.gguf")
    ref = Tokenizer.from_model_path(path, cache=False)  # transformers converts it in memory
    assert not (private_cache_dir / "tokenizers").exists()
    first = Tokenizer.from_model_path(path)  # converts and stores
    second = Tokenizer.from_model_path(path)  # reads the entry
    for tok in (first, second):
        _same(tok, ref, TEXTS + ["hello hell shell"])
    assert 2 in second.eos_token_ids  # the GGUF's end-of-turn id, kept in the entry
    assert second.hf.encode("hello") == second.encode("hello")  # .hf loads on demand
    meta = json.loads((_entry(private_cache_dir) / "roseinfer_tokenizer.json").read_text())
    assert meta["fast"] is True


def test_warm_load_does_not_import_transformers(tmp_path: Path, private_cache_dir: Path) -> None:
    path = _tiny_gguf(tmp_path / "tok.gguf")
    Tokenizer.from_model_path(path)
    code = ("import sys; from roseinfer.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_model_path({str(path)!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
            "print(t.encode('hello'), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


@pytest.mark.parametrize("damage", ["tokenizer.json", "meta", "key"])
def test_damaged_entry_is_rebuilt_with_a_warning(tmp_path: Path, private_cache_dir: Path, damage: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = _tiny_gguf(tmp_path / "tok.gguf")
    want = Tokenizer.from_model_path(path).encode("hello world")
    entry = _entry(private_cache_dir)
    if damage == "tokenizer.json":  # still valid JSON, one merge changed: checksum catches it
        data = json.loads((entry / "tokenizer.json").read_text())
        assert data["model"]["merges"][1] == ["l", "l"]
        data["model"]["merges"][1] = ["h", "l"]
        (entry / "tokenizer.json").write_text(json.dumps(data))
    elif damage == "meta":
        (entry / "roseinfer_tokenizer.json").write_text("{not json")
    else:
        meta = json.loads((entry / "roseinfer_tokenizer.json").read_text())
        meta["key"]["transformers"] = "0.0"
        (entry / "roseinfer_tokenizer.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="roseinfer.tokenizer"):
        tok = Tokenizer.from_model_path(path)
    assert any("tokenizer cache entry" in r.getMessage() for r in caplog.records)
    assert tok.encode("hello world") == want and not tok.uses_transformers
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roseinfer.tokenizer"):
        assert Tokenizer.from_model_path(path).encode("hello world") == want
    assert not caplog.records


@pytest.mark.slow
def test_default_model_fast_path_equals_transformers() -> None:
    from roseinfer.model.loader import default_model_path

    path = default_model_path()
    ref = Tokenizer.from_model_path(path, cache=False)
    Tokenizer.from_model_path(path)  # first start: converts, stores
    tok = Tokenizer.from_model_path(path)
    _same(tok, ref, TEXTS + [" ".join(TEXTS)])
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")
