"""Scale: load time, memory and speed of GGUF models of growing size (docs/scale.md).

Per model file, each measurement in a fresh process (``--worker``):

* first start: ``LLMEngine`` built with an empty cache directory (weight / tokenizer
  caches written, if the path uses them), then a warm start with the same directory;
* RSS after the warm start (psutil) and the peak of the process (VmHWM);
* decode tok/s at batch 1 and 16 (32-token prompts, pure-decode steps timed), prefill
  tok/s of one 512-token prompt (``roseinfer.bench.throughput.run_engine_once``);
  ``b1cpu`` / ``b16cpu``: decode tokens per second of process CPU time (16 steps; with
  ``--threads 1`` the work itself, steady when other jobs share the cores).

``--baseline /work/main`` runs the same worker on another checkout's code (its
``roseinfer`` on PYTHONPATH: today's dequantize-and-convert loader) on the same files.
``--llama-batched-bench PATH`` adds llama.cpp's numbers on the same files (its output
table, batch 1 and 16 with a 512-token prompt).  Results go to ``--output`` (JSON); the
tables (markdown) are printed, and ``--plot`` draws RSS and decode tok/s against file
size (matplotlib, when installed).

    .venv/bin/python benchmarks/scale.py /tmp/roseinfer-gguf/llama-1b-Q4_K_M.gguf \
        --measure b1 b16 prefill --baseline /work/main --output /tmp/a.json
    .venv/bin/python benchmarks/scale.py --from-json /tmp/a.json /tmp/b.json --plot docs/scale.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MEASURES = ("b1", "b16", "prefill", "b1cpu", "b16cpu")
_GB = 1e9


def _vm_hwm() -> int:
    """Peak RSS of this program's address space (ru_maxrss would count the parent's RSS
    at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(path: str, measures: list[str], threads: int, kv_gb: float) -> dict[str, Any]:
    """One start of the engine on ``path`` (in this process), then the measurements."""
    import psutil
    import torch

    start = time.perf_counter()
    from roseinfer.config import EngineConfig
    from roseinfer.engine.engine import LLMEngine

    # kv_cache_prefault_gb=0: the RSS after load is the weights', not however much of the
    # pool the idle-time backing thread reached by then
    engine = LLMEngine(EngineConfig(model=path, num_threads=threads, kv_cache_memory_gb=kv_gb,
                                    max_num_batched_tokens=512, max_num_seqs=16,
                                    kv_cache_prefault_gb=0.0))
    out: dict[str, Any] = {"start_s": time.perf_counter() - start,
                           "rss_gb": psutil.Process().memory_info().rss / _GB,
                           "peak_gb": _vm_hwm() / _GB,
                           "threads": torch.get_num_threads()}
    from roseinfer.bench.throughput import random_prompts, run_engine_once

    vocab = engine.model_config.vocab_size
    for name in measures:
        if name.endswith("cpu"):
            out[name] = decode_cpu_tok_s(engine, 16 if name == "b16cpu" else 1, vocab)
            continue
        batch, prompt, gen = {"b1": (1, 32, 12), "b16": (16, 32, 8), "prefill": (1, 512, 1)}[name]
        res = run_engine_once(engine, random_prompts(batch, prompt, vocab, seed=1), gen)
        out[name] = res.prefill_tok_s if name == "prefill" else res.decode_tok_s
    out["rss_after_run_gb"] = psutil.Process().memory_info().rss / _GB
    return out


def decode_cpu_tok_s(engine: Any, batch: int, vocab: int, steps: int = 16) -> float:
    """Decode tokens per second of this process's CPU time over ``steps`` pure-decode
    steps of ``batch`` 32-token prompts (prefill steps not counted)."""
    from roseinfer.bench.throughput import random_prompts
    from roseinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for p in random_prompts(batch, 32, vocab, seed=1):
        engine.add_request(engine.next_request_id(), p, params)
    cpu, tokens = 0.0, 0
    for _ in range(10 * (steps + 32)):  # bounded: prefill chunks, then the decode steps
        if not engine.has_unfinished_requests():
            break
        sched = engine.scheduler
        prefill = any(r.num_computed_tokens < r.num_prompt_tokens
                      for r in sched.running + list(sched.waiting))
        t0 = time.process_time()
        outs = engine.step()
        if not prefill:
            cpu += time.process_time() - t0
            tokens += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
    return tokens / cpu if cpu else 0.0


