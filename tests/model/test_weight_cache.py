"""The weight cache (roseinfer/model/weight_cache.py, factory.load_model): a converted
model stored once and built back bitwise, misses on any change, corrupt entries rebuilt.

Tiny llama GGUF / safetensors checkpoints; logits compared with ``torch.equal``.  A GGUF
in the default ``int8`` format with the GGUF kernels loaded is not cached (its weights are
packed straight from the file, ``model/gguf_stream.py``): the cache mechanics are tested
with ``fp16`` GGUF loads and ``int8`` safetensors ones.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from conftest_loader import (  # noqa: E402
    llama_gguf_tensors,
    llama_metadata,
    tiny_llama,
    write_gguf,
)
from family_helpers import random_tokens, run_schedule, schedule_for  # noqa: E402

from roseinfer.kernels import cpu_kernels_available  # noqa: E402
from roseinfer.model import factory  # noqa: E402
from roseinfer.model.factory import load_model  # noqa: E402
from roseinfer.model.gguf_stream import gguf_kernels_loaded  # noqa: E402

CPU = torch.device("cpu")
TYPES = {"token_embd": QT.F32, "attn_q": QT.Q8_0, "attn_k": QT.Q4_0, "attn_v": QT.F16,
         "attn_output": QT.Q8_0, "ffn_gate": QT.Q8_0, "ffn_up": QT.Q4_1, "ffn_down": QT.F32}


pytestmark = pytest.mark.usefixtures("private_cache_dir")  # tests/conftest.py


def _gguf(tmp_path: Path, seed: int = 0, tie: bool = True, name: str = "tiny.gguf",
          types: dict[str, QT] = TYPES) -> Path:
    model = tiny_llama(tie=tie, seed=seed)
    return write_gguf(tmp_path / name, "llama", llama_metadata(model.config),
                      llama_gguf_tensors(model, types))


def _gguf_with_tokenizer(path: Path) -> Path:
    """A tiny llama GGUF with a byte-level BPE vocabulary (256 tokens, a few merges)."""
    from tokenizers.pre_tokenizers import ByteLevel

    model = tiny_llama(tie=True)
    # 256 tokens (the model's vocabulary): 254 byte symbols and two merges
    return write_gguf(path, "llama", llama_metadata(model.config),
                      llama_gguf_tensors(model, TYPES),
                      tokens=sorted(ByteLevel.alphabet())[:254] + ["he", "ll"],
                      merges=["h e", "l l"])


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    tokens = random_tokens(model.config.vocab_size, [15, 8])
    return run_schedule(model, tokens, schedule_for([[5, 8, 1, 1], [6, 1, 1]], [0, 1]))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "weights").glob("*.safetensors"))


def _no_checkpoint_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading the checkpoint's tensors fail: a load that works is a cache hit."""
    def fail(*_args: object) -> None:
        raise AssertionError("the checkpoint's tensors were loaded: not a cache hit")
    monkeypatch.setattr(factory, "_load", fail)


