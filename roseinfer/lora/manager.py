"""LoRAManager: the engine's adapters — checked ones by id, at most ``max_loras``
resident (an LRU swapped in from disk), and the per-step ``LoRABatch``.

An adapter id is checked once (``check``: ``sources.check_adapter``, nothing loaded)
and then always means the same name and path.  ``make_resident`` loads it into a free
slot or in place of the least recently used resident adapter that no unfinished
request uses (``pinned``); it never evicts one in use, and says False when every slot
is.  Runs on the engine thread only (the engine calls it between steps).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from torch import nn

from roseinfer.lora.adapter import AdapterSpec
from roseinfer.lora.forward import BaseLinears, LoRABatch
from roseinfer.lora.request import LoRARequest
from roseinfer.lora.sources import check_adapter
from roseinfer.lora.weights import LoadedAdapter, build_adapter
from roseinfer.model.config import ModelConfig

logger = logging.getLogger("roseinfer.lora")


class LoRAManager:
    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int,
                 max_lora_rank: int, use_kernels: bool,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.device = device  # where the adapters' buffers live: the model's device
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.use_kernels = use_kernels
        self.base = BaseLinears(model)  # type: ignore[arg-type]
        self._checked: dict[int, tuple[LoRARequest, AdapterSpec]] = {}
        self.resident: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.num_loads = 0
        self.last_load_s = 0.0

    def check(self, lora: LoRARequest) -> AdapterSpec:
        """The checked adapter of ``lora`` (checked on first sight); ValueError naming
        the problem, or an id already used by another adapter."""
        known = self._checked.get(lora.lora_int_id)
        if known is not None:
            if (known[0].lora_name, known[0].lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"LoRA id {lora.lora_int_id} already names adapter "
                                 f"{known[0].lora_name!r} at {known[0].lora_path!r}")
            return known[1]
        spec = check_adapter(lora.lora_path, self.config, self.max_lora_rank)
        self._checked[lora.lora_int_id] = (lora, spec)
        return spec

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self.resident

    def make_resident(self, lora: LoRARequest, pinned: set[int]) -> bool:
        """Load ``lora`` unless resident (LRU order refreshed); False when every slot is
        held by an adapter in ``pinned``."""
        if lora.lora_int_id in self.resident:
            self.resident.move_to_end(lora.lora_int_id)
            return True
        spec = self.check(lora)
        reuse = None
        if len(self.resident) >= self.max_loras:
            victim = next((i for i in self.resident if i not in pinned), None)
            if victim is None:
                return False
            evicted = self.resident.pop(victim)
            reuse = evicted.buffer  # between steps: no LoRABatch refers to it any more
            logger.info("LoRA %r evicted for %r", evicted.name, lora.lora_name)
        start = time.perf_counter()
        self.resident[lora.lora_int_id] = build_adapter(
            lora.lora_int_id, lora.lora_name, spec, self.config, self.use_kernels, reuse,
            self.device)
        self.last_load_s = time.perf_counter() - start
        self.num_loads += 1
        logger.info("LoRA %r loaded in %.1f ms", lora.lora_name, self.last_load_s * 1e3)
        return True

    def forget(self, lora_int_id: int) -> None:
        """Drop a checked (and resident) adapter; the caller makes sure no unfinished
        request uses it."""
        self._checked.pop(lora_int_id, None)
        self.resident.pop(lora_int_id, None)

    def batch(self, row_ids: list[int]) -> LoRABatch | None:
        """The step's LoRABatch from each flat row's adapter id (0 = base), rows of one
        adapter in runs; None when no row has an adapter."""
        segments: list[tuple[int, int, LoadedAdapter]] = []
        start = 0
        for i in range(1, len(row_ids) + 1):
            if i == len(row_ids) or row_ids[i] != row_ids[start]:
                if row_ids[start]:
                    segments.append((start, i, self.resident[row_ids[start]]))
                start = i
        if not segments:
            return None
        step = None
        if self.use_kernels:  # the same segments for the C++ stack (csrc/lora.h)
            step = torch.classes.roseinfer.LoraStep(False)
            for start, end, adapter in segments:
                step.add(start, end, adapter.kernel)
        return LoRABatch(self.base, segments, step)