def run_worker(path: Path, code: Path, cache: Path, args: argparse.Namespace,
               measures: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code), "ROSEINFER_CACHE_DIR": str(cache)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path),
           "--threads", str(args.threads), "--kv-gb", str(args.kv_gb), "--measure", *measures]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_cpp(binary: Path, path: Path, threads: int, timeout: int) -> dict[str, Any]:
    """llama-batched-bench's table rows (PP 512, TG 32, batch 1 and 16)."""
    cmd = [str(binary), "-m", str(path), "-c", "16384", "-b", "512", "-ub", "512", "-npp", "512",
           "-ntg", "32", "-npl", "1,16", "-t", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    out: dict[str, Any] = {"table": rows}
    for line in rows[2:]:  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            out[f"b{cells[2]}"] = float(cells[7])
            out.setdefault("prefill", float(cells[5]))
    return out


def measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"file": path.name, "size_gb": path.stat().st_size / _GB}
    codes = {"ours": Path(__file__).resolve().parents[1]}
    if args.baseline:
        codes["baseline"] = args.baseline
    for label, code in codes.items():
        with tempfile.TemporaryDirectory(prefix="roseinfer-scale-") as cache:
            first = run_worker(path, code, Path(cache), args, [])
            warm = run_worker(path, code, Path(cache), args, args.measure)
        result[label] = {"first_start_s": first.get("start_s"), "first_peak_gb":
                         first.get("peak_gb"), **warm}
        print(f"{path.name} {label}: {result[label]}", file=sys.stderr)
    if args.llama_batched_bench:
        result["llama.cpp"] = llama_cpp(args.llama_batched_bench, path, args.threads,
                                        args.timeout)
    return result


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| file | GB | code | first start s | warm start s | RSS GB | peak GB | "
             "decode b1 tok/s | decode b16 tok/s | prefill 512 tok/s | b1 / b16 tok/s of CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for label in ("ours", "baseline", "llama.cpp"):
            m = r.get(label)
            if m is None:
                continue
            if "error" in m:
                lines.append(f"| {r['file']} | {r['size_gb']:.2f} | {label} | error: "
                             f"{m['error'][0][:60]} | | | | | | | |")
                continue
            lines.append(
                f"| {r['file']} | {r['size_gb']:.2f} | {label} | {_fmt(m.get('first_start_s'), 1)}"
                f" | {_fmt(m.get('start_s'), 1)} | {_fmt(m.get('rss_gb'))} | "
                f"{_fmt(m.get('peak_gb'))} | {_fmt(m.get('b1'))} | {_fmt(m.get('b16'))} | "
                f"{_fmt(m.get('prefill'), 1)} | {_fmt(m.get('b1cpu'))} / {_fmt(m.get('b16cpu'))} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, marker in (("ours", "o"), ("baseline", "s")):
        pts = [(r["size_gb"], r[label]) for r in results
               if label in r and "error" not in r[label]]
        if not pts:
            continue
        ax1.plot([s for s, _ in pts], [m["rss_gb"] for _, m in pts], marker, label=label)
        b1 = [(s, m["b1"]) for s, m in pts if "b1" in m]
        ax2.plot([s for s, _ in b1], [v for _, v in b1], marker, label=label)
    ax1.plot([0, max(r["size_gb"] for r in results)], [0.35, 0.35 + 1.15 * max(
        r["size_gb"] for r in results)], "--", label="1.15 x file + 0.35 GB")
    ax1.set(xlabel="GGUF file (GB)", ylabel="RSS after load (GB)")
    ax2.set(xlabel="GGUF file (GB)", ylabel="decode tok/s, batch 1")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("models", nargs="*", type=Path)
    p.add_argument("--measure", nargs="*", default=list(MEASURES), choices=MEASURES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gb", type=float, default=0.25, help="KV pool of each start (GiB)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout whose roseinfer runs the same measurements")
    p.add_argument("--llama-batched-bench", type=Path, default=None)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/scale.json"))
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--from-json", nargs="+", type=Path, default=None,
                   help="print the table (and --plot) of earlier --output files instead")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.measure, args.threads, args.kv_gb)))
        return
    if args.from_json:
        results = [r for f in args.from_json for r in json.loads(f.read_text())]
    else:
        results = [measure(path, args) for path in args.models]
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
