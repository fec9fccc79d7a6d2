"""Served output tok/s of JSON-schema-constrained chat completions vs the same unconstrained.

Starts ``roseinfer serve`` on 127.0.0.1 (the default model, ``--serve-args``) or uses
``--url``. For each concurrency C, C closed-loop clients stream ``--requests`` chat
completions (greedy, fixed ``max_tokens``): realistic prompts that each ask for one JSON
object, sent once with ``response_format`` ``json_schema`` (the prompt's schema) and once
without. Output tok/s = completion tokens (from ``usage``) / wall time of the run.
Constrained and unconstrained runs alternate, their order flipping every round, for
``--rounds`` rounds; reported: the medians, the constrained / unconstrained ratio, the
completion tokens per request, and how many outputs parse as JSON and validate against
their schema (``jsonschema``). Requests finish on their own (EOS, or the JSON closing),
so the two sides do not make the same number of tokens: the ratio is what a client sees.

    .venv/bin/python benchmarks/structured_serving.py --concurrency 1 16 --rounds 3
    .venv/bin/python benchmarks/structured_serving.py --url http://127.0.0.1:8000 \\
        --concurrency 1 --rounds 1 --requests 2 --max-tokens 32   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from roseinfer.bench.server_process import start_server, stop_server, wait_healthy
from roseinfer.bench.sse_client import HTTPStatusError, post_sse

TEXT = {"type": "string", "minLength": 1, "maxLength": 40}
# (name, schema, prompt with a {} for the subject, subjects): realistic extraction asks.
TASKS: list[tuple[str, dict[str, Any], str, list[str]]] = [
    ("person", {"type": "object", "properties": {
        "name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": TEXT,
        "hobbies": {"type": "array", "items": TEXT, "maxItems": 3}},
        "required": ["name", "age", "occupation", "hobbies"], "additionalProperties": False},
     "Invent a person called {} and describe them as a JSON object with name, age, "
     "occupation and hobbies.", ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah"]),
    ("weather", {"type": "object", "properties": {
        "city": TEXT, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm", "fog"]},
        "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "temperature_c", "conditions", "humidity_pct"],
        "additionalProperties": False},
     "Give a plausible weather report for {} today as JSON with city, temperature_c, "
     "conditions and humidity_pct.", ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Delhi"]),
    ("order", {"type": "object", "properties": {
        "customer": TEXT,
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {
                "product": TEXT, "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                "unit_price": {"type": "number", "minimum": 0}},
            "required": ["product", "quantity", "unit_price"], "additionalProperties": False}},
        "express": {"type": "boolean"}},
        "required": ["customer", "items", "express"], "additionalProperties": False},
     "Write an example shop order for {} as JSON: customer, items (product, quantity, "
     "unit_price) and express.", ["a bakery", "a student", "a gardener", "a school"]),
    ("review", {"type": "object", "properties": {
        "title": TEXT, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": {
            "type": "string", "maxLength": 160}},
        "required": ["title", "year", "rating", "summary"], "additionalProperties": False},
     "Review the film {} in JSON with title, year, rating (1 to 5) and a one-sentence "
     "summary.", ["Casablanca", "Alien", "Amelie", "Up", "Heat", "Jaws"]),
]


@dataclass
class Result:
    ok: bool
    tokens: int = 0
    finish: str | None = None
    valid: bool = False  # the content parses as JSON and validates against its schema
    error: str = ""


def requests_for(n: int) -> list[tuple[str, dict[str, Any], str]]:
    """``n`` (task name, schema, prompt) triples, cycling over tasks and subjects."""
    out = []
    for i in range(n):
        name, schema, prompt, subjects = TASKS[i % len(TASKS)]
        out.append((name, schema, prompt.format(subjects[i // len(TASKS) % len(subjects)])))
    return out


def chat_body(model: str, prompt: str, schema: dict[str, Any] | None, name: str,
              max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": name, "schema": schema, "strict": True}}
    return body


async def one_request(url: str, body: dict[str, Any], schema: dict[str, Any]) -> Result:
    """Stream one chat completion; its usage tokens, finish reason and validity."""
    rec = Result(ok=False)
    content: list[str] = []
    try:
        async for data in post_sse(f"{url}/v1/chat/completions", body):
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if event.get("usage"):
                rec.tokens = int(event["usage"]["completion_tokens"])
            for choice in event.get("choices") or ():
                content.append((choice.get("delta") or {}).get("content") or "")
                rec.finish = choice.get("finish_reason") or rec.finish
    except (OSError, asyncio.IncompleteReadError, HTTPStatusError, ValueError) as exc:
        rec.error = repr(exc)
        return rec
    rec.ok = rec.finish is not None
    try:
        jsonschema.validate(json.loads("".join(content)), schema)
        rec.valid = True
    except (ValueError, jsonschema.ValidationError):
        pass
    return rec


async def run_level(url: str, model: str, concurrency: int, n: int, max_tokens: int,
                    constrained: bool) -> dict[str, Any]:
    """``n`` requests through ``concurrency`` closed-loop clients: one run's figures."""
    todo = requests_for(n)[::-1]
    results: list[Result] = []

    async def client() -> None:
        while todo:
            name, schema, prompt = todo.pop()
            body = chat_body(model, prompt, schema if constrained else None, name, max_tokens)
            results.append(await one_request(url, body, schema))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    return {"wall_s": wall, "requests": len(results), "ok": len(ok), "tokens": tokens,
            "tok_s": tokens / wall, "valid": sum(r.valid for r in ok),
            "stopped": sum(r.finish == "stop" for r in ok),
            "errors": [r.error for r in results if not r.ok][:3]}


