"""Robustness on tiny random engines behind real uvicorn servers: auth, overload, body
limit, failing steps, disconnects before the first token, idle loop, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.request_stream import EngineStepError, PendingRequest
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.state import ServerSettings
from tests.server.helpers import free_port, stop_process, tiny_engine, tiny_server, wait_until

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def body(**kw) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **kw}


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def assert_pool_whole(engine) -> None:  # noqa: ANN001
    assert wait_until(lambda: engine.block_manager.num_free_blocks
                      == engine.block_manager.num_blocks, 2.0)


# ---------------------------------------------------------------- AsyncEngine
def test_launch_builds_and_steps_on_one_engine_thread() -> None:
    import threading

    seen: list[str] = []

    def build():  # noqa: ANN202
        seen.append(threading.current_thread().name)
        engine = tiny_engine()
        step = engine.step
        engine.step = lambda: seen.append(threading.current_thread().name) or step()
        return engine

    ae = AsyncEngine.launch(build)
    try:
        assert ae.healthy
        ae.start()  # already running: a no-op

        async def run() -> int:
            stream = ae.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                                ignore_eos=True))
            return len([o async for o in stream][-1].outputs[0].token_ids)

        assert asyncio.run(run()) == 3
        assert set(seen) == {"roseinfer-engine"} and len(seen) > 1
    finally:
        ae.shutdown()

    def broken():  # noqa: ANN202
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.launch(broken)


def test_async_engine_streams_and_idles_without_stepping() -> None:
    engine = tiny_engine()
    calls = []
    step = engine.step
    engine.step = lambda: calls.append(1) or step()
    ae = AsyncEngine(engine)
    ae.start()
    try:
        async def run() -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            stream = ae.add_request("a", PROMPT, params)
            outs = [o async for o in stream]
            return outs[-1].outputs[0].token_ids

        tokens = asyncio.run(run())
        assert len(tokens) == 6
        settled = len(calls)
        time.sleep(0.3)  # idle: the loop waits on its condition, it does not step
        assert len(calls) == settled
        assert ae.healthy and not engine.has_unfinished_requests()
    finally:
        ae.shutdown()
    assert not ae.healthy


def test_step_error_fails_in_flight_then_serves_again() -> None:
    with tiny_server() as ts:
        real = ts.gate._step
        fail = {"left": 1}

        def flaky():  # noqa: ANN202
            if fail["left"]:
                fail["left"] -= 1
                raise RuntimeError("boom")
            return real()

        ts.gate._step = flaky
        r = httpx.post(f"{ts.url}/v1/completions", json=body(), timeout=30)
        err = assert_openai_error(r, 500)
        assert "boom" in err["message"]
        fail["left"] = 1
        with httpx.stream("POST", f"{ts.url}/v1/completions", json=body(stream=True),
                          timeout=30) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert "boom" in json.loads(lines[0][6:])["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        ok = httpx.post(f"{ts.url}/v1/completions", json=body(), timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{ts.url}/health").status_code == 200
        assert_pool_whole(ts.engine)


def test_unrecoverable_engine_turns_health_503() -> None:
    with tiny_server() as ts:
        def broken() -> None:
            raise RuntimeError("device lost")

        ts.gate._step = broken
        ts.engine.abort_all = broken  # recovery fails too
        r = httpx.post(f"{ts.url}/v1/completions", json=body(), timeout=30)
        assert_openai_error(r, 500)
        assert wait_until(lambda: httpx.get(f"{ts.url}/health").status_code == 503, 5)
        again = httpx.post(f"{ts.url}/v1/completions", json=body(), timeout=30)
        assert_openai_error(again, 503)


def test_async_engine_error_reaches_stream() -> None:
    engine = tiny_engine()
    engine.step = lambda: (_ for _ in ()).throw(ValueError("bad step"))
    ae = AsyncEngine(engine)
    ae.start()
    try:
        async def run() -> None:
            params = SamplingParams(temperature=0, max_tokens=4)
            stream = ae.add_requests([PendingRequest("x", PROMPT, params)])
            with pytest.raises(EngineStepError, match="bad step"):
                async for _ in stream:
                    pass

        asyncio.run(run())
        assert ae.healthy
    finally:
        ae.shutdown()


# ----------------------------------------------------- auth, overload, size
def test_api_key_body_limit_and_queue_full() -> None:
    settings = ServerSettings(served_model_names=("tiny",), api_key="sekret",
                              max_body_bytes=2048)
    with tiny_server(settings, max_waiting_requests=2) as ts:
        client = openai.OpenAI(base_url=f"{ts.url}/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(f"{ts.url}/v1/completions", json=body(), headers=headers)
            assert_openai_error(r, 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{ts.url}/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(f"{ts.url}/health").status_code == 200  # probes stay open
        auth = {"Authorization": "Bearer sekret"}
        big = body(prompt=list(range(3, 250)) * 4)
        assert_openai_error(httpx.post(f"{ts.url}/v1/completions", json=big, headers=auth), 413)

        async def overload() -> list[int]:
            ts.gate.close()  # the engine thread stops inside its next step
            async with httpx.AsyncClient(base_url=ts.url, headers=auth, timeout=30) as c:
                first = asyncio.create_task(c.post("/v1/completions", json=body()))
                await asyncio.to_thread(ts.gate.entered.wait, 10)
                second = asyncio.create_task(c.post("/v1/completions", json=body()))
                await asyncio.sleep(0.3)
                third = await c.post("/v1/completions", json=body())
                assert_openai_error(third, 503)
                assert int(third.headers["Retry-After"]) >= 1
                ts.gate.open()
                return [(await t).status_code for t in (first, second)]

        assert asyncio.run(overload()) == [200, 200]
        r = httpx.post(f"{ts.url}/v1/completions", json=body(), headers=auth)
        assert r.status_code == 200
        assert_pool_whole(ts.engine)


def test_disconnect_while_waiting_aborts_before_any_token() -> None:
    with tiny_server() as ts:
        ts.gate.close()
        long = body(max_tokens=200, stream=True)
        with httpx.Client(timeout=10) as c, c.stream("POST", f"{ts.url}/v1/completions",
                                                     json=long) as s:
            assert s.status_code == 200
            assert ts.gate.entered.wait(10)  # queued and the loop is inside a step
        # The client is gone; once the server has queued the abort, let the engine run:
        # the abort lands right after the step it is blocked in.
        time.sleep(0.5)
        ts.gate.open()
        assert wait_until(lambda: ts.async_engine.stats().finished.get("abort") == 1, 2.0)
        assert ts.async_engine.stats().generation_tokens_total <= 1
        assert_pool_whole(ts.engine)
        # Non-streaming: the handler watches for the disconnect while it waits.
        ts.gate.close()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{ts.url}/v1/completions", json=body(max_tokens=200), timeout=0.5)
        time.sleep(0.5)
        ts.gate.open()
        assert wait_until(lambda: ts.async_engine.stats().finished.get("abort") == 2, 2.0)
        assert ts.async_engine.stats().generation_tokens_total <= 2
        assert_pool_whole(ts.engine)


# -------------------------------------------------------------------- SIGTERM
SERVE_TINY = """
import sys, time
sys.path.insert(0, {root!r})
from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server.cli import run_server
from roseinfer.server.state import ServerSettings
from tests.server.helpers import tiny_engine
engine = tiny_engine()
step = engine.step
engine.step = lambda: (time.sleep(0.05), step())[1]  # ~20 tokens/s: requests stay in flight
code = run_server(AsyncEngine(engine), ServerSettings(served_model_names=("tiny",)),
                  "127.0.0.1", {port}, graceful_timeout=20, log_level="warning")
print("EXIT", code, flush=True)
sys.exit(code)
"""


def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "serve_tiny.py"
    script.write_text(SERVE_TINY.format(root=root, port=port))
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        from tests.server.helpers import wait_healthy

        wait_healthy(url, proc, 120, log)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json=body(max_tokens=30, stream=True)) as s:
            lines = s.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert first and rest[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in [first, *rest[:-1]]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0, log.read_text()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        stop_process(proc)
