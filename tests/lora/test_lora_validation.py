"""Bad LoRA adapters are refused before anything reaches the engine: one ValueError
(InvalidRequestError, param ``lora_request``) naming the problem."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.lora import LoRARequest
from tests.engine.invariance_helpers import make_engine, tiny_gqa_llama

HIDDEN, KV = 256, 128  # tiny_gqa_llama: hidden 256, 2 KV heads x 64
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    return make_engine(tiny_gqa_llama(0), "none", enable_lora=True, max_lora_rank=16)


def write_adapter(path: Path, tensors: dict[str, torch.Tensor] | None = None,
                  config: dict | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
           "base_model_name_or_path": "tiny"}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, HIDDEN),
                   f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(HIDDEN, 8)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def q_pair(layer: int = 0, r: int = 8, out: int = HIDDEN, k: int = HIDDEN,
           module: str = "self_attn.q_proj") -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{layer}.{module}.lora_A.weight": torch.zeros(r, k),
            f"{PREFIX}.{layer}.{module}.lora_B.weight": torch.zeros(out, r)}


def _missing_config(p: Path) -> str:
    path = write_adapter(p)
    (p / "adapter_config.json").unlink()
    return path


def _missing_weights(p: Path) -> str:
    path = write_adapter(p)
    (p / "adapter_model.safetensors").unlink()
    return path


CASES = {
    "no directory": (lambda p: str(p / "nowhere"), "no such directory"),
    "missing config": (_missing_config, "missing adapter_config.json"),
    "missing weights": (_missing_weights, "missing adapter_model.safetensors"),
    "bad json": (lambda p: (write_adapter(p), (p / "adapter_config.json").write_text("{"))[0],
                 "not valid JSON"),
    "wrong shapes": (lambda p: write_adapter(p, q_pair(k=128)), "base model mismatch"),
    "k_proj shape": (lambda p: write_adapter(p, q_pair(out=HIDDEN, module="self_attn.k_proj")),
                     "base model mismatch"),
    "rank above limit": (lambda p: write_adapter(p, q_pair(r=32), {"r": 32}),
                         "rank 32 is above max_lora_rank 16"),
    "rank not the config's": (lambda p: write_adapter(p, q_pair(r=4)), "config says r=8"),
    "layer beyond": (lambda p: write_adapter(p, q_pair(layer=2)), "beyond the base model's 2"),
    "unknown module": (lambda p: write_adapter(p, q_pair(module="self_attn.qkv")),
                       "not in the model"),
    "lm head": (lambda p: write_adapter(p, {"base_model.model.lm_head.lora_A.weight":
                                            torch.zeros(8, HIDDEN)}), "LM head"),
    "target list": (lambda p: write_adapter(p, config={"target_modules": ["q_proj", "embed_tokens"]}),
                    "target modules ['embed_tokens']"),
    "dora": (lambda p: write_adapter(p, config={"use_dora": True}), "DoRA"),
    "half pair": (lambda p: write_adapter(p, {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight":
                                              torch.zeros(8, HIDDEN)}), "lora_B weight is missing"),
    "not lora": (lambda p: write_adapter(p, config={"peft_type": "IA3"}), "is not LORA"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_refused(engine, tmp_path: Path, case: str) -> None:  # noqa: ANN001
    make, message = CASES[case]
    path = make(tmp_path / "adapter")
    lora = LoRARequest("bad", 100 + list(CASES).index(case), path)
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        engine.add_request(f"r-{case}", [5, 6, 7], lora_request=lora)
    assert info.value.param == "lora_request"
    assert path in str(info.value) or case == "no directory"
    assert not engine.has_unfinished_requests()
    assert not engine.lora.manager.resident  # nothing loaded


def test_good_adapter_then_same_id_other_path(engine, tmp_path: Path) -> None:  # noqa: ANN001
    good = write_adapter(tmp_path / "good", q_pair())
    engine.add_request("ok", [5, 6, 7], lora_request=LoRARequest("good", 1, good))
    other = write_adapter(tmp_path / "other", q_pair())
    with pytest.raises(InvalidRequestError, match="already names adapter 'good'"):
        engine.add_request("dup", [5, 6, 7], lora_request=LoRARequest("other", 1, other))
    engine.abort_request("ok")
    assert not engine.has_unfinished_requests()
