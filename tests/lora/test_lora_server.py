"""LoRA over HTTP (issue #28) through a real uvicorn on 127.0.0.1 and the openai client:
adapters in /v1/models with their parent, a request picks one by ``model``, run-time
load / unload behind the API key with paths confined to --lora-dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.app import create_app
from roseinfer.server.lora_registry import (
    LoRARegistry,
    LoRASettings,
    RuntimeLoadingDisabledError,
)
from roseinfer.server.state import ServerSettings
from tests.engine.invariance_helpers import make_engine, tiny_gqa_llama
from tests.lora.lora_helpers import make_adapter, run_jobs
from tests.server.helpers import ServerThread

BASE = "tiny-base"
KEY = "lora-test-key"
PROMPT = [5, 77, 300, 12, 9, 41, 250, 3]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("lora_dir")
    for i, name in enumerate(("a1", "a2", "a3"), start=1):
        make_adapter(root / name, seed=10 + i, r=8)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    engine = make_engine(tiny_gqa_llama(0), "none", enable_lora=True, max_loras=2,
                         num_kv_blocks=256)
    from roseinfer.lora import LoRARequest

    want = {}
    for name in ("base", "a1", "a2"):
        lora = None if name == "base" else LoRARequest(name, 900 + len(want), str(root / name))
        want[name] = run_jobs(engine, [(name, PROMPT, MAX_TOKENS, lora)])[0][name]
    assert len({tuple(t) for t in want.values()}) == 3, "adapters should change the tokens"
    lora_settings = LoRASettings(modules=(("sql", str(root / "a1")),), lora_dir=str(root))
    app = create_app(AsyncEngine(engine), ServerSettings(served_model_names=(BASE,), api_key=KEY),
                     lora_settings)
    with ServerThread(app) as st:
        client = openai.OpenAI(base_url=f"{st.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        yield {"client": client, "url": st.url, "want": want, "root": root}


def _tokens(client: openai.OpenAI, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0, logprobs=0)
    return [int(t) for t in out.choices[0].logprobs.tokens]


def _post(client: openai.OpenAI, path: str, body: dict) -> httpx.Response:
    return client.post(path, cast_to=httpx.Response, body=body)


def test_models_list_adapters_with_parent(server) -> None:  # noqa: ANN001
    cards = {m.id: m.model_dump() for m in server["client"].models.list().data}
    assert cards[BASE].get("parent") is None
    assert cards["sql"]["parent"] == BASE
    assert cards["sql"]["root"] == str(server["root"] / "a1")


def test_request_picks_adapter_by_model_name(server) -> None:  # noqa: ANN001
    client = server["client"]
    assert _tokens(client, "sql") == server["want"]["a1"]
    assert _tokens(client, BASE) == server["want"]["base"]


def test_load_use_unload(server) -> None:  # noqa: ANN001
    client = server["client"]
    reply = _post(client, "/load_lora_adapter", {"lora_name": "tuned", "lora_path": "a2"})
    assert reply.status_code == 200 and "tuned" in reply.text
    assert "tuned" in {m.id for m in client.models.list().data}
    assert _tokens(client, "tuned") == server["want"]["a2"]
    reply = _post(client, "/unload_lora_adapter", {"lora_name": "tuned"})
    assert reply.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "tuned")
    with pytest.raises(openai.NotFoundError):
        _post(client, "/unload_lora_adapter", {"lora_name": "tuned"})
    assert "tuned" not in {m.id for m in client.models.list().data}


@pytest.mark.parametrize(("body", "message"), [
    ({"lora_name": "x", "lora_path": "../outside"}, "outside the LoRA directory"),
    ({"lora_name": "x", "lora_path": "/etc"}, "outside the LoRA directory"),
    ({"lora_name": "x", "lora_path": "broken"}, "missing adapter_model.safetensors"),
    ({"lora_name": "x", "lora_path": "nothing-here"}, "no such directory"),
    ({"lora_name": "sql", "lora_path": "a3"}, "already been loaded"),
    ({"lora_name": BASE, "lora_path": "a3"}, "base model's name"),
])
def test_load_refusals(server, body: dict, message: str) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError, match=message):
        _post(server["client"], "/load_lora_adapter", body)


def test_lora_routes_need_the_api_key(server) -> None:  # noqa: ANN001
    anon = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        _post(anon, "/load_lora_adapter", {"lora_name": "y", "lora_path": "a3"})
    with pytest.raises(openai.AuthenticationError):
        _post(anon, "/unload_lora_adapter", {"lora_name": "sql"})


def test_runtime_paths_refused_without_lora_dir(server, tmp_path: Path) -> None:  # noqa: ANN001
    """No --lora-dir and no --allow-any-lora-path: run-time loading is refused (403 on
    the server); the flag allows any readable path."""
    from roseinfer.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(tiny_gqa_llama(0).config.to_dict())
    path = str(server["root"] / "a3")
    closed = LoRARegistry(LoRASettings(), cfg, 64, frozenset({BASE}))
    with pytest.raises(RuntimeLoadingDisabledError, match="--lora-dir"):
        closed.add("z", path)
    opened = LoRARegistry(LoRASettings(allow_any_path=True), cfg, 64, frozenset({BASE}))
    assert opened.add("z", path).lora_path == path


def test_serve_lora_flags() -> None:
    from roseinfer.cli import build_parser, engine_config_from_args
    from roseinfer.server.cli import lora_engine_config, parse_lora_modules

    args = build_parser().parse_args(["serve", "--lora-modules", "sql=/a/sql", "chat=/a/c=2",
                                      "--max-loras", "2", "--max-lora-rank", "32"])
    assert parse_lora_modules(args.lora_modules) == (("sql", "/a/sql"), ("chat", "/a/c=2"))
    config = lora_engine_config(engine_config_from_args(args), args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 32)
    plain = build_parser().parse_args(["serve"])
    assert not lora_engine_config(engine_config_from_args(plain), plain).enable_lora
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["just-a-path"])