def summarize(concurrency: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds, the ratio, tokens per request and validity counts."""
    row: dict[str, Any] = {"concurrency": concurrency}
    for side, rs in runs.items():
        row[side] = {"tok_s_median": statistics.median(r["tok_s"] for r in rs),
                     "tok_s": [round(r["tok_s"], 1) for r in rs],
                     "tokens_per_request": sum(r["tokens"] for r in rs) / max(
                         1, sum(r["ok"] for r in rs)),
                     **{k: sum(r[k] for r in rs) for k in ("requests", "ok", "valid",
                                                           "stopped")},
                     "errors": [e for r in rs for e in r["errors"]][:3]}
    base = row["unconstrained"]["tok_s_median"]
    row["ratio"] = row["json_schema"]["tok_s_median"] / base if base else None
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| concurrency | requests/run | unconstrained tok/s | json_schema tok/s | ratio | "
             "tokens/request (unc. / json) | valid JSON (json_schema / unc.) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        u, j = row["unconstrained"], row["json_schema"]
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(
            f"| {row['concurrency']} | {j['requests'] // len(j['tok_s'])} | "
            f"{u['tok_s_median']:.1f} | {j['tok_s_median']:.1f} | {ratio} | "
            f"{u['tokens_per_request']:.0f} / {j['tokens_per_request']:.0f} | "
            f"{j['valid']}/{j['requests']} / {u['valid']}/{u['requests']} |")
    return "\n".join(lines)


def cpu_flags() -> str:
    """The SIMD flags that matter here (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return " ".join(shown) or "no avx2"


async def bench(url: str, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    for name, schema, prompt in requests_for(len(TASKS)):  # warm-up: every grammar compiled
        await one_request(url, chat_body(model, prompt, schema, name, 4), schema)
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {
        c: {"unconstrained": [], "json_schema": []} for c in args.concurrency}
    for rnd in range(args.rounds):
        for c in args.concurrency:
            n = args.requests or max(len(TASKS), 2 * c)
            order = (True, False) if rnd % 2 == 0 else (False, True)
            for constrained in order:
                run = await run_level(url, model, c, n, args.max_tokens, constrained)
                runs[c]["json_schema" if constrained else "unconstrained"].append(run)
                print(f"round {rnd + 1} c={c} {'json_schema' if constrained else 'unconstrained'}"
                      f": {run['tok_s']:.1f} tok/s, {run['tokens']} tokens, "
                      f"{run['valid']}/{run['requests']} valid", flush=True)
    return [summarize(c, runs[c]) for c in args.concurrency]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (else start one)")
    p.add_argument("--serve-args", default="", help="extra `roseinfer serve` arguments")
    p.add_argument("--server-log", default="benchmarks/results/structured_serving_server.log")
    p.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: max(4, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output", default="benchmarks/results/structured_serving.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.concurrency) < 1 or (args.requests or 1) < 1:
        p.error("--rounds, --concurrency and --requests must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(args.serve_args,
                                                                Path(args.server_log))
    try:
        wait_healthy(url, proc, 300)
        model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        rows = asyncio.run(bench(url, model, args))
    finally:
        if proc is not None:
            stop_server(proc)
    meta = {"command": shlex.join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
            "date": datetime.date.today().isoformat(), "cpu_flags": cpu_flags(),
            "model": model, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "serve_args": args.serve_args if proc is not None else None}
    table = markdown(rows)
    print(f"\n{meta['command']}  ({meta['date']}; CPU: {meta['cpu_flags']})\n\n{table}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": meta, "levels": rows, "table": table}, indent=2))
    print(f"wrote {out}")
    errors = any(row[side]["ok"] < row[side]["requests"] for row in rows
                 for side in ("unconstrained", "json_schema"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
