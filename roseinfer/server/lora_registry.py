"""The server's LoRA adapters by model name (``--lora-modules``, ``/v1/load_lora_adapter``).

Each name maps to a ``LoRARequest`` with an id never reused, so a name loaded again
(even from the same path) is a new adapter to the engine and its prefix cache.  Every
adapter is checked (``roseinfer.lora.sources.check_adapter``: files, config, shapes,
rank; a PEFT directory or a GGUF LoRA file) before it is registered; a request then names it in ``model``.  Paths given at
run time are confined to ``lora_dir`` (relative ones are taken inside it; ``..`` and
symlinks leaving it are refused); without one they are refused unless
``allow_any_path`` (``--allow-any-lora-path``, as vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).  Startup modules are the operator's and not
confined.  Thread-safe: handlers call it from the event loop and the thread pool.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from roseinfer.lora.request import LoRARequest
from roseinfer.lora.sources import check_adapter
from roseinfer.model.config import ModelConfig

MAX_NAME_CHARS = 256


class RuntimeLoadingDisabledError(PermissionError):
    """Loading by path at run time is not enabled on this server."""


class LoRANameError(ValueError):
    """The adapter name cannot be registered (empty, too long, taken)."""


@dataclass(frozen=True)
class LoRASettings:
    modules: tuple[tuple[str, str], ...] = ()  # (name, path) registered at startup
    lora_dir: str | None = None  # run-time paths must lie inside it
    allow_any_path: bool = False  # run-time paths anywhere (no lora_dir)


class LoRARegistry:
    def __init__(self, settings: LoRASettings, model_config: ModelConfig, max_lora_rank: int,
                 reserved_names: frozenset[str]) -> None:
        self.settings = settings
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.reserved = reserved_names  # the base model's served names
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in settings.modules:
            self.add(name, path, startup=True)

    @property
    def runtime_loading(self) -> bool:
        return self.settings.lora_dir is not None or self.settings.allow_any_path

    def resolve_path(self, path: str, startup: bool = False) -> str:
        """The real path to read; ValueError outside ``lora_dir``,
        RuntimeLoadingDisabledError when run-time loading is off."""
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ValueError("lora_path must be a non-empty path")
        if startup:
            return os.path.realpath(path)
        root = self.settings.lora_dir
        if root is None:
            if not self.settings.allow_any_path:
                raise RuntimeLoadingDisabledError(
                    "loading LoRA adapters at run time is disabled: start the server with "
                    "--lora-dir DIR (adapters inside DIR) or --allow-any-lora-path")
            return os.path.realpath(path)
        real_root = os.path.realpath(root)
        real = os.path.realpath(os.path.join(real_root, path))
        if os.path.commonpath([real_root, real]) != real_root:
            raise ValueError(f"lora_path {path!r} is outside the LoRA directory (--lora-dir)")
        return real

    def add(self, name: str, path: str, startup: bool = False) -> LoRARequest:
        """Check and register adapter ``name`` at ``path``; ValueError naming the
        problem (a name in use, a bad adapter), RuntimeLoadingDisabledError."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise LoRANameError(f"lora_name must be 1 to {MAX_NAME_CHARS} characters")
        if name in self.reserved:
            raise LoRANameError(f"lora_name {name!r} is the base model's name")
        real = self.resolve_path(path, startup)
        with self._lock:
            if name in self._by_name:
                raise LoRANameError(f"The lora adapter '{name}' has already been loaded.")
        check_adapter(real, self.model_config, self.max_lora_rank)  # nothing loaded yet
        with self._lock:
            if name in self._by_name:
                raise LoRANameError(f"The lora adapter '{name}' has already been loaded.")
            lora = LoRARequest(name, self._next_id, real)
            self._next_id += 1
            self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        """Unregister ``name`` (None if unknown).  Requests already queued with it
        finish with it; new ones cannot name it."""
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        if not name:
            return None
        with self._lock:
            return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
