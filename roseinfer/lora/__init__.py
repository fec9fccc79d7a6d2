"""LoRA adapters served over one base model (issue #28, docs/lora.md).

``request`` names an adapter (``LoRARequest``); ``adapter`` reads and checks a PEFT
directory before anything reaches the engine; ``weights`` turns an adapter into the
per-layer low-rank kernels; ``manager`` keeps at most ``max_loras`` of them resident
(LRU, swapped in from disk); ``admission`` holds requests whose adapter is not resident
until a slot frees; ``forward`` runs a step whose rows use different adapters.
"""

from roseinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
