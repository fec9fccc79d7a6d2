"""Startup time of the default model: cold (first start) vs warm (second start).

Three measurements, each in a fresh process, as a new user meets them:

* ``LLM()``: the Python API (``import roseinfer`` and ``LLM()`` timed apart);
* ``roseinfer generate --prompt hi --max-tokens 8``: the whole command, end to end;
* ``roseinfer serve``: from launch to the first ``/health`` 200 (defaults, warm-up
  included), through ``roseinfer.bench.server_process``.

Modes: ``cold`` = an empty cache directory (``$ROSEINFER_CACHE_DIR``, fresh per run: the
model and tokenizer are converted and stored), ``warm`` = the same directory again,
``off`` = ``$ROSEINFER_WEIGHT_CACHE=0`` (converts every time, stores nothing).  Rounds
interleave the modes; medians are reported.  The machine's CPU and load average are
recorded: on a shared machine the spread is large, compare within one run.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--output benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from roseinfer.bench.server_process import start_server, stop_server, wait_healthy

MODES = ("cold", "warm", "off")
LLM_SNIPPET = """
import json, time
t0 = time.perf_counter()
from roseinfer import LLM
t1 = time.perf_counter()
LLM()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1}))
"""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` (start_server passes os.environ on)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def time_llm(env: dict[str, str]) -> dict[str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LLM_SNIPPET], env={**os.environ, **env},
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def time_generate(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "roseinfer.cli", "generate", "--prompt", "hi",
                    "--max-tokens", "8"], env={**os.environ, **env}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def time_serve(env: dict[str, str], log: Path) -> float:
    with environment(env):
        start = time.perf_counter()
        proc, url = start_server("", log)
        try:
            wait_healthy(url, proc, timeout=600, interval=0.05)
            return time.perf_counter() - start
        finally:
            stop_server(proc)


def run_round(work: Path, r: int) -> dict[str, dict[str, float]]:
    """One round: every command in every mode; {command: {mode: seconds}}."""
    out: dict[str, dict[str, float]] = {}
    for command in ("LLM()", "generate", "serve"):
        cache = work / f"cache-{r}-{command.strip('()')}"
        envs = {"cold": {"ROSEINFER_CACHE_DIR": str(cache), "ROSEINFER_WEIGHT_CACHE": "1"},
                "warm": {"ROSEINFER_CACHE_DIR": str(cache), "ROSEINFER_WEIGHT_CACHE": "1"},
                "off": {"ROSEINFER_CACHE_DIR": f"{cache}-off", "ROSEINFER_WEIGHT_CACHE": "0"}}
        out[command] = {}
        for mode in MODES:  # cold first: it fills the directory warm then reads
            env = envs[mode]
            if command == "LLM()":
                result = time_llm(env)
                out[command][mode] = result["llm_s"]
                out.setdefault("import roseinfer + LLM()", {})[mode] = result["process_s"]
            elif command == "generate":
                out[command][mode] = time_generate(env)
            else:
                out[command][mode] = time_serve(env, work / f"serve-{r}-{mode}.log")
            print(f"round {r} {command:>9} {mode:>4}: {out[command][mode]:6.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/startup.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="roseinfer-startup-") as tmp:
        for r in range(args.rounds):
            rounds.append(run_round(Path(tmp), r))
    medians = {cmd: {mode: statistics.median(rd[cmd][mode] for rd in rounds) for mode in MODES}
               for cmd in rounds[0]}
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "rounds": rounds, "medians_s": medians,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "python": platform.python_version()}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\n{cpu_name()}, {os.cpu_count()} cores, load average {load_before[0]:.1f} -> "
          f"{result['loadavg_after'][0]:.1f}; medians of {args.rounds} rounds:")
    print("| seconds | cold (first start) | warm (second start) | cache off |")
    print("|---|---|---|---|")
    for cmd, by_mode in medians.items():
        print(f"| {cmd} | {by_mode['cold']:.2f} | {by_mode['warm']:.2f} | {by_mode['off']:.2f} |")
    print(f"(written to {args.output})")


if __name__ == "__main__":
    main()
