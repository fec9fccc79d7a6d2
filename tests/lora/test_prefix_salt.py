"""A LoRA request's prefix-cache salt: the same adapter files give the same 128-bit salt in
every process (the disk prefix cache names blocks by chains starting from it), another
id or other files another salt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from roseinfer.lora.request import LoRARequest


def _adapter(path: Path, payload: bytes) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(payload)
    return path


def test_salt_is_stable_across_processes_and_names_the_files(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", b"x" * 10)
    salt = LoRARequest("a", 1, str(a)).prefix_salt
    assert 0 <= salt < 1 << 128
    assert LoRARequest("renamed", 1, str(a)).prefix_salt == salt
    assert LoRARequest("a", 2, str(a)).prefix_salt != salt
    b = _adapter(tmp_path / "b", b"y" * 11)
    assert LoRARequest("a", 1, str(b)).prefix_salt != salt
    code = ("import sys; from roseinfer.lora.request import LoRARequest; "
            "print(LoRARequest('a', 1, sys.argv[1]).prefix_salt)")
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code, str(a)], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    assert int(out.stdout) == salt
