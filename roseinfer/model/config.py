"""ModelConfig: the architecture hyper-parameters every model file reads.

Built from a Hugging Face ``config.json`` dict (``from_hf_dict``, both the transformers
4.x layout — ``rope_scaling``, ``rope_theta`` — and 5.x's ``rope_parameters``) or from
GGUF metadata (see ``gguf_loader``).  Field names are ours; ``architecture`` keeps the
Hugging Face class name (``LlamaForCausalLM``, ``Gemma2ForCausalLM``...) so the
registry can pick the implementation.  Everything a family does differently that the
shared code must know is a field here (sliding window and per-layer attention types,
q/k norms, soft-capping, attention scale, partial rotary), read the way transformers
reads it for that family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from roseinfer.model.rope import check_rope_scaling, rope_type_of

# HF model_type -> architecture class name, for configs without "architectures".
MODEL_TYPE_ARCHITECTURES: MappingProxyType[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt2": "GPT2LMHeadModel",
})
LAYER_TYPES = ("full_attention", "sliding_attention")
_GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
          "Gemma3ForConditionalGeneration")
# Families whose transformers implementation honours config.sliding_window.
_WINDOWED = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
             "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' Gemma3TextConfig defaults: Gemma 3 4B+ text_config blocks omit most keys.
_GEMMA3_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType({
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True,
})


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
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict, if any (global layers)
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Keys a token may attend to in a sliding layer (None: no layer is windowed, or the
    # window never binds within max_position_embeddings).
    sliding_window: int | None = None
    # Per layer "full_attention" / "sliding_attention"; () = every layer alike (windowed
    # iff sliding_window is set).  Gemma 3's sliding layers also use rope_local_theta.
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False  # per-head norm of q and k before rotary (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # scale = this ** -0.5 (Gemma 2/3); None: head_dim
    attn_logit_softcapping: float | None = None  # tanh(s / cap) * cap on attention logits
    final_logit_softcapping: float | None = None  # same on the LM head's logits
    rope_local_theta: float | None = None  # rope base of sliding layers (Gemma 3)
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated (Phi-4-mini)

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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window!r}")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer "
                             f"({self.num_layers}), got {self.layer_types!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor!r} must give an "
                             f"even rotary dim in (0, head_dim]")
        check_rope_scaling(self.rope_scaling, self.rotary_dim)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotary rotates (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor + 1e-6)

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def uses_local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with ``rope_local_theta`` (Gemma 3's sliding layers)."""
        return (self.rope_local_theta is not None and bool(self.layer_types)
                and self.layer_types[layer] == "sliding_attention")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face config.json dict to a ModelConfig."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = archs[0] if archs else MODEL_TYPE_ARCHITECTURES.get(model_type, model_type or "unknown")
        supported = sorted(set(MODEL_TYPE_ARCHITECTURES.values()))
        if arch not in supported:
            raise ValueError(f"unsupported model architecture {arch!r} (config.json "
                             f"architectures / model_type); supported: {supported}")
        if isinstance(cfg.get("text_config"), dict):  # multimodal wrapper: its text model
            cfg = {**cfg, **cfg["text_config"]}
        if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            cfg = {**_GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
            if cfg.get("use_bidirectional_attention"):
                raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding "
                                 "model) is not a causal LM; it is not supported")
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
        num_layers = cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        rope_theta, rope_scaling, local_theta = _rope_fields(cfg)
        gemma = arch in _GEMMA
        gemma23 = gemma and arch != "GemmaForCausalLM"
        window, layer_types = _attention_layout(cfg, arch, num_layers, max_pos)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if gemma and act == "gelu":  # legacy Gemma value meant the tanh approximation
            act = "gelu_pytorch_tanh"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=max_pos,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2"
                                        or arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            hidden_act=act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_types=layer_types,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM",
                             "Gemma3ForConditionalGeneration"),
            query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar", 256)) if gemma23
                                   else None),
            attn_logit_softcapping=(_opt_float(cfg.get("attn_logit_softcapping", 50.0))
                                    if arch == "Gemma2ForCausalLM" else None),
            final_logit_softcapping=(_opt_float(cfg.get(
                "final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None))
                if gemma23 else None),
            rope_local_theta=(float(local_theta if local_theta is not None else 10000.0)
                              if gemma23 and arch != "Gemma2ForCausalLM" else None),
            partial_rotary_factor=float(_partial_rotary(cfg)),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _partial_rotary(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    if cfg.get("partial_rotary_factor") is not None:
        return float(cfg["partial_rotary_factor"])
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return 1.0


def _clean_scaling(params: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """An HF rope dict as our ``rope_scaling``: None for default rope, without the keys
    held elsewhere, with ``original_max_position_embeddings`` from the top level."""
    if rope_type_of(params) == "default":
        return None
    assert params is not None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("original_max_position_embeddings") is None and \
            cfg.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return scaling


def _rope_fields(cfg: dict[str, Any]) -> tuple[Any, dict[str, Any] | None, Any]:
    """(rope_theta, rope_scaling, local rope theta) from either config layout."""
    theta, scaling = cfg.get("rope_theta"), cfg.get("rope_scaling")
    local = cfg.get("rope_local_base_freq")
    params = cfg.get("rope_parameters")  # transformers >= 5 layout
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {}  # per layer type (Gemma 3)
        sliding = params.get("sliding_attention") or {}
        if rope_type_of(sliding) != "default":
            raise ValueError("rope_parameters.sliding_attention.rope_type "
                             f"{rope_type_of(sliding)!r} is not supported (only default)")
        theta = full.get("rope_theta", theta)
        local = sliding.get("rope_theta", local)
        if rope_type_of(full) != "default":
            scaling = full
    elif isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if rope_type_of(params) != "default":
            scaling = params
    return theta, _clean_scaling(scaling, cfg), local


def _attention_layout(cfg: dict[str, Any], arch: str, num_layers: int,
                      max_pos: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) the way transformers reads them for ``arch``."""
    window = cfg.get("sliding_window") if arch in _WINDOWED else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window"):
        window = None
    types = cfg.get("layer_types")
    if arch == "Gemma2ForCausalLM":
        types = types or ["sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(num_layers)]
    elif arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = types or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                          for i in range(num_layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and window is not None:
        first = cfg.get("max_window_layers", 28)
        types = types or ["sliding_attention" if i >= first else "full_attention"
                          for i in range(num_layers)]
    else:  # Mistral, Phi-3: every layer windowed (layer_types are not read)
        types = None
    if window is not None and int(window) >= max_pos:
        window = None  # never binds: every position is inside it
    return (None if window is None else int(window)), tuple(types or ())
