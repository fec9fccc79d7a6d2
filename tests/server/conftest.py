"""Server fixtures: ONE real `roseinfer serve` process on the default model (session
scope) and ONE offline LLM for reference texts (session scope), loaded while the server
starts; per module, the tiny in-process server (`ts`, tokenizer_server.py) and an
OpenAI client on it (`client`), which a module needing other settings redefines."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from roseinfer.llm import LLM
from tests.server.helpers import (
    MODEL_NAME,
    STARTUP_TIMEOUT_S,
    ServerProcess,
    TinyServer,
    free_port,
    stop_process,
    wait_healthy,
)
from tests.server.tokenizer_server import tokenizer_server


@pytest.fixture(scope="session")
def server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Starts `roseinfer serve` on the default model (health is awaited by `server`).

    Weights in plain fp16 (not the int8 / bf16 mix that auto picks on CPU):
    the tests compare streams served in a batch with the same prompts alone, which
    holds exactly only when every batch size runs the same arithmetic.
    """
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    cmd = [sys.executable, "-m", "roseinfer.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME, "other-alias",
           "--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "512",
           "--num-threads", "1", "--log-stats-interval", "1", "--quantization", "fp16"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log)
    try:
        yield server
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def server(server_process: ServerProcess) -> ServerProcess:
    wait_healthy(server_process.url, server_process.proc, STARTUP_TIMEOUT_S, server_process.log)
    return server_process


@pytest.fixture(scope="session")
def offline_llm_session(server_process: ServerProcess) -> Any:
    """The offline engine for reference texts, loaded once (while the server starts) and
    shared by the modules that use ``offline_llm``: they only generate with it."""
    threads = torch.get_num_threads()
    try:
        return LLM(kv_cache_memory_gb=0.25, max_num_batched_tokens=512, num_threads=1,
                   quantization="fp16")
    finally:
        torch.set_num_threads(threads)  # the engine set 1: only offline_llm's modules use 1


@pytest.fixture(scope="module")
def offline_llm(offline_llm_session: Any) -> Iterator[Any]:
    """The shared offline engine, run with one torch thread in the module, like the server:
    on 2 shared cores, two OpenMP threads make batch-1 decode several times slower
    whenever another process wants the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield offline_llm_session
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ts() -> Iterator[TinyServer]:
    """The tiny random model with the default model's tokenizer behind a real uvicorn."""
    with tokenizer_server() as server:
        yield server


@pytest.fixture(scope="module")
def client(ts: TinyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ts.url}/v1", api_key="unused", max_retries=0, timeout=120)
