"""The CPU model and the SIMD flags that choose the kernels: the header every benchmark
figure carries (read from /proc/cpuinfo; nothing heavy imported, so ``roseinfer bench``'s
parser stays light)."""

from __future__ import annotations

from pathlib import Path

_SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
               "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``"<model name>: avx2 fma ..."``: the SIMD flags kernels choose from (``?`` when
    /proc/cpuinfo cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "?"
    name, flags = "?", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "?":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return f"{name}: " + " ".join(f for f in _SIMD_FLAGS if f in flags)
