"""roseinfer: a small LLM inference engine and OpenAI-compatible server on PyTorch.

The public names are imported lazily so that ``import roseinfer.engine.x`` does not
pull in the model, tokenizer and server stacks.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roseinfer.config import EngineConfig
    from roseinfer.llm import LLM
    from roseinfer.outputs import CompletionOutput, RequestOutput
    from roseinfer.sampling_params import SamplingParams
    from roseinfer.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"

_LOCATIONS = {
    "LLM": "roseinfer.llm",
    "EngineConfig": "roseinfer.config",
    "SamplingParams": "roseinfer.sampling_params",
    "RequestOutput": "roseinfer.outputs",
    "CompletionOutput": "roseinfer.outputs",
    "StructuredOutputsParams": "roseinfer.structured_outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        return getattr(import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'roseinfer' has no attribute {name!r}")
