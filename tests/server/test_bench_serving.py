"""The serving benchmark's client against the real test server: every request streams,
the per-token timings add up, and errors are recorded, not raised."""

from __future__ import annotations

import asyncio
import random

import pytest

from roseinfer.bench.serving import make_prompt, run_load
from roseinfer.bench.sse_client import HTTPStatusError, post_sse
from tests.server.helpers import MODEL_NAME

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it


@pytest.mark.parametrize(("concurrency", "rate"), [(2, None), (None, float("inf"))])
def test_run_load_streams_every_request(server, concurrency, rate) -> None:
    prompts = [make_prompt(random.Random(i), 12) for i in range(4)]
    s = asyncio.run(run_load(server.url, MODEL_NAME, prompts, 5, concurrency, rate))
    assert s["num_requests"] == 4 and s["num_ok"] == 4 and not s["errors"]
    assert s["output_token_throughput"] > 0
    assert len(s["raw"]["ttft"]) == 4 and all(t > 0 for t in s["raw"]["ttft"])
    # 5 tokens each; a chunk may carry more than one token's text, never fewer chunks than 1
    assert 4 <= len(s["raw"]["itl"]) <= 16
    assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]


def test_run_load_records_http_errors(server) -> None:
    s = asyncio.run(run_load(server.url, "no-such-model", ["hello"], 4, 1, None))
    assert s["num_ok"] == 0 and "HTTP 404" in s["errors"][0]


def test_post_sse_yields_data_payloads_and_raises_on_status(server) -> None:
    async def collect(body: dict) -> list[bytes]:
        return [d async for d in post_sse(f"{server.v1}/completions", body)]

    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = asyncio.run(collect(body))
    assert events[-1] == b"[DONE]" and len(events) >= 3
    with pytest.raises(HTTPStatusError, match="HTTP 400"):
        asyncio.run(collect({**body, "max_tokens": -1}))
