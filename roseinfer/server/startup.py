"""What a served engine needs before its first request, for ``roseinfer serve`` and for
each Ray Serve replica (``roseinfer.ray_serve.replica``) alike: the name clients call
the model by, and a warm-up generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from roseinfer.engine.stats import EngineStats
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.engine.engine import LLMEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_name(model: str | None) -> str:
    """The name a model is served under when none is given: its file's stem or folder."""
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix in (".gguf", ".pt", ".safetensors") else path.name


def warmup(engine: LLMEngine) -> None:
    """One short greedy generation so the first user request does not pay for it.

    Runs on the engine thread before it serves; the stats are reset afterwards.
    """
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("warmup", [(7 * j) % vocab for j in range(1, 20)], params)
    for _ in range(64):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    engine.abort_all()
    engine.stats = EngineStats(num_total_blocks=engine.block_manager.num_blocks)
