"""Read and check a PEFT LoRA adapter (``adapter_config.json`` +
``adapter_model.safetensors``) against the base model, before the engine sees it.

``inspect_adapter`` reads only the config and the safetensors header (names, shapes,
dtypes) and raises one ``ValueError`` naming the first problem: a missing file, a
config PEFT would not produce for a LoRA, a tensor on a module the model lacks (or one
roseinfer does not adapt: embeddings, the LM head), a layer past the model's, shapes
that do not fit the base model, a rank above ``max_lora_rank``.  ``read_adapter`` then
loads the checked tensors.  Scaling is PEFT's: ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``, per module through ``rank_pattern`` /
``alpha_pattern`` (keys matched as PEFT's ``get_pattern_key`` does).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from roseinfer.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# Module name -> (its block, the fused roseinfer linear it belongs to).
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn", "qkv"), "k_proj": ("self_attn", "qkv"),
    "v_proj": ("self_attn", "qkv"), "o_proj": ("self_attn", "o"),
    "gate_proj": ("mlp", "gate_up"), "up_proj": ("mlp", "gate_up"),
    "down_proj": ("mlp", "down"),
}
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_(A|B)\.weight")


@dataclass(frozen=True)
class ModuleSpec:
    """One adapted module of one layer: its rank and PEFT scaling."""

    layer: int
    module: str  # q_proj ... down_proj
    rank: int
    scaling: float


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: where its tensors are and what they adapt."""

    path: str  # the adapter directory
    weights_file: str
    modules: tuple[ModuleSpec, ...]
    max_rank: int
    base_model: str | None  # base_model_name_or_path, as written


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each adaptable module of the model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def _pattern_value(patterns: dict, key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup for the module path ``key``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: missing {CONFIG_FILE}")
    if os.path.getsize(cfg_path) > MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is larger than 1 MiB")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} must hold a JSON object")
    return cfg


