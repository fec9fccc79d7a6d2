"""EngineConfig: every engine option in one frozen, validated dataclass."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roseinfer.speculative_config import SpeculativeConfig

_DTYPES = ("float32", "bfloat16", "float16")
_KV_DTYPES = (*_DTYPES, "int8")
_QUANTIZATIONS = ("auto", "none", "fp16", "fp16+bf16", "int8", "q8_0", "q4_0")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF dir, .gguf or .pt; None = bundled SmolLM2-135M-Instruct
    dtype: str = "float32"  # compute / KV-cache dtype
    device: str = "cpu"  # "cpu", "cuda", "cuda:0", or "auto"
    # Weight format (docs/performance.md, has the quality gate of each):
    #   "none": exact fp32;  "fp16": fp16 weights, fp32 math (fbgemm);
    #   "fp16+bf16": fp16 for GEMMs under 32 rows plus a bf16 copy for larger ones
    #     (prefill chunks, big decode batches: 2x the rate on AVX512-BF16 CPUs);
    #   "int8": plus Q8_0-like int8 weights for 1-2 row decode steps (half the bytes);
    #     it includes the bf16 copy where the CPU has AVX512-BF16 / AMX;
    #   "auto" (the default): int8 for float32 models on CPU - the fastest at every batch
    #     size, top-1 agreement with fp32 98.6% / perplexity +0.1% on 1-2 row steps,
    #     fp16-exact elsewhere - and "none" on other devices;
    #   "q8_0": "int8", except that F16 / BF16 matrices of a GGUF are requantized to Q8_0
    #     at load (logged) instead of kept as stored: 1.06 bytes per weight instead of 2,
    #     the speed of the path before issue #24 (docs/performance.md);
    #   "q4_0": "int8", except that float weights (an HF or .pt checkpoint's, a GGUF's
    #     F32 / F16 / BF16 matrices) but the LM head are quantized to GGUF Q4_0 at load
    #     (0.56 bytes per weight; llama.cpp's quantizer, bit for bit; lossy: docs/performance.md).
    quantization: str | None = "auto"
    # KV cache element type: "auto" (the default) = float16 when the weights are fp16 on
    # CPU (half the attention bytes; llama.cpp's default too), else the model dtype; or
    # one of float32 / bfloat16 / float16 explicitly; or "int8" (opt-in): K/V as int8
    # with a float32 scale per token and KV head, ~1.9x the tokens per GiB of float16
    # (docs/kv-cache.md, int8 KV cache).
    kv_cache_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block
    # KV pool budget in GiB (ignored when num_kv_blocks is set).  None (the default):
    # kv_cache_memory_fraction of the memory available after the weights, capped by what
    # max_num_seqs x max_model_len tokens can use (roseinfer/runner/kv_pool.py; logged).
    kv_cache_memory_gb: float | None = None
    kv_cache_memory_fraction: float = 0.5
    num_kv_blocks: int | None = None  # explicit KV pool size in blocks
    # GiB of the KV pool's next blocks a background thread backs with memory ahead of the
    # engine's first writes, while the engine is idle (CPU, Linux 5.14+; 0 = off: each
    # block's pages are backed when first written, which on a fresh pool cost the served
    # workload 5-14% on a VM: roseinfer/runner/kv_backing.py).
    kv_cache_prefault_gb: float = 1.0
    max_num_seqs: int = 64  # most requests in one step
    # Token budget of one step (= prefill chunk size).  256 keeps a step with a prefill
    # chunk near 0.25 s on 2 cores, so new requests start (TTFT) and running ones advance
    # (ITL) promptly; prefill GEMMs are as efficient at 256 rows as at 1024.
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    enable_prefix_caching: bool = True
    # Persistent prefix cache (docs/kv-cache.md): full KV blocks kept in this directory
    # (written when evicted from memory and when the engine is idle or shuts down, read
    # on a prefix-cache miss in memory), shared by processes; None = off.  Its size bound
    # in bytes (an int, or text like "2G", "500M"): the oldest blocks are deleted.
    kv_cache_dir: str | None = None
    kv_cache_dir_size: int | str = "8G"
    num_threads: int | None = None  # torch threads; default = usable cores
    seed: int = 0  # seed of the RNG used by unseeded sampled requests
    # Speculative decoding (n-gram prompt lookup), off when None. vLLM's dict (or JSON
    # text, or a SpeculativeConfig): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": N, "prompt_lookup_min": n}; always a SpeculativeConfig after
    # construction (roseinfer/speculative_config.py).
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    # Weight cache (docs/performance.md, Startup): keep the converted weights (and a GGUF's converted
    # tokenizer) under $ROSEINFER_CACHE_DIR (~/.cache/roseinfer) so later starts skip the
    # conversion. None = on unless $ROSEINFER_WEIGHT_CACHE=0; False = off.
    weight_cache: bool | None = None
    # Tensor parallelism (docs/scaling-out.md, Tensor parallel; roseinfer/distributed): the model's
    # heads, MLP channels and vocabulary split over this many processes (rank 0 = this
    # one, ranks 1.. spawned), gloo on CPU, NCCL on CUDA (cuda:<index + rank>).
    tensor_parallel_size: int = 1
    # Rendezvous of the ranks: None = 127.0.0.1 on a free port; or "tcp://host:port"
    # (rank 0 listens there; ranks on other hosts join it: distributed_local_workers).
    distributed_init_method: str | None = None
    # Bound on one collective: a rank that does not answer in time fails the engine.
    distributed_timeout_s: float = 60.0
    # Worker ranks this process starts itself (ranks 1..k); the others (k+1..N-1) join
    # from other hosts with `roseinfer tp-worker --distributed-init-method tcp://HOST:PORT
    # --rank R`. None = every worker rank here.
    distributed_local_workers: int | None = None
    # LoRA adapters (docs/lora.md): requests may name a PEFT adapter (LoRARequest); at
    # most max_loras are resident at once (LRU, loaded from disk), each of rank <=
    # max_lora_rank. Llama-family models, tensor_parallel_size 1.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        quant = self.quantization
        if quant is not None and quant not in _QUANTIZATIONS:
            raise ValueError(
                f"EngineConfig.quantization must be None or one of {_QUANTIZATIONS}, got {quant!r}"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be 'auto' or one of {_KV_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(
                f"EngineConfig.kv_cache_memory_gb must be None or > 0, got "
                f"{self.kv_cache_memory_gb!r}"
            )
        if not self.kv_cache_prefault_gb >= 0:
            raise ValueError("EngineConfig.kv_cache_prefault_gb must be >= 0, got "
                             f"{self.kv_cache_prefault_gb!r}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("EngineConfig.kv_cache_memory_fraction must be in (0, 1], got "
                             f"{self.kv_cache_memory_fraction!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads!r}")
        if self.weight_cache not in (None, True, False):
            raise ValueError(f"EngineConfig.weight_cache must be None or a bool, got "
                             f"{self.weight_cache!r}")
        self._check_distributed()
        self._check_kv_cache_dir()
        self._check_lora()
        # Normalised once, at construction: validated, and a dict never kept.
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.coerce(self.speculative_config))

    def _check_kv_cache_dir(self) -> None:
        object.__setattr__(self, "kv_cache_dir_size", parse_size(self.kv_cache_dir_size,
                                                                 "EngineConfig.kv_cache_dir_size"))
        if self.kv_cache_dir is None:
            return
        if not isinstance(self.kv_cache_dir, (str, os.PathLike)) or not str(self.kv_cache_dir):
            raise ValueError(f"EngineConfig.kv_cache_dir must be a directory path, got "
                             f"{self.kv_cache_dir!r}")
        object.__setattr__(self, "kv_cache_dir", os.fspath(self.kv_cache_dir))
        if not self.enable_prefix_caching:
            raise ValueError("EngineConfig.kv_cache_dir needs enable_prefix_caching (blocks are "
                             "found on disk by their prefix hash)")
        if self.tensor_parallel_size != 1:
            raise ValueError("EngineConfig.kv_cache_dir needs tensor_parallel_size 1 (each rank "
                             "holds part of every block)")

    def _check_distributed(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be an int >= 1, got {size!r}")
        if self.quantization == "q4_0" and size > 1:
            raise ValueError("EngineConfig.quantization 'q4_0' is not supported with "
                             "tensor_parallel_size > 1")
        method = self.distributed_init_method
        if method is not None:
            parse_init_method(method)  # ValueError naming the field
        local = self.distributed_local_workers
        if local is not None and (not isinstance(local, int) or isinstance(local, bool)
                                  or not 0 <= local <= size - 1):
            raise ValueError("EngineConfig.distributed_local_workers must be None or an int in "
                             f"[0, tensor_parallel_size - 1 = {size - 1}], got {local!r}")
        if local is not None and local < size - 1 and method is None:
            raise ValueError("EngineConfig.distributed_init_method is required when ranks join "
                             "from other hosts (distributed_local_workers < "
                             "tensor_parallel_size - 1): they need rank 0's address")
        timeout = self.distributed_timeout_s
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not 0 < timeout <= 86400):
            raise ValueError("EngineConfig.distributed_timeout_s must be a number of seconds "
                             f"in (0, 86400], got {timeout!r}")

    def _check_lora(self) -> None:
        if self.enable_lora not in (True, False):
            raise ValueError(f"EngineConfig.enable_lora must be a bool, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("EngineConfig.enable_lora is not supported with "
                             "tensor_parallel_size > 1")

    def resolved_quantization(self, device_type: str) -> str:
        """The weight format actually used on a device of this type ("cpu", "cuda")."""
        if self.quantization in (None, "none"):
            return "none"
        if self.quantization == "auto":
            return "int8" if device_type == "cpu" and self.dtype == "float32" else "none"
        if self.quantization == "q8_0":
            return "int8"
        return self.quantization

    def requantize_16bit_gguf(self) -> bool:
        """F16 / BF16 GGUF matrices are requantized at load: to Q8_0 ("q8_0"), or to
        Q4_0 but the LM head ("q4_0")."""
        return self.quantization in ("q8_0", "q4_0")

    def resolved_kv_cache_dtype(self, device_type: str) -> str:
        """The KV cache element type actually used on a device of this type."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "float16" if self.resolved_quantization(device_type) != "none" else self.dtype

    def resolved_num_threads(self) -> int:
        """Torch threads of each process: ``num_threads``, else the usable cores shared
        by the ``tensor_parallel_size`` ranks (at least 1 each)."""
        if self.num_threads is not None:
            return self.num_threads
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            cores = os.cpu_count() or 1
        return max(1, cores // self.tensor_parallel_size)


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or text: "1048576", "512M", "2G", "1.5GiB" (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        text = value.strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
        try:
            n = int(float(text[:len(text) - len(unit)]) * _SIZE_UNITS[unit])
        except ValueError:
            raise ValueError(f"{name} must be bytes or text like '2G', got {value!r}") from None
    else:
        raise ValueError(f"{name} must be bytes or text like '2G', got {value!r}")
    if n < 1:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return n


def parse_init_method(method: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://host:port`` rendezvous address; ValueError otherwise."""
    from urllib.parse import urlsplit

    why = "EngineConfig.distributed_init_method must be 'tcp://host:port'"
    if not isinstance(method, str):
        raise ValueError(f"{why}, got {method!r}")
    try:
        parts = urlsplit(method)
        port = parts.port
    except ValueError:
        raise ValueError(f"{why}, got {method!r}") from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"{why}, got {method!r}")
    return parts.hostname, port
