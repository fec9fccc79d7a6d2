"""Turn LoRA on for an engine: check the model, build the manager, attach it to the
runner (which then lays out each step's adapter segments) and return the admission
queue the engine feeds."""

from __future__ import annotations

import torch

from roseinfer.config import EngineConfig
from roseinfer.lora.admission import LoRAAdmission
from roseinfer.lora.forward import lora_unsupported_reason
from roseinfer.lora.manager import LoRAManager
from roseinfer.model.config import ModelConfig
from roseinfer.runner.model_runner import ModelRunner


def setup_lora(config: EngineConfig, runner: object, model_config: ModelConfig,
               device: torch.device, dtype: torch.dtype) -> LoRAAdmission:
    """ValueError when the runner's model cannot run adapters."""
    if not isinstance(runner, ModelRunner):
        raise ValueError("enable_lora needs the single-process runner (tensor_parallel_size 1)")
    reason = lora_unsupported_reason(runner.model)
    if reason is not None:
        raise ValueError(f"enable_lora is not supported for this model: {reason}")
    from roseinfer.kernels import cpu_kernels_available

    use_kernels = device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()
    manager = LoRAManager(runner.model, model_config, config.max_loras, config.max_lora_rank,
                          use_kernels, device)
    runner.lora = manager
    return LoRAAdmission(manager)