def _check_config(path: str, cfg: dict) -> None:
    """Refuse what PEFT writes for features roseinfer does not compute."""
    def bad(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {path!r}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise bad(f"{key} must be a positive number, got {value!r}")
    if cfg.get("use_dora"):
        raise bad("DoRA (use_dora) is not supported")
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out (Conv1D layers) is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise bad(f"modules_to_save {cfg['modules_to_save']!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise bad(f"{key} must be an object")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted({str(t) for t in targets} - set(TARGETS))
        if unknown:
            raise bad(f"target modules {unknown} are not in the model's adaptable modules "
                      f"{sorted(TARGETS)}")


def inspect_adapter(path: str, config: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Check the adapter at ``path`` against ``config`` (see the module docstring)."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: no such directory")
    cfg = _read_config(path)
    _check_config(path, cfg)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        raise ValueError(f"LoRA adapter {path!r}: missing {WEIGHTS_FILE}")
    try:
        with safe_open(weights_file, framework="pt") as f:
            shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                      for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same answer
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is unreadable: {exc}") from None
    return _check_tensors(path, weights_file, cfg, shapes, config, max_lora_rank)


def _check_tensors(path: str, weights_file: str, cfg: dict,
                   shapes: dict[str, tuple[tuple[int, ...], str]], config: ModelConfig,
                   max_lora_rank: int) -> AdapterSpec:
    def bad(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {path!r}: {why}")

    expected = module_shapes(config)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, (shape, dtype) in shapes.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise bad(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's "
                      f"{sorted(TARGETS)} (embeddings, the LM head and biases are not supported)")
        layer, block, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in TARGETS or TARGETS[module][0] != block:
            raise bad(f"tensor {key!r}: target module {block}.{module} is not in the model "
                      f"(adaptable: {sorted(TARGETS)})")
        if layer >= config.num_layers:
            raise bad(f"tensor {key!r}: layer {layer} is beyond the base model's "
                      f"{config.num_layers} layers (base model mismatch?)")
        if dtype not in ("F32", "F16", "BF16", "F64"):
            raise bad(f"tensor {key!r} has dtype {dtype}, not a float type")
        if len(shape) != 2:
            raise bad(f"tensor {key!r} has shape {list(shape)}, not a matrix")
        pairs.setdefault((layer, module), {})[which] = shape
    if not pairs:
        raise bad(f"{WEIGHTS_FILE} holds no LoRA weights")
    r_default, alpha_default = cfg["r"], cfg["lora_alpha"]
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    modules: list[ModuleSpec] = []
    for (layer, module), ab in sorted(pairs.items()):
        name = f"model.layers.{layer}.{TARGETS[module][0]}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise bad(f"{name}: {missing} weight is missing")
        out_f, in_f = expected[module]
        (ra, ka), (nb, rb) = ab["A"], ab["B"]
        if ka != in_f or nb != out_f:
            raise bad(f"{name}: lora_A {list(ab['A'])} / lora_B {list(ab['B'])} do not fit the "
                      f"base model's {module} ({out_f} x {in_f}): base model mismatch")
        if ra != rb:
            raise bad(f"{name}: lora_A rank {ra} != lora_B rank {rb}")
        if ra > max_lora_rank:
            raise bad(f"{name}: rank {ra} is above max_lora_rank {max_lora_rank}")
        r = _pattern_value(rank_pattern, name, r_default)
        alpha = _pattern_value(alpha_pattern, name, alpha_default)
        if r != ra:
            raise bad(f"{name}: tensors have rank {ra} but the config says r={r}")
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules.append(ModuleSpec(layer, module, ra, float(scaling)))
    base = cfg.get("base_model_name_or_path")
    return AdapterSpec(path, weights_file, tuple(modules), max(m.rank for m in modules),
                       base if isinstance(base, str) else None)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}


def read_adapter(spec: AdapterSpec) -> dict[tuple[int, str], tuple[Tensor, Tensor, float]]:
    """The checked adapter's (layer, module) -> (A [r, in], B [out, r], scaling): views
    of the file mapped copy-on-write (any float dtype; the caller converts as it copies).
    A file changed since it was checked (other names or shapes) is a ValueError."""
    nbytes = os.path.getsize(spec.weights_file)
    data = torch.from_file(spec.weights_file, shared=False, size=nbytes, dtype=torch.uint8)
    try:
        (size,) = struct.unpack("<Q", data[:8].numpy().tobytes())
        header = json.loads(data[8:8 + size].numpy().tobytes())
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"LoRA adapter {spec.path!r}: {WEIGHTS_FILE} changed since it was "
                         f"checked: {exc}") from None
    base = 8 + size
    tensors: dict[tuple[int, str, str], Tensor] = {}
    typed: dict[torch.dtype, Tensor] = {}  # the whole mapping as each dtype met
    for key, info in header.items():
        m = _KEY.fullmatch(key)
        if m is None or not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            continue
        dtype = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if (len(shape) != 2 or end - start != math.prod(shape) * dtype.itemsize
                or base + end > nbytes or (base + start) % dtype.itemsize):
            raise ValueError(f"LoRA adapter {spec.path!r}: tensor {key!r} is malformed")
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = data[:nbytes // dtype.itemsize * dtype.itemsize].view(dtype)
        # One op per tensor (not slice + two views: ~1,300 ops an adapter).
        tensors[(int(m[1]), m[3], m[4])] = whole.as_strided(
            shape, (shape[1], 1), (base + start) // dtype.itemsize)
    out: dict[tuple[int, str], tuple[Tensor, Tensor, float]] = {}
    for mod in spec.modules:
        a = tensors.get((mod.layer, mod.module, "A"))
        b = tensors.get((mod.layer, mod.module, "B"))
        if a is None or b is None or a.shape[0] != mod.rank or b.shape[1] != mod.rank:
            raise ValueError(f"LoRA adapter {spec.path!r}: layer {mod.layer} {mod.module} "
                             "changed since the adapter was checked")
        out[(mod.layer, mod.module)] = (a, b, mod.scaling)
    return out
