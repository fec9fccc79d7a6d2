"""Failures of a tensor-parallel engine are fatal, prompt and clean: a killed worker or a
rank that raises mid-step fails the requests in bounded time, never hangs, leaves no
process behind, and turns a server's /health to 503."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from roseinfer.distributed.errors import TensorParallelError, WorkerDiedError
from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.fault_isolation import ModelFailedError
from roseinfer.llm import LLM
from roseinfer.server.app import create_app
from roseinfer.server.state import ServerSettings
from tests.distributed.helpers import PROMPTS, engine, greedy, save_llama, workers
from tests.server.helpers import Gate, ServerThread, wait_until

pytestmark = pytest.mark.timeout(120)
BOUND_S = 30.0  # a failure must surface within this


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


def _step_until_raises(eng, max_steps: int = 500) -> BaseException:  # noqa: ANN001
    for _ in range(max_steps):
        try:
            eng.step()
        except Exception as exc:  # noqa: BLE001 - the point
            return exc
    raise AssertionError("the engine kept stepping")


def test_killed_worker_fails_the_engine_at_once(llama: Path) -> None:
    eng = engine(llama)
    try:
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(f"r{i}", prompt, greedy(200))
        eng.step()
        eng.step()
        os.kill(eng.runner.pool.pids[0], signal.SIGKILL)
        start = time.monotonic()
        error = _step_until_raises(eng)
        assert time.monotonic() - start < BOUND_S
        assert isinstance(error, WorkerDiedError), error
        assert "rank 1" in str(error) and "exit code -9" in str(error)
        assert eng.failure is error
        with pytest.raises(WorkerDiedError):  # every later step, at once
            eng.step()
    finally:
        eng.shutdown()
        eng.shutdown()  # idempotent
    assert not workers()


def test_rank0_failing_mid_step_does_not_leave_workers_in_a_collective(llama: Path) -> None:
    """Rank 0 raises after layer 0's all-reduces, while rank 1 waits in layer 1's: the
    engine fails at once (not after the collective timeout) and the worker is stopped."""
    eng = engine(llama, distributed_timeout_s=20)
    layer = eng.runner.model.model.layers[1].mlp

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure")

    layer.forward = broken
    try:
        eng.add_request("r", PROMPTS[0], greedy(4))
        start = time.monotonic()
        error = _step_until_raises(eng)
        assert time.monotonic() - start < 10
        assert isinstance(error, TensorParallelError) and not isinstance(error, WorkerDiedError)
        assert "injected failure" in str(error)
        assert wait_until(lambda: not workers(), 10)
    finally:
        eng.shutdown()


def test_collected_engine_stops_its_workers(llama: Path) -> None:
    eng = engine(llama)
    assert len(workers()) == 1
    del eng
    gc.collect()
    assert wait_until(lambda: not workers(), 15)


def test_llm_context_manager_stops_its_workers(llama: Path) -> None:
    with LLM(str(llama), tensor_parallel_size=2, num_threads=1, quantization="none",
             weight_cache=False, num_kv_blocks=64, block_size=4) as llm:
        out = llm.generate([PROMPTS[0]], greedy(4))
        assert len(out[0].outputs[0].token_ids) == 4 and len(workers()) == 1
    assert not workers()


def test_server_health_turns_503_and_requests_fail(llama: Path) -> None:
    """A real server: the worker dies while a request is in flight (the engine thread is
    held at the step's door): /health turns 503 at once, the request ends with a 503
    naming the dead rank, new requests are refused; shutdown leaves no process."""
    eng = engine(llama)
    gate = Gate(eng)
    async_engine = AsyncEngine(eng)
    settings = ServerSettings(served_model_names=("tiny",))
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 100, "ignore_eos": True}
    result: dict[str, httpx.Response] = {}
    with ServerThread(create_app(async_engine, settings)) as server:
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        gate.close()

        def post() -> None:
            result["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        assert gate.entered.wait(20)
        os.kill(eng.runner.pool.pids[0], signal.SIGKILL)
        start = time.monotonic()
        assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code
                          == 503, BOUND_S)
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert "WorkerDiedError" in health["detail"]
        gate.open()
        thread.join(BOUND_S)
        assert time.monotonic() - start < BOUND_S
        response = result["r"]
        assert response.status_code == 503, response.text
        assert "tensor-parallel worker rank 1" in response.text
        assert isinstance(async_engine.dead_reason, ModelFailedError)
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert again.status_code == 503
    assert not workers()
