"""LoRA adapters over HTTP, as vLLM serves them: ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}``, ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``
(both behind the API key like every ``/v1`` route), adapters listed in ``/v1/models``
with ``parent`` = the base model, and a request picks one by its ``model`` name
(``resolve_model``: the OpenAI routes' only hook).  Mounted by ``install`` when the
engine has ``enable_lora``; the registry is ``app.state.lora``.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.lora.request import LoRARequest
from roseinfer.server.errors import APIError, bad_request
from roseinfer.server.lora_registry import (
    LoRANameError,
    LoRARegistry,
    LoRASettings,
    RuntimeLoadingDisabledError,
)
from roseinfer.server.responses import ModelCard
from roseinfer.server.state import get_state

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


def install(app: FastAPI, async_engine: AsyncEngine, settings: LoRASettings | None) -> None:
    """Register the startup adapters (ValueError on a bad one) and mount the routes,
    when the engine runs LoRA; otherwise ``app.state.lora`` is None."""
    engine = async_engine.engine
    app.state.lora = None
    if getattr(engine, "lora", None) is None:
        if settings is not None and settings.modules:
            raise ValueError("--lora-modules needs an engine with enable_lora")
        return
    served = frozenset(get_state_names(app))
    app.state.lora = LoRARegistry(settings or LoRASettings(), engine.model_config,
                                  engine.config.max_lora_rank, served)
    app.include_router(router)


def get_state_names(app: FastAPI) -> tuple[str, ...]:
    return app.state.server.settings.served_model_names


def _registry(request: Request) -> LoRARegistry:
    registry = getattr(request.app.state, "lora", None)
    if registry is None:
        raise APIError(404, "LoRA adapters are not enabled on this server", code="not_found")
    return registry


def resolve_model(request: Request, model: str | None) -> tuple[str, LoRARequest | None]:
    """The name to echo and the adapter a request's ``model`` names (None: the base
    model); 404 for a name that is neither."""
    registry = getattr(request.app.state, "lora", None)
    lora = registry.get(model) if registry is not None else None
    if lora is not None:
        return lora.lora_name, lora
    return get_state(request).check_model(model), None


def lora_model_cards(request: Request, max_model_len: int) -> list[ModelCard]:
    """``/v1/models`` entries of the registered adapters (empty without LoRA)."""
    registry = getattr(request.app.state, "lora", None)
    if registry is None:
        return []
    parent = get_state(request).model_name
    return [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent,
                      max_model_len=max_model_len) for lora in registry.adapters()]


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
    registry = _registry(request)
    try:
        lora = await run_in_threadpool(registry.add, body.lora_name, body.lora_path)
    except RuntimeLoadingDisabledError as exc:
        raise APIError(403, str(exc), type="permission_error", code="lora_loading_disabled") \
            from exc
    except ValueError as exc:
        name_error = isinstance(exc, LoRANameError)
        raise bad_request(str(exc), "lora_name" if name_error else "lora_path") from exc
    return f"Success: LoRA adapter '{lora.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
    if _registry(request).remove(body.lora_name) is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                       param="lora_name", code="not_found")
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
