"""GET /ui/api/snapshot and the UI routes on tiny engines behind real uvicorn servers:
the JSON shape, the API key (401 without it; the page and its files stay public),
invariants under load while threads hammer the endpoint, snapshots taken only on the
engine thread, the fallback during a long step, and --no-ui."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from roseinfer.engine import async_engine as async_engine_module
from roseinfer.server.state import ServerSettings
from tests.server.helpers import tiny_server, wait_until

UI = ServerSettings(served_model_names=("tiny",), ui=True)
SNAPSHOT = "/ui/api/snapshot"
NUM = (int, float)


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, **kw}


def check_shape(s: dict[str, Any]) -> None:
    """Every field of the snapshot, with its type, and the invariants between them."""
    assert set(s) == {"version", "model", "healthy", "age_s", "limits", "requests", "kv",
                      "tokens", "throughput", "latency", "prefix_cache", "in_flight",
                      "in_flight_total"}
    assert s["version"] == 1 and isinstance(s["model"], str)
    assert isinstance(s["healthy"], bool) and isinstance(s["age_s"], NUM) and s["age_s"] >= 0
    limits = s["limits"]
    assert set(limits) == {"block_size", "max_num_seqs", "max_num_batched_tokens",
                           "max_model_len", "prefix_caching", "kv_cache_dtype", "quantization"}
    named = ("prefix_caching", "kv_cache_dtype", "quantization")
    assert all(isinstance(limits[k], int) and limits[k] > 0 for k in limits
               if k not in named) and isinstance(limits["prefix_caching"], bool)
    assert limits["kv_cache_dtype"] in ("float32", "bfloat16", "float16", "int8")
    assert limits["quantization"] in ("none", "fp16", "fp16+bf16", "int8", "q4_0")
    req = s["requests"]
    assert set(req) == {"running", "waiting", "preempted", "finished"}
    assert all(isinstance(req[k], int) and req[k] >= 0 for k in ("running", "waiting",
                                                                 "preempted"))
    assert req["preempted"] <= req["waiting"]
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in req["finished"].items())
    kv = s["kv"]
    assert set(kv) == {"total", "used", "cached", "free", "usage", "map", "blocks_per_cell"}
    assert kv["used"] + kv["cached"] + kv["free"] == kv["total"] > 0
    assert min(kv["used"], kv["cached"], kv["free"]) >= 0
    assert kv["usage"] == pytest.approx(kv["used"] / kv["total"])
    assert isinstance(kv["map"], str) and set(kv["map"]) <= {"u", "c", "."}
    assert kv["blocks_per_cell"] == 1 and len(kv["map"]) == kv["total"]  # small pools
    assert (kv["map"].count("u"), kv["map"].count("c")) == (kv["used"], kv["cached"])
    tokens = s["tokens"]
    assert set(tokens) == {"prompt_total", "generation_total", "computed_total",
                           "preemptions_total"}
    assert all(isinstance(v, int) and v >= 0 for v in tokens.values())
    tp = s["throughput"]
    assert set(tp) == {"interval_s", "prefill_tok_s", "decode_tok_s", "prefill_now",
                       "decode_now"}
    assert tp["interval_s"] == 1 and len(tp["prefill_tok_s"]) == len(tp["decode_tok_s"]) == 300
    assert all(isinstance(v, int) and v >= 0 for v in tp["prefill_tok_s"] + tp["decode_tok_s"])
    assert isinstance(tp["prefill_now"], NUM) and isinstance(tp["decode_now"], NUM)
    lat = s["latency"]
    assert set(lat) == {"window_s", "ttft", "itl"} and lat["window_s"] > 0
    for kind in ("ttft", "itl"):
        stats = lat[kind]
        assert set(stats) == {"count", "p50", "p90", "p99"} and isinstance(stats["count"], int)
        values = [stats["p50"], stats["p90"], stats["p99"]]
        if stats["count"]:
            assert all(isinstance(v, float) and v >= 0 for v in values) and values == sorted(values)
        else:
            assert values == [None, None, None]
    pc = s["prefix_cache"]
    assert set(pc) == {"queries", "hits", "hit_rate"} and 0 <= pc["hits"] <= pc["queries"]
    assert 0.0 <= pc["hit_rate"] <= 1.0
    assert s["in_flight_total"] == req["running"] + req["waiting"] == len(s["in_flight"])
    states = []
    for row in s["in_flight"]:
        assert set(row) == {"id", "group_id", "state", "prompt_tokens", "output_tokens",
                            "computed_tokens", "cached_tokens", "blocks", "age_s",
                            "preemptions", "max_tokens"}
        assert isinstance(row["id"], str) and isinstance(row["group_id"], str)
        assert row["state"] in {"prefill", "decode", "waiting", "preempted"}
        assert all(isinstance(row[k], int) and row[k] >= 0 for k in (
            "prompt_tokens", "output_tokens", "computed_tokens", "cached_tokens", "blocks",
            "preemptions", "max_tokens"))
        assert row["computed_tokens"] <= row["prompt_tokens"] + row["output_tokens"]
        assert row["output_tokens"] <= row["max_tokens"]
        assert row["blocks"] * limits["block_size"] >= row["computed_tokens"]
        assert isinstance(row["age_s"], NUM) and row["age_s"] >= 0
        states.append(row["state"])
    running_states = states[:req["running"]]
    assert all(st in ("prefill", "decode") for st in running_states)
    assert states.count("preempted") == req["preempted"]
    assert sum(row["blocks"] for row in s["in_flight"]) >= kv["used"]  # shared prefixes
    if not s["in_flight"]:
        assert kv["used"] == 0


def test_shape_idle_and_after_requests() -> None:
    with tiny_server(UI, num_kv_blocks=64) as ts:
        s = httpx.get(ts.url + SNAPSHOT).json()
        check_shape(s)
        assert (s["model"], s["healthy"], s["kv"]["total"]) == ("tiny", True, 64)
        assert s["tokens"]["generation_total"] == 0 and s["latency"]["ttft"]["count"] == 0
        for _ in range(2):  # the second shares the first's prompt blocks
            assert httpx.post(ts.url + "/v1/completions", json=completion(),
                              timeout=30).status_code == 200
        s = httpx.get(ts.url + SNAPSHOT).json()
        check_shape(s)
        assert s["tokens"]["generation_total"] == 16 and s["requests"]["finished"] == {
            "length": 2}
        assert s["latency"]["ttft"]["count"] == 2 and s["latency"]["itl"]["count"] == 14
        assert s["prefix_cache"]["hits"] > 0 and s["kv"]["cached"] > 0
        assert sum(s["throughput"]["decode_tok_s"]) + sum(s["throughput"]["prefill_tok_s"]) \
            <= s["tokens"]["computed_total"]


def test_api_key_guards_the_snapshot_not_the_page() -> None:
    settings = ServerSettings(served_model_names=("tiny",), api_key="sekret", ui=True)
    with tiny_server(settings) as ts:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(ts.url + SNAPSHOT, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(ts.url + SNAPSHOT, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.headers["cache-control"] == "no-store"
        check_shape(ok.json())
        page = httpx.get(ts.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        js = httpx.get(ts.url + "/ui/static/app.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith(
            "text/javascript")
        assert js.headers["x-content-type-options"] == "nosniff"
        again = httpx.get(ts.url + "/ui/static/app.js", headers={"If-None-Match":
                                                                 js.headers["etag"]})
        assert again.status_code == 304
        assert httpx.get(ts.url + "/ui/static/nothing.js").status_code == 404
        # a path that only looks like a static file is not public
        with httpx.Client(base_url=ts.url) as c:
            sneaky = c.get("/ui/static/..%2Fapi%2Fsnapshot")
        assert sneaky.status_code in (401, 404) and "kv" not in sneaky.text
        assert httpx.get(ts.url + "/v1/models").status_code == 401  # the API stays closed
        assert httpx.get(ts.url + "/health").status_code == 200


def test_no_ui_serves_nothing_new() -> None:
    with tiny_server(ServerSettings(served_model_names=("tiny",))) as ts:
        for path in ("/", "/ui/static/app.js", SNAPSHOT):
            r = httpx.get(ts.url + path)
            assert r.status_code == 404 and set(r.json()) == {"error"}
    keyed = ServerSettings(served_model_names=("tiny",), api_key="k")
    with tiny_server(keyed) as ts:  # without the UI, / is not public
        assert httpx.get(ts.url + "/").status_code == 401


def test_cli_flag() -> None:
    from roseinfer.cli import build_parser

    assert build_parser().parse_args(["serve"]).ui is True
    assert build_parser().parse_args(["serve", "--no-ui"]).ui is False


def test_hammered_under_load_taken_only_on_the_engine_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[str] = set()
    real = async_engine_module.take_snapshot

    def recording(*args: Any, **kw: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(async_engine_module, "take_snapshot", recording)
    # 40 blocks of 4 tokens: 12 requests of up to 48 tokens each force preemptions.
    with tiny_server(UI, num_kv_blocks=40, max_num_batched_tokens=64) as ts:
        done = threading.Event()
        seen: list[dict[str, Any]] = []

        def load(i: int) -> None:
            prompt = [3, 4, 5, 6, 7, 8, 9, 10] + [11 + i] * (4 + i % 5)  # a shared prefix
            with httpx.Client(base_url=ts.url, timeout=60) as c:
                for j in range(3):
                    if (i + j) % 4 == 3:  # a client that hangs up mid-stream
                        with c.stream("POST", "/v1/completions", json=completion(
                                prompt=prompt, max_tokens=30, stream=True)) as r:
                            next(r.iter_lines())
                        continue
                    r = c.post("/v1/completions", json=completion(prompt=prompt,
                                                                  max_tokens=24 + j * 4))
                    assert r.status_code == 200, r.text

        def hammer() -> int:
            n = 0
            with httpx.Client(base_url=ts.url, timeout=30) as c:
                while not done.is_set():
                    r = c.get(SNAPSHOT)
                    assert r.status_code == 200, r.text
                    s = r.json()
                    check_shape(s)
                    seen.append(s)
                    n += 1
            return n

        with ThreadPoolExecutor(16) as pool:
            hammers = [pool.submit(hammer) for _ in range(4)]
            loads = [pool.submit(load, i) for i in range(12)]
            for f in loads:
                f.result()
            done.set()
            counts = [f.result() for f in hammers]
        assert min(counts) > 3, counts
        assert max(s["requests"]["running"] for s in seen) > 1
        assert any(s["kv"]["used"] > 0 for s in seen)
        assert any(s["requests"]["preempted"] > 0 or s["tokens"]["preemptions_total"] > 0
                   for s in seen)
        totals = [s["tokens"]["generation_total"] for s in seen]
        assert max(totals) > 0
        assert wait_until(lambda: _idle(httpx.get(ts.url + SNAPSHOT).json()), 5.0)
        final = httpx.get(ts.url + SNAPSHOT).json()
        check_shape(final)
        finished = final["requests"]["finished"]
        assert sum(finished.values()) == 36 and finished.get("abort", 0) <= 9, finished
        assert final["latency"]["ttft"]["count"] > 0
    assert threads == {"roseinfer-engine"}, threads


def _idle(s: dict[str, Any]) -> bool:
    return s["requests"]["running"] == s["requests"]["waiting"] == s["kv"]["used"] == 0


def test_long_step_gives_the_previous_snapshot_then_a_fresh_one() -> None:
    with tiny_server(UI) as ts:
        first = httpx.get(ts.url + SNAPSHOT).json()
        assert first["in_flight"] == []
        ts.gate.close()  # the engine thread will block inside its next step
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, ts.url + "/v1/completions", json=completion(),
                                  timeout=30)
            assert ts.gate.entered.wait(10)
            t0 = time.monotonic()
            stale = httpx.get(ts.url + SNAPSHOT, timeout=30).json()
            assert time.monotonic() - t0 >= 1.5  # waited for the engine, then fell back
            assert stale["in_flight"] == [] and stale["age_s"] >= 1.5
            ts.gate.open()
            assert pending.result().status_code == 200
        fresh = httpx.get(ts.url + SNAPSHOT).json()
        assert fresh["age_s"] < 1.0 and fresh["tokens"]["generation_total"] == 8


def test_stopped_engine_reports_unhealthy_with_its_last_snapshot() -> None:
    with tiny_server(UI) as ts:
        assert httpx.get(ts.url + SNAPSHOT).json()["healthy"] is True
        ts.async_engine.shutdown()
        r = httpx.get(ts.url + SNAPSHOT)
        assert r.status_code == 200 and r.json()["healthy"] is False
    with tiny_server(UI) as ts:  # never snapshotted before it stopped: 503
        ts.async_engine.shutdown()
        r = httpx.get(ts.url + SNAPSHOT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
