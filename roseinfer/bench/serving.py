"""Online serving load against any OpenAI-compatible ``/v1/completions`` endpoint.

For each concurrency C (closed loop: C clients, each sends its next request when
the previous one ends) or each Poisson request rate R (open loop), it streams
``--num-prompts`` completions (``ignore_eos``, fixed ``max_tokens``) and measures
on the client, with vLLM's definitions:

* TTFT: request sent -> first chunk with text;
* ITL: gaps between successive content chunks;
* TPOT: (latency - TTFT) / (output tokens - 1) per request;
* E2E latency, request throughput and output token throughput (usage tokens /
  wall time of the run).

Prints mean / p50 / p90 / p99, writes JSON, and draws a PNG (latency
distributions and throughput vs concurrency) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from roseinfer.bench.sse_client import HTTPStatusError, post_sse

_WORDS = ("time river light stone garden music window paper summer market letter forest "
          "engine silver quiet morning bridge story number castle winter ocean field "
          "table mirror school travel yellow answer family island garden thunder").split()


@dataclass
class RequestRecord:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def make_prompt(rng: random.Random, approx_tokens: int) -> str:
    """Random English words, about one token each for BPE tokenizers."""
    return " ".join(rng.choice(_WORDS) for _ in range(approx_tokens))


async def _one_request(url: str, model: str, prompt: str, max_tokens: int) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    rec = RequestRecord(ok=False)
    chunks = 0
    try:
        async for data in post_sse(f"{url}/v1/completions", body):
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            usage = event.get("usage")
            if usage:
                rec.output_tokens = int(usage.get("completion_tokens", 0))
            choices = event.get("choices") or []
            if not choices or not choices[0].get("text"):
                continue
            now = time.perf_counter()
            if last is None:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
            chunks += 1
    except (OSError, asyncio.IncompleteReadError, HTTPStatusError, ValueError) as exc:
        rec.error = repr(exc)
        return rec
    rec.latency = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks
    rec.ok = last is not None
    return rec


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


async def run_load(url: str, model: str, prompts: list[str], max_tokens: int,
                   concurrency: int | None, request_rate: float | None,
                   seed: int = 0) -> dict[str, Any]:
    """Run one load level; return its summary (and raw per-request figures)."""
    records: list[RequestRecord] = []
    start = time.perf_counter()
    if concurrency is not None:
        queue = list(prompts)

        async def worker() -> None:
            while queue:
                p = queue.pop()
                records.append(await _one_request(url, model, p, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        rng = random.Random(seed)
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_one_request(url, model, p, max_tokens)))
            if request_rate and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = list(await asyncio.gather(*tasks))
    wall = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "request_rate": request_rate,
        "num_requests": len(records), "num_ok": len(ok),
        "errors": [r.error for r in records if not r.ok][:5],
        "wall_s": wall, "request_throughput": len(ok) / wall,
        "output_token_throughput": out_tokens / wall,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _stats([g for r in ok for g in r.itl]),
        "e2e_s": _stats([r.latency for r in ok]),
        "raw": {"ttft": [r.ttft for r in ok], "itl": [g for r in ok for g in r.itl]},
    }


def format_summary(s: dict[str, Any]) -> str:
    level = (f"concurrency={s['concurrency']}" if s["concurrency"] is not None
             else f"rate={s['request_rate']}/s")
    lines = [f"{level}: {s['num_ok']}/{s['num_requests']} ok, "
             f"{s['request_throughput']:.2f} req/s, "
             f"{s['output_token_throughput']:.1f} output tok/s"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        st = s[key]
        lines.append(f"  {key[:-2].upper():<4} ms  mean {st['mean'] * 1e3:8.1f}  p50 "
                     f"{st['p50'] * 1e3:8.1f}  p90 {st['p90'] * 1e3:8.1f}  "
                     f"p99 {st['p99'] * 1e3:8.1f}")
    if s["errors"]:
        lines.append(f"  errors: {s['errors']}")
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], path: Path) -> bool:
    """Latency distributions and throughput vs load level; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        label = f"c={s['concurrency']}" if s["concurrency"] is not None else f"r={s['request_rate']}"
        for key, style in (("ttft", "-"), ("itl", "--")):
            vals = sorted(v * 1e3 for v in s["raw"][key])
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax1.plot(vals, ys, style, label=f"{key.upper()} {label}")
    ax1.set_xscale("log")
    ax1.set_xlabel("ms")
    ax1.set_ylabel("CDF")
    ax1.set_title("latency distribution (TTFT solid, ITL dashed)")
    ax1.legend(fontsize=7)
    xs = [s["concurrency"] if s["concurrency"] is not None else s["request_rate"]
          for s in summaries]
    ax2.plot(xs, [s["output_token_throughput"] for s in summaries], "o-", label="output tok/s")
    ax2.set_xlabel("concurrency" if summaries[0]["concurrency"] is not None else "request rate")
    ax2.set_ylabel("output tok/s")
    ax2b = ax2.twinx()
    ax2b.plot(xs, [s["ttft_s"]["p50"] * 1e3 for s in summaries], "s--", color="tab:red")
    ax2b.set_ylabel("p50 TTFT ms", color="tab:red")
    ax2.set_title("throughput vs load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--served-model", default=None, help="model name (default: /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None)
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="Poisson request rates per second (inf = all at once)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: 4 x concurrency, or 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="approximate prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/serving.json")
    p.add_argument("--plot", default="benchmarks/results/serving.png")


def _model_name(url: str) -> str:
    resp = httpx.get(f"{url}/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def main_from_args(args: argparse.Namespace) -> int:
    model = args.served_model or _model_name(args.url)
    levels: list[tuple[int | None, float | None]]
    if args.request_rate:
        levels = [(None, r) for r in args.request_rate]
    else:
        levels = [(c, None) for c in (args.concurrency or [1, 4, 16])]
    rng = random.Random(args.bench_seed)
    summaries = []
    asyncio.run(run_load(args.url, model, [make_prompt(rng, 8)], 4, 1, None))  # warm-up
    for conc, rate in levels:
        n = args.num_prompts or (4 * conc if conc else 64)
        prompts = [make_prompt(rng, args.prompt_len) for _ in range(n)]
        s = asyncio.run(run_load(args.url, model, prompts, args.max_tokens, conc, rate,
                                 args.bench_seed))
        print(format_summary(s), flush=True)
        summaries.append(s)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"url": args.url, "model": model, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens}
    out.write_text(json.dumps({"config": meta, "levels": summaries}, indent=2))
    print(f"wrote {out}")
    if plot(summaries, Path(args.plot)):
        print(f"wrote {args.plot}")
    else:
        print("matplotlib not installed: no plot (pip install matplotlib)")
    return 0
