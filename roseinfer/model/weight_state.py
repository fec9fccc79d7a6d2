"""A converted model's weights as one flat dict of tensors, and the model built back.

What the engine runs after loading and ``quantize_model`` is fully described by:

* ``param/<name>``: every remaining parameter (embeddings, norms, and with
  ``quantization="none"`` the linear weights too), in the model dtype;
* ``linear/<path>/<key>``: for each converted layer (``quantize.linear_paths``; the LM
  head is ``lm_head`` even when tied) the record ``quantize.convert_linear`` made:
  ``qweight`` int8 [N, K] + ``scales`` fp32 [N, K/32] (int8 weights, as
  ``kernels.quantize_int8_blocks`` produced them), or ``weight``; plus ``bias``.

``model_state`` takes that dict from a converted model; ``model_from_state`` builds the
same model from it on the meta device, assigning the tensors (no copy: memory-mapped
ones stay mapped) and rebuilding each layer from its record, so the result computes
bitwise what the original did.  Derived buffers (rotary caches) are recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from roseinfer.model.config import ModelConfig
from roseinfer.model.half_embedding import match_stored_embeddings
from roseinfer.model.quantize import apply_linear_records
from roseinfer.model.registry import create_meta_model, materialize, reset_buffers

PARAM_PREFIX = "param/"
LINEAR_PREFIX = "linear/"


class StateMismatchError(ValueError):
    """A state dict does not fit the model (names, shapes or dtypes differ)."""


def model_state(model: nn.Module, records: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    """The flat state of a loaded, converted model (``records`` from ``quantize_model``;
    empty for ``quantization="none"``).  Tensors are shared, not copied."""
    state = {PARAM_PREFIX + name: p.detach() for name, p in model.named_parameters()}
    for path, record in records.items():
        for key, tensor in record.items():
            state[f"{LINEAR_PREFIX}{path}/{key}"] = tensor
    return state


def _split(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    params: dict[str, Tensor] = {}
    records: dict[str, dict[str, Tensor]] = {}
    for name, tensor in state.items():
        if name.startswith(PARAM_PREFIX):
            params[name.removeprefix(PARAM_PREFIX)] = tensor
        elif name.startswith(LINEAR_PREFIX):
            path, _, key = name.removeprefix(LINEAR_PREFIX).rpartition("/")
            records.setdefault(path, {})[key] = tensor
        else:
            raise StateMismatchError(f"unexpected entry {name!r}")
    return params, records


@torch.no_grad()
def model_from_state(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     state: dict[str, Tensor], quantization: str) -> nn.Module:
    """``config``'s model in eval mode with the weights of ``state`` (``model_state``'s
    layout for ``quantization``); ``StateMismatchError`` if they do not fit exactly."""
    params, records = _split(state)
    model = create_meta_model(config, dtype)
    if quantization != "none":
        try:
            apply_linear_records(model, quantization, records)
        except KeyError as exc:
            raise StateMismatchError(f"no stored layer {exc}") from exc
    elif records:
        raise StateMismatchError("stored converted layers for quantization 'none'")
    match_stored_embeddings(model, params, dtype)  # a 16-bit checkpoint's, kept 16-bit
    expected = dict(model.named_parameters())
    if set(expected) != set(params):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise StateMismatchError(f"parameters missing {missing[:3]}, unexpected {extra[:3]}")
    for name, meta in expected.items():
        tensor = params[name]
        if tensor.shape != meta.shape or tensor.dtype != meta.dtype:
            raise StateMismatchError(f"{name}: stored {tuple(tensor.shape)} {tensor.dtype}, "
                                     f"expected {tuple(meta.shape)} {meta.dtype}")
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._parameters[attr] = nn.Parameter(tensor.to(device), requires_grad=False)
    if any(t.is_meta for t in model.parameters()):
        raise StateMismatchError("a parameter was left without storage")
    materialize(model, device)  # derived buffers: storage, then recomputed
    reset_buffers(model)
    return model.eval()
