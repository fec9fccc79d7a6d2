"""ModelConfig: the architecture hyper-parameters every model file reads.

Built from a Hugging Face ``config.json`` dict (``from_hf_dict``) or from GGUF
metadata (see ``gguf_loader``). Field names are ours; ``architecture`` keeps the
Hugging Face class name (``LlamaForCausalLM``, ``GPT2LMHeadModel``...) so the
registry can pick the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict, if any
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face config.json dict to a ModelConfig."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        if archs:
            arch = archs[0]
        else:
            arch = {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "gpt2": "GPT2LMHeadModel",
            }.get(model_type, model_type or "unknown")
        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...]
        if eos is None:
            eos_ids = ()
        elif isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        if model_type == "gpt2" or arch == "GPT2LMHeadModel":
            hidden = cfg["n_embd"]
            heads = cfg["n_head"]
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                num_layers=cfg["n_layer"],
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=cfg.get("n_positions", 1024),
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                attention_bias=True,
                tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                hidden_act=cfg.get("activation_function", "gelu_new"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if isinstance(rope_scaling, dict) and rope_scaling.get(
            "rope_type", rope_scaling.get("type", "default")
        ) == "default":
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2"
                                        or arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
