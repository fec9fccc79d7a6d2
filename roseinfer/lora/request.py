"""LoRARequest: which adapter a request runs with (vLLM's shape: name, id, path)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from roseinfer.model.cache_key import source_fingerprint


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

    @cached_property
    def prefix_salt(self) -> int:
        """The parent hash of a request's first KV block (128 bits): the same for the same
        adapter files in every process (its id, resolved path and the files' sizes and
        modification times, as the weight cache names files), so prefix-cache blocks, in
        memory or on disk, are shared only by requests of the same adapter weights. An
        adapter whose files cannot be read gets a random salt: shared with nobody."""
        try:
            path = Path(self.lora_path).resolve()
            identity = json.dumps({"id": self.lora_int_id, "path": str(path),
                                   "files": source_fingerprint(path)}, sort_keys=True)
        except (OSError, ValueError):
            identity = os.urandom(16).hex()
        digest = hashlib.blake2b(b"lora\0" + identity.encode(), digest_size=16).digest()
        return int.from_bytes(digest, "little")
