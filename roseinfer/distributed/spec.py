"""The worker spec: what rank 0 tells every worker, as a versioned JSON document.

Rank 0 writes it signed under ``tp/spec`` in its store (``auth.SignedStore``); every
worker - started by rank 0 or by hand on another host - reads it from there.  It is
plain data, parsed field by field (``WorkerSpec.from_json``): exactly the allowed keys,
each of its type and in its range, else a ``SpecError`` before anything is loaded or run.
The plan is not sent as objects: the worker makes it again from its own copy of the
checkpoint (``plan_for``) and checks that its shards are the ones rank 0 listed.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from roseinfer.distributed.plan import TensorParallelPlan, make_plan

SPEC_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = (*DTYPES, "int8")  # int8: roseinfer.model.kv_int8 (scales inside the rows)
QUANTIZATIONS = ("none", "fp16", "fp16+bf16", "int8")
MAX_RANKS = 256
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,3})?)$")


class SpecError(ValueError):
    """A worker spec that is not a valid document of this version."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs from rank 0 (``asdict`` is the JSON document)."""

    version: int
    model: str | None  # checkpoint path (None: the default model)
    size: int  # ranks in all
    shards: list[list[int]]  # per rank: [rank, q0, q1, kv0, kv1, i0, i1, v0, v1]
    host: str  # rank 0's store
    port: int
    dtype: str  # weights and activations
    device: str  # rank 0's device; rank r uses index + r on CUDA
    quantization: str  # resolved weight format
    kv_dtype: str
    block_size: int
    num_blocks: int
    num_threads: int
    timeout_s: float  # bound on each collective

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerSpec:
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpecError(f"the worker spec is not JSON: {exc}") from None
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Any) -> WorkerSpec:
        if not isinstance(doc, dict):
            raise SpecError(f"the worker spec must be a JSON object, got {type(doc).__name__}")
        if doc.get("version") != SPEC_VERSION:
            raise SpecError(f"worker spec version {doc.get('version')!r}, this worker reads "
                            f"version {SPEC_VERSION} (same roseinfer on every host?)")
        allowed = set(cls.__dataclass_fields__)
        if set(doc) != allowed:
            extra, missing = sorted(set(doc) - allowed), sorted(allowed - set(doc))
            raise SpecError(f"worker spec keys: unexpected {extra}, missing {missing}")
        size = _int(doc, "size", 2, MAX_RANKS)
        model = doc["model"]
        if model is not None and not (isinstance(model, str) and 0 < len(model) <= 4096
                                      and "\0" not in model):
            raise SpecError("worker spec 'model' must be null or a path string")
        host = doc["host"]
        if not (isinstance(host, str) and 0 < len(host) <= 255
                and re.fullmatch(r"[A-Za-z0-9.:_-]+", host)):
            raise SpecError(f"worker spec 'host' is not a host name or address: {host!r}")
        shards = doc["shards"]
        if not (isinstance(shards, list) and len(shards) == size
                and all(isinstance(s, list) and len(s) == 9 for s in shards)):
            raise SpecError(f"worker spec 'shards' must be {size} lists of 9 integers")
        for r, s in enumerate(shards):
            for v in s:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**40:
                    raise SpecError(f"worker spec 'shards'[{r}] holds {v!r}, not a range bound")
            if s[0] != r:
                raise SpecError(f"worker spec 'shards'[{r}] is for rank {s[0]}")
        device = doc["device"]
        if not (isinstance(device, str) and _DEVICE.match(device)):
            raise SpecError(f"worker spec 'device' must be cpu or cuda[:N], got {device!r}")
        timeout = doc["timeout_s"]
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not 0 < timeout <= 10**7):
            raise SpecError(f"worker spec 'timeout_s' must be in (0, 1e7], got {timeout!r}")
        return cls(
            version=SPEC_VERSION, model=model, size=size, shards=[list(s) for s in shards],
            host=host, port=_int(doc, "port", 1, 65535), dtype=_choice(doc, "dtype", DTYPES),
            device=device, quantization=_choice(doc, "quantization", QUANTIZATIONS),
            kv_dtype=_choice(doc, "kv_dtype", KV_DTYPES),
            block_size=_int(doc, "block_size", 1, 1 << 16),
            num_blocks=_int(doc, "num_blocks", 1, 1 << 31),
            num_threads=_int(doc, "num_threads", 1, 4096), timeout_s=float(timeout))

    @staticmethod
    def shard_rows(plan: TensorParallelPlan) -> list[list[int]]:
        return [[s.rank, *s.q_heads, *s.kv_heads, *s.inter, *s.vocab] for s in plan.shards]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)

    def check_rank(self, rank: int) -> None:
        if not 1 <= rank < self.size:
            raise ValueError(f"--rank must be in [1, {self.size - 1}] for this group of "
                             f"{self.size} ranks, got {rank}")


def plan_for(spec: WorkerSpec) -> TensorParallelPlan:
    """The plan, made again from this host's copy of the checkpoint; ``SpecError`` if it
    splits differently from rank 0's (another model under the same path)."""
    from roseinfer.model.loader import load_checkpoint

    plan = make_plan(load_checkpoint(spec.model).config, spec.size, spec.quantization)
    if WorkerSpec.shard_rows(plan) != spec.shards:
        raise SpecError(f"the checkpoint {spec.model or '(default model)'} on this host splits "
                        "differently from rank 0's: is it the same model?")
    return plan


def _int(doc: dict[str, Any], key: str, low: int, high: int) -> int:
    v = doc[key]
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise SpecError(f"worker spec {key!r} must be an integer in [{low}, {high}], got {v!r}")
    return v


def _choice(doc: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    v = doc[key]
    if v not in allowed:
        raise SpecError(f"worker spec {key!r} must be one of {allowed}, got {v!r}")
    return v
