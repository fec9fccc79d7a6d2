"""Reliability of a real `roseinfer serve` process on the default model under abuse.

* A load + disconnect storm: 100 concurrent chat / completion requests, streaming and
  not, n=1/2, varied prompt and output lengths, on a KV pool small enough to force
  preemption and a waiting bound small enough for 503s; about half the clients hang up
  (right after sending, after a delay, or mid-stream). Every other request must end
  properly or get a clean 503; afterwards the engine is idle, the KV pool whole and the
  server healthy.
* SIGTERM with streams in flight: every stream still ends with a finish_reason and
  ``[DONE]``, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.helpers import (
    MODEL_NAME,
    STARTUP_TIMEOUT_S,
    ServerProcess,
    metric,
    scrape,
    stop_process,
    wait_healthy,
    wait_until,
)
from tests.server.reliability_helpers import (
    Hangup,
    Outcome,
    outcome_problem,
    request,
    start_serve,
    stream_problem,
)

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

WORDS = ("time river light stone garden music window paper summer market letter forest "
         "engine silver quiet morning bridge story number castle winter ocean field table "
         "mirror school travel yellow answer family island thunder").split()
NUM_REQUESTS = 100
BURST = 30  # sent at once; the rest arrive over SPREAD_S seconds
SPREAD_S = 8.0
MAX_WAITING = 16  # below the 30-request burst, so the bound answers 503 however fast the engine
STORM_SERVER_ARGS = ("--num-kv-blocks", "40", "--block-size", "16", "--max-num-seqs", "32",
                     "--max-waiting-requests", str(MAX_WAITING), "--max-num-batched-tokens",
                     "256", "--log-stats-interval", "2")


@dataclass(frozen=True)
class Plan:
    """One storm request: what to send and when to hang up."""

    path: str
    body: dict[str, Any]
    stream: bool
    num_choices: int
    delay_s: float
    hangup: Hangup | None

    @property
    def label(self) -> str:
        kind = "chat" if "chat" in self.path else "cmpl"
        return f"{kind}/{'stream' if self.stream else 'json'}/n={self.num_choices}"


def make_plan(rng: random.Random, i: int) -> Plan:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = 2 if rng.random() < 0.25 else 1
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((3, 8, 16, 32, 64))))
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": rng.randint(8, 24), "n": n,
                            "stream": stream, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        body.update(temperature=0.0)
    else:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    hangup = None
    if rng.random() < 0.5:
        mode = rng.random()
        if mode < 1 / 3:
            hangup = Hangup(after_send=True)  # gone before the first response byte
        elif mode < 2 / 3 or not stream:
            hangup = Hangup(delay_s=rng.uniform(0.02, 4.0))  # waiting, prefill or decode
        else:
            hangup = Hangup(events=rng.randint(1, 6))  # mid-stream
    delay = 0.0 if i < BURST else rng.uniform(0.0, SPREAD_S)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Plan(path, body, stream, n, delay, hangup)


async def run_plan(url: str, plan: Plan) -> Outcome:
    await asyncio.sleep(plan.delay_s)
    return await request(url, plan.path, plan.body, hangup=plan.hangup or Hangup(),
                         timeout=90.0)


async def storm(url: str, seed: int) -> list[tuple[Plan, Outcome]]:
    rng = random.Random(seed)
    plans = [make_plan(rng, i) for i in range(NUM_REQUESTS)]
    outcomes = await asyncio.gather(*(run_plan(url, p) for p in plans))
    return list(zip(plans, outcomes, strict=True))


def engine_idle_and_pool_whole(url: str) -> bool:
    m = scrape(url)
    return (metric(m, "roseinfer:num_requests_running") == 0
            and metric(m, "roseinfer:num_requests_waiting") == 0
            and metric(m, "roseinfer:kv_cache_free_blocks")
            == metric(m, "roseinfer:kv_cache_total_blocks"))


@pytest.fixture(scope="module")
def storm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("storm") / "serve.log"
    server = start_serve(log, *STORM_SERVER_ARGS)
    try:
        wait_healthy(server.url, server.proc, STARTUP_TIMEOUT_S, log)
        yield server
    finally:
        stop_process(server.proc)


def test_load_and_disconnect_storm(storm_server: ServerProcess) -> None:
    url = storm_server.url
    start = time.monotonic()
    results = asyncio.run(storm(url, seed=1234))
    wall = time.monotonic() - start
    tally: Counter[str] = Counter()
    problems = []
    for plan, out in results:
        if plan.hangup is not None and out.hung_up:
            tally["hung up"] += 1
            # Whatever it saw before hanging up must still be well formed.
            if out.status not in (None, 200, 503):
                problems.append(f"{plan.label} (hung up): status {out.status} {out.body[:200]!r}")
            continue
        problem = outcome_problem(out, plan.stream, plan.num_choices)
        if problem:
            problems.append(f"{plan.label} hangup={plan.hangup}: {problem}")
        tally["503" if out.status == 503 else "completed"] += 1
    log_tail = storm_server.log.read_text()[-3000:]
    assert not problems, f"{len(problems)} bad outcomes ({tally}):\n" + "\n".join(
        problems[:15]) + f"\n--- server log tail:\n{log_tail}"
    print(f"storm: {dict(tally)} in {wall:.1f}s")
    assert tally["hung up"] >= NUM_REQUESTS // 4, tally
    assert tally["completed"] >= NUM_REQUESTS // 5, tally
    assert tally["503"] >= 1, f"the waiting bound never answered 503: {tally}"

    assert wait_until(lambda: engine_idle_and_pool_whole(url), 15.0, 0.25), scrape(url)
    m = scrape(url)
    assert metric(m, "roseinfer:num_preemptions_total") > 0, "the KV pool never forced a preemption"
    assert metric(m, "roseinfer:request_success_total", finished_reason="abort") > 0
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert "Traceback" not in storm_server.log.read_text(), storm_server.log.read_text()[-4000:]
    # And it still serves.
    ok = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "The river", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: engine_idle_and_pool_whole(url), 15.0, 0.25), scrape(url)


# -------------------------------------------------------------------- SIGTERM
NUM_DRAIN_STREAMS = 10


async def sigterm_under_load(server: ServerProcess) -> list[Outcome]:
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i in range(NUM_DRAIN_STREAMS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
        body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 24, "stream": True,
                                "temperature": 0.0, "ignore_eos": True}
        if i % 2:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        tasks.append(asyncio.create_task(request(server.url, path, body, timeout=60.0)))
    # SIGTERM once every request is being generated (it has produced tokens).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(scrape, server.url)
        if metric(m, "roseinfer:num_requests_running") == NUM_DRAIN_STREAMS:
            break
        await asyncio.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    signalled_after = loop.time() - start
    outcomes = list(await asyncio.gather(*tasks))
    assert all(out.elapsed_s > signalled_after for out in outcomes), "not in flight"
    return outcomes


def test_sigterm_with_streams_in_flight_drains_and_exits_0(tmp_path: Path) -> None:
    server = start_serve(tmp_path / "serve.log", "--graceful-timeout", "60",
                         "--max-num-seqs", "16")
    try:
        wait_healthy(server.url, server.proc, STARTUP_TIMEOUT_S, server.log)
        outcomes = asyncio.run(sigterm_under_load(server))
        problems = [p for out in outcomes if (p := out.error or stream_problem(out, 1))]
        assert not problems, "\n".join(problems) + "\n" + server.log.read_text()[-3000:]
        assert all(out.status == 200 for out in outcomes)
        assert server.proc.wait(90) == 0, server.log.read_text()[-3000:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=2)
    finally:
        stop_process(server.proc)