@pytest.mark.parametrize("quantization", ["int8", "fp16", "none"])
def test_round_trip_is_bitwise(tmp_path: Path, private_cache_dir: Path, quantization: str,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = _gguf(tmp_path)
    reference, _, _ = load_model(path, torch.float32, CPU, quantization, weight_cache=False)
    assert _entries(private_cache_dir) == []  # weight_cache=False writes nothing
    first, _, _ = load_model(path, torch.float32, CPU, quantization)  # converts, stores
    if quantization == "int8" and gguf_kernels_loaded():  # streamed from the file
        assert _entries(private_cache_dir) == []
        assert _equal(_logits(first), _logits(reference))
        return
    assert len(_entries(private_cache_dir)) == 1
    with monkeypatch.context() as m:
        _no_checkpoint_load(m)
        second, config, source = load_model(path, torch.float32, CPU, quantization)  # hit
    assert source == path and config.num_layers == 2
    assert getattr(second, "quantization", "none") == quantization
    want = _logits(reference)
    assert _equal(_logits(first), want) and _equal(_logits(second), want)


@pytest.mark.skipif(not cpu_kernels_available() or gguf_kernels_loaded(),
                    reason="int8 layers of a GGUF are cached only without the GGUF kernels")
def test_int8_layers_come_from_the_stored_q_and_scales(tmp_path: Path, private_cache_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open

    from roseinfer.kernels import quantize_int8_blocks
    from roseinfer.kernels.q4_1 import recover_q4_1

    # gate and up both Q4_1: the fused gate_up_proj keeps them as they are (4 bits)
    path = _gguf(tmp_path, tie=False, types={**TYPES, "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1})
    load_model(path, torch.float32, CPU, "int8")
    (entry,) = _entries(private_cache_dir)
    reference, _, _ = load_model(path, torch.float32, CPU, None)  # as loaded, fp32
    mlp = reference.model.layers[1].mlp
    with safe_open(str(entry), "pt") as f:
        names = set(f.keys())
        q, scales = quantize_int8_blocks(mlp.down_proj.weight)
        assert torch.equal(f.get_tensor("linear/model.layers.1.mlp.down_proj/qweight"), q)
        assert torch.equal(f.get_tensor("linear/model.layers.1.mlp.down_proj/scales"), scales)
        q4 = recover_q4_1(mlp.gate_up_proj.weight)
        assert q4 is not None
        for key, want in zip(("q4weight", "q4scales", "q4mins"), q4, strict=True):
            assert torch.equal(f.get_tensor(f"linear/model.layers.1.mlp.gate_up_proj/{key}"), want)
    assert "linear/lm_head/qweight" in names and "param/model.embed_tokens.weight" in names
    assert not any(n.endswith("/weight") and n.startswith("linear/") for n in names)
    with monkeypatch.context() as m:
        _no_checkpoint_load(m)
        warm, _, _ = load_model(path, torch.float32, CPU, "int8")
    assert warm.model.layers[0].self_attn.qkv_proj.kernel is not None


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_entry_is_rebuilt_with_a_warning(tmp_path: Path, private_cache_dir: Path, damage: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = _gguf(tmp_path)
    want = _logits(load_model(path, torch.float32, CPU, "fp16")[0])
    (entry,) = _entries(private_cache_dir)
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40  # in the last tensor's bytes
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file")
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="roseinfer.model"):
        rebuilt, _, _ = load_model(path, torch.float32, CPU, "fp16")
    assert any("weight cache entry" in r.getMessage() for r in caplog.records)
    assert _equal(_logits(rebuilt), want)
    (again,) = _entries(private_cache_dir)  # rewritten, and sound
    assert again.read_bytes() != bytes(data)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roseinfer.model"):
        warm, _, _ = load_model(path, torch.float32, CPU, "fp16")
    assert not caplog.records and _equal(_logits(warm), want)


def test_each_format_and_dtype_has_its_own_entry(tmp_path: Path, private_cache_dir: Path) -> None:
    path = _gguf(tmp_path)
    for quantization in ("int8", "fp16", "none"):
        load_model(path, torch.float32, CPU, quantization)
    load_model(path, torch.bfloat16, CPU, "none")
    assert len(_entries(private_cache_dir)) == (3 if gguf_kernels_loaded() else 4)
    fp16 = _logits(load_model(path, torch.float32, CPU, "fp16")[0])  # hits, not int8's entry
    assert _equal(fp16, _logits(load_model(path, torch.float32, CPU, "fp16", False)[0]))


def test_changed_source_is_a_miss_and_replaces_the_old_entry(tmp_path: Path, private_cache_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    path = _gguf(tmp_path, seed=0)
    load_model(path, torch.float32, CPU, "fp16")
    (old,) = _entries(private_cache_dir)
    _gguf(tmp_path, seed=1)  # same name, same size, other weights
    fresh = _logits(load_model(path, torch.float32, CPU, "fp16", weight_cache=False)[0])
    got = _logits(load_model(path, torch.float32, CPU, "fp16")[0])
    assert _equal(got, fresh)
    (new,) = _entries(private_cache_dir)  # the stale entry of this model + format was removed
    assert new != old


def test_switched_off_by_the_environment(tmp_path: Path, private_cache_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = _gguf(tmp_path)
    monkeypatch.setenv("ROSEINFER_WEIGHT_CACHE", "0")
    load_model(path, torch.float32, CPU, "fp16")
    assert _entries(private_cache_dir) == []
    load_model(path, torch.float32, CPU, "fp16", weight_cache=True)  # the option wins
    assert len(_entries(private_cache_dir)) == 1


def test_safetensors_dir_caches_int8_only(tmp_path: Path, private_cache_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(tie=False)
    model.save_pretrained(tmp_path / "hf")
    load_model(tmp_path / "hf", torch.float32, CPU, "none")  # fp32 copy: nothing to gain
    assert _entries(private_cache_dir) == []
    if not cpu_kernels_available():
        pytest.skip("int8 layers need the C++ kernels")
    want = _logits(load_model(tmp_path / "hf", torch.float32, CPU, "int8")[0])
    assert len(_entries(private_cache_dir)) == 1
    with monkeypatch.context() as m:
        _no_checkpoint_load(m)
        assert _equal(_logits(load_model(tmp_path / "hf", torch.float32, CPU, "int8")[0]), want)


def test_engine_uses_the_weight_cache(tmp_path: Path, private_cache_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM(..., weight_cache=...) reaches load_model; greedy outputs agree with and
    without the cache (needs LLMEngine to pass quantization / weight_cache on)."""
    from roseinfer import LLM, SamplingParams

    path = _gguf_with_tokenizer(tmp_path / "tok.gguf")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 33, 9]
    options = {"num_threads": 1, "num_kv_blocks": 16, "quantization": "fp16"}
    plain = LLM(str(path), weight_cache=False, **options).generate([prompt], params)
    assert _entries(private_cache_dir) == []
    LLM(str(path), **options)
    assert len(_entries(private_cache_dir)) == 1
    with monkeypatch.context() as m:
        _no_checkpoint_load(m)
        cached = LLM(str(path), **options).generate([prompt], params)
    assert cached[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_unwritable_cache_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    path = _gguf(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(blocker / "cache"))
    want = _logits(load_model(path, torch.float32, CPU, "fp16", weight_cache=False)[0])
    with caplog.at_level(logging.WARNING, logger="roseinfer.model"):
        got = _logits(load_model(path, torch.float32, CPU, "fp16")[0])
    assert _equal(got, want)
    assert any("could not write the weight cache" in r.getMessage() for r in caplog.records)
