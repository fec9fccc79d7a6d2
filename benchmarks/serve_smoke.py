"""Serving smoke benchmark: served tok/s and TTFT at a few concurrency levels.

Starts `roseinfer serve` on the default model (or uses --url), then for each
concurrency C runs C closed-loop streaming clients, each sending --requests-per-client
completions (fixed max_tokens, ignore_eos) and measures, from the client side:
time to first token (first SSE chunk with text), inter-token latency, and the
served generation throughput (completion tokens from `usage` / wall time).

    .venv/bin/python benchmarks/serve_smoke.py --concurrency 1 4 16
    .venv/bin/python benchmarks/serve_smoke.py --url http://127.0.0.1:8000 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

SUBJECTS = ["cats", "the ocean", "Paris", "music", "winter", "robots", "coffee", "trees",
            "the moon", "rivers", "bread", "chess", "rain", "birds", "Python", "history"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "roseinfer.cli", "serve", "--port", str(port), *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy")


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - start, "itl": itl, "tokens": tokens,
            "latency": time.perf_counter() - start}


async def run_level(url: str, concurrency: int, per_client: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(w: int) -> list[dict]:
            results = []
            for k in range(per_client):
                subject = SUBJECTS[(w * per_client + k) % len(SUBJECTS)]
                prompt = f"Client {w}, request {k}. Write a short story about {subject}:"
                results.append(await one_request(client, prompt, max_tokens))
            return results

        start = time.perf_counter()
        nested = await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    results = [r for rs in nested for r in rs]
    ttfts = [r["ttft"] for r in results]
    itls = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1
            else 1000 * ttfts[0],
            "itl_p50_ms": 1000 * statistics.median(itls) if itls else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="extra `roseinfer serve` arguments")
    ap.add_argument("--server-log", default="serve_smoke_server.log",
                    help="where the started server's output goes")
    args = ap.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.server_args.split(), args.server_log)
    try:
        asyncio.run(run_level(url, 2, 1, 8))  # warm the server up (not reported)
        print(f"{'conc':>4} {'reqs':>5} {'wall s':>7} {'tok/s':>7} {'TTFT p50 ms':>12} "
              f"{'TTFT p90 ms':>12} {'ITL p50 ms':>11}")
        for c in args.concurrency:
            r = asyncio.run(run_level(url, c, args.requests_per_client, args.max_tokens))
            print(f"{r['concurrency']:>4} {r['requests']:>5} {r['wall_s']:>7.1f} "
                  f"{r['tok_s']:>7.1f} {r['ttft_p50_ms']:>12.0f} {r['ttft_p90_ms']:>12.0f} "
                  f"{r['itl_p50_ms']:>11.1f}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
