"""LoRARequest: which adapter a request runs with (vLLM's shape: name, id, path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter (it keys the
    resident slots and the prefix cache: the same id must always mean the same
    weights) and the directory (PEFT) or ``.gguf`` file it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty str, got {self.lora_path!r}")
