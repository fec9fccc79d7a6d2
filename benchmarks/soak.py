"""Soak test: N minutes of mixed load with random disconnects against `roseinfer serve`.

Closed loop: ``--concurrency`` clients, each sends its next request when the previous
one ends. Requests mix ``/v1/chat/completions`` and ``/v1/completions``, streaming and
not, n=1 or 2, random prompt and output lengths; a ``--disconnect-fraction`` of them
hang up on purpose (almost at once, after a random delay, or after a few SSE events).
Per time window it prints requests served, errors by kind (HTTP status / exception
type), disconnects and p50 / p99 end-to-end latency and TTFT; it samples the server's
RSS (``VmRSS`` from ``/proc/<pid>/status``) at start, after warm-up, every window and
at the end, and reports the growth after warm-up (goal: flat within 5%). Afterwards it
checks that the engine is idle with its whole KV pool free. Results go to ``--out``.

    # its own server (the pid is known):
    .venv/bin/python benchmarks/soak.py --minutes 10 \\
        --serve-args "--num-threads 2 --quantization fp16 --max-waiting-requests 64"
    # a running server:
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid 1234

``--hostile-rounds R`` compares normal load alone with normal load beside a hostile
mix (``roseinfer.bench.hostile``: never-reading streams, slow-header connections,
requests with a rebinding Host header): after the warm-up, 2R interleaved phases of
``--phase-s`` seconds (ABBA order); it reports the normal streams' TTFT p50/p99 per
phase and the median over each condition's phases::

    .venv/bin/python benchmarks/soak.py --hostile-rounds 3 --phase-s 40 \\
        --concurrency 8 --stream-fraction 1 --disconnect-fraction 0 \\
        --serve-args "--num-threads 2 --stream-stall-timeout 10 --request-timeout 10"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from roseinfer.bench.hostile import HostileMix, HostileOptions, compare_phases, run_phases
from roseinfer.bench.server_process import start_server, stop_server, wait_healthy
from roseinfer.bench.serving import make_prompt
from roseinfer.bench.sse_client import HTTPStatusError, post_sse

REQUEST_TIMEOUT_S = 180.0


@dataclass
class Record:
    kind: str  # chat|cmpl / stream|json
    start: float  # seconds since the load began
    end: float = 0.0
    outcome: str = "ok"  # ok | disconnect | an error kind
    latency: float | None = None
    ttft: float | None = None


@dataclass
class Soak:
    url: str
    model: str
    args: argparse.Namespace
    pid: int | None
    t0: float = 0.0
    deadline: float = 0.0
    records: list[Record] = field(default_factory=list)
    rss: dict[str, int | None] = field(default_factory=dict)
    rss_series: list[tuple[float, int | None]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    reported_until: float = 0.0  # seconds since t0 covered by emitted windows
    hostile: dict[str, Any] = field(default_factory=dict)  # --hostile-rounds results


# ---------------------------------------------------------------- measurement
def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.outcome == "ok"]
    lat = [r.latency for r in ok if r.latency is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    errors = Counter(r.outcome for r in records if r.outcome not in ("ok", "disconnect"))
    return {"served": len(ok), "disconnects": sum(r.outcome == "disconnect" for r in records),
            "errors": dict(errors), "e2e_p50_s": pct(lat, 50), "e2e_p99_s": pct(lat, 99),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99)}


def fmt_s(value: float | None) -> str:
    return "   -  " if value is None else f"{value:6.2f}"


def fmt_mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f} MiB"


# ---------------------------------------------------------------- requests
def make_body(rng: random.Random, args: argparse.Namespace, model: str,
              chat: bool, stream: bool) -> dict[str, Any]:
    prompt = make_prompt(rng, rng.randint(*args.prompt_words))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*args.max_tokens),
                            "n": 2 if rng.random() < 0.2 else 1, "stream": stream,
                            "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, HTTPStatusError):
        return str(exc).split(":", 1)[0]  # "HTTP 503"
    return type(exc).__name__


async def run_stream(url: str, body: dict[str, Any], rec: Record, t_start: float,
                     hang_events: int | None) -> None:
    events = 0
    done = False
    finished = 0
    gen = post_sse(url, body)
    try:
        async for data in gen:
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                rec.outcome = f"SSE error: {event['error'].get('code')}"
                continue
            for choice in event.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and rec.ttft is None:
                    rec.ttft = time.monotonic() - t_start
                finished += choice.get("finish_reason") is not None
            events += 1
            if hang_events is not None and events >= hang_events:
                rec.outcome = "disconnect"
                return
    finally:
        await gen.aclose()
    if rec.outcome == "ok" and not done:
        rec.outcome = "stream without [DONE]"
    elif rec.outcome == "ok" and finished != body["n"]:
        rec.outcome = "missing finish_reason"


async def run_json(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                   rec: Record) -> None:
    r = await client.post(url, json=body)
    if r.status_code != 200:
        rec.outcome = f"HTTP {r.status_code}"
        return
    choices = r.json().get("choices") or []
    if len(choices) != body["n"] or any(c.get("finish_reason") is None for c in choices):
        rec.outcome = "missing finish_reason"


async def one_request(soak: Soak, client: httpx.AsyncClient, rng: random.Random) -> Record:
    args = soak.args
    chat, stream = rng.random() < 0.5, rng.random() < args.stream_fraction
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = make_body(rng, args, soak.model, chat, stream)
    t_start = time.monotonic()
    rec = Record(f"{'chat' if chat else 'cmpl'}/{'stream' if stream else 'json'}",
                 t_start - soak.t0)
    hang_delay, hang_events = None, None
    if rng.random() < args.disconnect_fraction:
        mode = rng.random()
        if mode < 1 / 3:
            hang_delay = rng.uniform(0.0, 0.02)  # about when the request is sent
        elif mode < 2 / 3 or not stream:
            hang_delay = rng.uniform(0.05, 4.0)
        else:
            hang_events = rng.randint(1, 8)
    if stream:
        work = run_stream(f"{soak.url}{path}", body, rec, t_start, hang_events)
    else:
        work = run_json(client, f"{soak.url}{path}", body, rec)
    task = asyncio.ensure_future(work)
    try:
        limit = REQUEST_TIMEOUT_S if hang_delay is None else hang_delay
        done, _ = await asyncio.wait({task}, timeout=limit)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            rec.outcome = "disconnect" if hang_delay is not None else "client timeout"
        else:
            task.result()
    except Exception as exc:  # every failure is counted by kind, none stops the soak
        rec.outcome = error_kind(exc)
    rec.end = time.monotonic() - soak.t0
    if rec.outcome == "ok":
        rec.latency = time.monotonic() - t_start
    return rec


async def client_loop(soak: Soak, client: httpx.AsyncClient, wid: int) -> None:
    rng = random.Random(soak.args.seed * 100_003 + wid)
    while time.monotonic() < soak.deadline:
        soak.records.append(await one_request(soak, client, rng))


def emit_window(soak: Soak, lo: float, hi: float) -> None:
    """Print and keep the summary of requests that ended in [lo, hi), with an RSS sample."""
    s = summarize([r for r in soak.records if lo <= r.end < hi])
    rss = rss_kib(soak.pid)
    soak.rss_series.append((hi, rss))
    soak.windows.append({"t_start_s": lo, "t_end_s": hi, "rss_kib": rss, **s})
    errs = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"
    print(f"[{lo:6.0f}-{hi:6.0f}s] served {s['served']:5d}  disconnects "
          f"{s['disconnects']:4d}  e2e p50/p99 {fmt_s(s['e2e_p50_s'])}/"
          f"{fmt_s(s['e2e_p99_s'])} s  TTFT p50/p99 {fmt_s(s['ttft_p50_s'])}/"
          f"{fmt_s(s['ttft_p99_s'])} s  RSS {fmt_mib(rss)}  errors: {errs}", flush=True)


async def reporter(soak: Soak) -> None:
    """Emit a window every ``--window-s`` seconds; sample RSS once warm-up is over."""
    window = soak.args.window_s
    warm_at = soak.t0 + soak.args.warmup_minutes * 60
    while True:
        lo = soak.reported_until
        next_end = soak.t0 + lo + window
        if soak.rss.get("after_warmup") is None and warm_at < next_end:
            await asyncio.sleep(max(0.0, warm_at - time.monotonic()))
            soak.rss["after_warmup"] = rss_kib(soak.pid)
        await asyncio.sleep(max(0.0, next_end - time.monotonic()))
        emit_window(soak, lo, lo + window)
        soak.reported_until = lo + window


async def run_soak(soak: Soak) -> None:
    args = soak.args
    soak.rss["start"] = rss_kib(soak.pid)
    soak.t0 = time.monotonic()
    soak.deadline = soak.t0 + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        report = asyncio.ensure_future(reporter(soak))
        mix = HostileMix(soak.url, soak.model, HostileOptions(
            stalled=args.stalled, slow_headers=args.slow_headers))
        phases = asyncio.ensure_future(run_phases(
            mix, args.hostile_rounds, args.phase_s, soak.t0, args.warmup_minutes * 60)
        ) if args.hostile_rounds else None
        await asyncio.gather(*(client_loop(soak, client, w) for w in range(args.concurrency)))
        report.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await report
        if phases is not None:
            ttfts = [(r.start, r.ttft) for r in soak.records if r.ttft is not None]
            soak.hostile = {**compare_phases(await phases, ttfts),
                            "hostile_clients": mix.stats.summary()}
    # The last (partial) window: up to the deadline and the requests still in flight then.
    last = max((r.end for r in soak.records), default=0.0)
    if last >= soak.reported_until:
        emit_window(soak, soak.reported_until, last + 1e-6)


# ---------------------------------------------------------------- server
def engine_gauges(url: str) -> dict[str, float]:
    wanted = ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks",
              "kv_cache_total_blocks", "num_preemptions_total")
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("roseinfer:")
        if not line.startswith("#") and name in wanted:
            out[name] = float(line.rsplit(" ", 1)[1])
        elif not line.startswith("#") and name == "stream_aborts_total":
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[f"stream_aborts_{reason}"] = float(line.rsplit(" ", 1)[1])
    return out


def settle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Gauges once the engine is idle with its pool whole (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        g = engine_gauges(url)
        idle = (g.get("num_requests_running") == 0 and g.get("num_requests_waiting") == 0
                and g.get("kv_cache_free_blocks") == g.get("kv_cache_total_blocks"))
        if idle or time.monotonic() > deadline:
            return {**g, "idle_and_pool_whole": float(idle)}
        time.sleep(0.5)


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (else start one)")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS (with --url)")
    p.add_argument("--serve-args", default="--num-threads 1 --quantization fp16",
                   help="extra `roseinfer serve` arguments when starting one")
    p.add_argument("--server-log", default="benchmarks/results/soak_server.log")
    p.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=1.0,
                   help="RSS growth is measured from this point")
    p.add_argument("--window-s", type=float, default=60.0, help="report window")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-fraction", type=float, default=0.5)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--hostile-rounds", type=int, default=0,
                   help="A/B rounds of normal load alone vs beside the hostile mix (0: off)")
    p.add_argument("--phase-s", type=float, default=40.0, help="length of each A/B phase")
    p.add_argument("--stalled", type=int, default=2, help="never-reading streams (hostile)")
    p.add_argument("--slow-headers", type=int, default=8,
                   help="slow-header connections (hostile)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(8, 96), metavar=("MIN", "MAX"))
    p.add_argument("--prompt-words", type=int, nargs=2, default=(4, 200),
                   metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/soak.json")
    args = p.parse_args(argv)
    if not 0 <= args.disconnect_fraction <= 1:
        p.error("--disconnect-fraction must be in [0, 1]")
    if args.hostile_rounds:  # the phases set the length
        args.minutes = args.warmup_minutes + 2 * args.hostile_rounds * args.phase_s / 60
    if args.warmup_minutes >= args.minutes:
        p.error("--warmup-minutes must be shorter than --minutes")
    return args


def report(soak: Soak, gauges: dict[str, float], exit_code: int | None) -> dict[str, Any]:
    total = summarize(soak.records)
    warm, end = soak.rss.get("after_warmup"), soak.rss.get("end")
    growth = None if not warm or not end else 100.0 * (end - warm) / warm
    print(f"\ntotal: {len(soak.records)} requests, served {total['served']}, disconnects "
          f"{total['disconnects']}, errors {total['errors'] or 'none'}")
    print(f"  e2e p50/p99 {fmt_s(total['e2e_p50_s'])}/{fmt_s(total['e2e_p99_s'])} s, TTFT "
          f"p50/p99 {fmt_s(total['ttft_p50_s'])}/{fmt_s(total['ttft_p99_s'])} s")
    verdict = "n/a" if growth is None else (
        f"{growth:+.2f}% ({'flat' if abs(growth) <= 5 else 'NOT flat'} within 5%)")
    print(f"  RSS start {fmt_mib(soak.rss.get('start'))}, after warm-up {fmt_mib(warm)}, "
          f"end {fmt_mib(end)}; growth after warm-up {verdict}")
    print(f"  engine after the load: {gauges}")
    for name in ("normal_only", "with_hostile"):
        if name in soak.hostile:
            h = soak.hostile[name]
            print(f"  {name}: normal streams' TTFT p50/p99 (median of {h['phases']} phases) "
                  f"{fmt_s(h['ttft_p50_s_median'])}/{fmt_s(h['ttft_p99_s_median'])} s")
    if soak.hostile:
        print(f"  hostile clients: {soak.hostile['hostile_clients']}")
    if exit_code is not None:
        print(f"  server exit code after SIGTERM: {exit_code}")
    return {"config": {**vars(soak.args), "url": soak.url, "model": soak.model, "server_pid": soak.pid},
            "total": total, "windows": soak.windows, "rss_kib": soak.rss,
            "rss_series": soak.rss_series, "rss_growth_after_warmup_pct": growth,
            "engine_after": gauges, "server_exit_code": exit_code, "hostile": soak.hostile,
            "requests": [asdict(r) for r in soak.records]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    url, pid = args.url, args.server_pid
    if url is None:
        proc, url = start_server(args.serve_args, Path(args.server_log))
        pid = proc.pid
    exit_code = None
    try:
        wait_healthy(url, proc, 300)
        model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        soak = Soak(url, model, args, pid)
        print(f"soak: {args.minutes} min, {args.concurrency} clients, disconnect fraction "
              f"{args.disconnect_fraction}, seed {args.seed}, server pid {pid}", flush=True)
        asyncio.run(run_soak(soak))
        gauges = settle(url)
        soak.rss["end"] = rss_kib(pid)
    finally:
        if proc is not None and proc.poll() is None:
            exit_code = stop_server(proc)
    result = report(soak, gauges, exit_code)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    ok = (not result["total"]["errors"].keys() - {"HTTP 503"}
          and gauges.get("idle_and_pool_whole") == 1.0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
