"""Prefix-cache hit rate behind Ray Serve: prefix-aware routing vs round-robin.

Workload: 4 long system prompts (about 500 tokens each), 32 chat requests, 8 per
system prompt with different short questions, in a seeded random order, 4 at a time,
over 2 engine replicas. Before the 32 a warm-up sends each system prompt once, so what
is measured is the steady state, not the first visits. Each replica's KV pool holds
about two of the four system prompts (``--num-kv-blocks``): prefix routing gives each
replica its own two, round-robin makes every replica cycle through all four and its
LRU cache evicts. The hit rate is the replicas' own counters (prompt tokens served from
the prefix cache / prompt tokens looked up, ``GET /ray/replicas``) over the 32.

    .venv/bin/python benchmarks/ray_routing.py [--num-kv-blocks 80 --concurrency 4]

On one machine this shows routing, not speed: the replicas share its cores.
The tests (tests/ray/) use the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

WORDS = ("policy answer careful concise data report table value result context query "
         "search document summary format reply detail step customer order invoice refund "
         "shipping account billing product warranty support ticket escalate priority").split()
TOPICS = ("a bookshop", "a bank", "an airline", "a hospital", "a school", "a garden shop")
HTTP_TIMEOUT_S = 120.0
# Each replica's KV pool (blocks of 16 tokens): two of the four system prompts fit, not four.
DEFAULT_NUM_KV_BLOCKS = 80


def system_prompts(count: int = 4, words: int = 420, seed: int = 0) -> list[str]:
    """``count`` different long system prompts (``words`` words each)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        rules = " ".join(rng.choice(WORDS) for _ in range(words))
        prompts.append(f"You are assistant number {i} of {TOPICS[i % len(TOPICS)]} "
                       f"(seed {seed}). Follow these rules: {rules}.")
    return prompts


def workload(prompts: Sequence[str], num_requests: int = 32, seed: int = 0) -> list[list[dict]]:
    """``num_requests`` chat conversations, the system prompts in turn, shuffled."""
    rng = random.Random(seed)
    convs = [[{"role": "system", "content": prompts[i % len(prompts)]},
              {"role": "user", "content": f"Question {i}: what is {rng.randint(2, 99)} plus "
                                          f"{rng.randint(2, 99)}?"}]
             for i in range(num_requests)]
    rng.shuffle(convs)
    return convs


def chat(client: httpx.Client, messages: list[dict], max_tokens: int = 4) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                  "temperature": 0})
    r.raise_for_status()
    return r.json()


def replica_stats(client: httpx.Client) -> dict[str, dict]:
    r = client.get("/ray/replicas")
    r.raise_for_status()
    return {s["replica_id"]: s for s in r.json()["replicas"]}


@dataclass
class HitRate:
    hits: int
    queries: int
    per_replica: dict[str, tuple[int, int]]  # replica id -> (hits, queries)
    wall_s: float

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def measure(url: str, convs: Sequence[list[dict]], warmup: Sequence[list[dict]] = (),
            concurrency: int = 4, max_tokens: int = 4) -> HitRate:
    """Send ``warmup`` one by one, then ``convs`` (``concurrency`` at a time); the
    replicas' prefix-cache hit rate over ``convs``."""
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        for messages in warmup:
            chat(client, messages, max_tokens)
        before = replica_stats(client)
        start = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda m: chat(client, m, max_tokens), convs))
        wall = time.monotonic() - start
        after = replica_stats(client)
    per: dict[str, tuple[int, int]] = {}
    for rid, s in after.items():
        b = before.get(rid, {"prefix_cache_hits": 0, "prefix_cache_queries": 0})
        per[rid] = (s["prefix_cache_hits"] - b["prefix_cache_hits"],
                    s["prefix_cache_queries"] - b["prefix_cache_queries"])
    return HitRate(sum(h for h, _ in per.values()), sum(q for _, q in per.values()), per, wall)


# ------------------------------------------------------------------ the cluster
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(num_cpus: int = 2, port: int | None = None) -> str:
    """A local Ray cluster on loopback with Serve's proxy at 127.0.0.1:port; the URL."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             object_store_memory=96 << 20, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    # A free port is picked after Ray's own processes bound theirs; one of them (or any
    # other process) may still take it before the proxy binds: then try another one.
    for attempt in range(3):
        chosen = port or free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": chosen})
            return f"http://127.0.0.1:{chosen}"
        except Exception as exc:  # noqa: BLE001 - the proxy's "Failed to bind" (a RayTaskError)
            serve.shutdown()
            if port is not None or attempt == 2 or "bind" not in str(exc):
                raise
    raise AssertionError("unreachable")


def deploy(routing: str, num_replicas: int = 2,
           num_kv_blocks: int | None = DEFAULT_NUM_KV_BLOCKS,
           **engine: object) -> None:
    """(Re)deploy the roseinfer app with this routing; returns when it is ready."""
    from ray import serve

    from roseinfer.config import EngineConfig
    from roseinfer.ray_serve.app import APP_NAME, build
    from roseinfer.ray_serve.options import ServeOptions

    config = EngineConfig(num_threads=1, num_kv_blocks=num_kv_blocks, **engine)  # type: ignore[arg-type]
    options = ServeOptions(num_replicas=num_replicas, routing=routing,  # type: ignore[arg-type]
                           replica_cpus=1.0, max_waiting_requests=64)
    serve.run(build(config, options), name=APP_NAME, route_prefix="/")


def remove_app() -> None:
    from ray import serve

    from roseinfer.ray_serve.app import APP_NAME

    serve.delete(APP_NAME)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-replicas", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=420)
    ap.add_argument("--num-kv-blocks", type=int, default=DEFAULT_NUM_KV_BLOCKS,
                    help="KV pool of each replica, in blocks")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["prefix", "round_robin"])
    ap.add_argument("--json", action="store_true", help="print one JSON line per mode")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    from ray import serve

    t0 = time.monotonic()
    url = start_ray(num_cpus=max(2, args.num_replicas))
    print(f"Ray + Serve up in {time.monotonic() - t0:.1f} s at {url}")
    try:
        for seed, mode in enumerate(args.modes):
            t = time.monotonic()
            deploy(mode, args.num_replicas, args.num_kv_blocks)
            up = time.monotonic() - t
            prompts = system_prompts(args.system_prompts, args.prompt_words, seed=seed)
            warm = [[{"role": "system", "content": p}, {"role": "user", "content": "Hello"}]
                    for p in prompts]
            result = measure(url, workload(prompts, args.num_requests, seed), warm,
                             args.concurrency)
            if args.json:
                print(json.dumps({"routing": mode, "hit_rate": result.rate, "wall_s": result.wall_s,
                                  "per_replica": result.per_replica, "deploy_s": up}))
            else:
                per = ", ".join(f"{100 * h / q:.1f}% of {q}" if q else "idle"
                                for h, q in result.per_replica.values())
                print(f"{mode:>11}: prefix-cache hit rate {100 * result.rate:5.1f}% "
                      f"({result.hits}/{result.queries} prompt tokens; per replica: {per}); "
                      f"{args.num_requests} requests in {result.wall_s:.1f} s "
                      f"(deployed in {up:.1f} s)")
            remove_app()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
