"""roseinfer against llama.cpp, side by side: decode tok/s per batch size and prefill.

For each round (rounds interleave, so drift hits both sides alike) this runs, each in
a fresh process:

* ours: ``roseinfer bench throughput`` on ``--ours`` (decode at every batch size,
  prompt ``--prompt-len``, ``--gen-len`` new tokens, a token budget that prefills every
  prompt in one step as llama-batched-bench does; then one ``--prefill-len`` prompt
  with the default budget),
  which also prints the read bandwidth and batch 1's share of the one-stream limit;
* llama.cpp: ``llama-batched-bench`` on every ``--llama`` file (the same batch sizes,
  prompt and new tokens: S_TG is its decode tok/s; then ``-npp <prefill-len> -ntg 1``:
  S_PP is its prefill tok/s).

The table gives medians over the rounds and, per row, ours over llama.cpp's best file
for that row (the issue's rule: compare against its best format per batch size).

    PYTHONPATH=. .venv/bin/python benchmarks/vs_llamacpp.py \\
        --llama-bin /work/llamacpp/build/bin --llama /tmp/smollm2-Q4_0.gguf /tmp/smollm2-F16.gguf \\
        --batch-sizes 1 16 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from roseinfer.bench.cpu_info import cpu_flags


def run_ours(model: str | None, args: argparse.Namespace, batches: list[int], prompt: int,
             gen: int, bandwidth: bool, budget: int | None = None) -> dict[str, Any]:
    """One ``roseinfer bench throughput`` process (``budget``: its token budget per
    step, else the engine's default); its JSON output."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        cmd = [sys.executable, "-m", "roseinfer.cli", "bench", "throughput",
               "--num-threads", str(args.threads), "--batch-sizes", *map(str, batches),
               "--prompt-len", str(prompt), "--gen-len", str(gen), "--output", str(out),
               *(["--model", model] if model else []), *([] if bandwidth else ["--no-bandwidth"]),
               *(["--max-num-batched-tokens", str(budget)] if budget else []),
               *args.ours_args]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout)
        return json.loads(out.read_text())


def ours_round(args: argparse.Namespace) -> dict[str, float]:
    row: dict[str, float] = {}
    # Every prompt prefilled in one step, as llama-batched-bench does before it decodes:
    # with the default budget (256 tokens) batch 64's 32 prefill steps outlast 32 new
    # tokens, the first sequences finish early, and no step decodes all 64.
    budget = max(256, max(args.batch_sizes) * args.prompt_len)
    tp = run_ours(args.ours, args, args.batch_sizes, args.prompt_len, args.gen_len, True, budget)
    for r in tp["results"]:
        row[f"b{r['batch_size']}"] = r["decode_tok_s"]
    bw = tp.get("bandwidth") or {}
    if bw.get("batch1_pct_of_limit") is not None:
        row["b1_pct_of_limit"] = bw["batch1_pct_of_limit"]
        row["read_bandwidth_gbs"] = bw["read_bandwidth_gbs"]
    pre = run_ours(args.ours, args, [1], args.prefill_len, 2, False)
    row["prefill"] = pre["results"][0]["prefill_tok_s"]
    return row


def batched_bench(binary: Path, model: Path, threads: int, npp: int, ntg: int,
                  batches: list[int], timeout: int) -> dict[int, tuple[float, float]]:
    """{batch: (S_PP, S_TG)} from one llama-batched-bench run."""
    ctx = max(batches) * (npp + ntg) + 256
    cmd = [str(binary), "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-t", str(threads), "-tb", str(threads), "-npp", str(npp), "-ntg", str(ntg),
           "-npl", ",".join(map(str, batches))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    out: dict[int, tuple[float, float]] = {}
    for line in proc.stdout.splitlines():  # | PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG |..
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            out[int(cells[2])] = (float(cells[5]), float(cells[7]))
    return out


def llama_round(args: argparse.Namespace, model: Path) -> dict[str, float]:
    binary = args.llama_bin / "llama-batched-bench"
    dec = batched_bench(binary, model, args.threads, args.prompt_len, args.gen_len,
                        args.batch_sizes, args.timeout)
    row = {f"b{b}": tg for b, (_, tg) in dec.items()}
    pre = batched_bench(binary, model, args.threads, args.prefill_len, 1, [1], args.timeout)
    row["prefill"] = pre[1][0]
    return row


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rounds for k in r}
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in sorted(keys)}


def table(results: dict[str, dict[str, float]], columns: list[str]) -> str:
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, row in results.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{row[c]:.1f}" if c in row else "-" for c in columns) + " |")
    llama = {k: v for k, v in results.items() if k != "roseinfer"}
    ours = results.get("roseinfer", {})
    ratio = []
    for c in columns:
        best = max((row[c], name) for name, row in llama.items() if c in row) if llama else None
        ratio.append(f"{ours[c] / best[0]:.2f}x ({best[1].removeprefix('llama.cpp ')})" if best and c in ours else "-")
    lines.append("| ours / llama.cpp's best | " + " | ".join(ratio) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ours", default=None, help="model for roseinfer (default: the default model)")
    p.add_argument("--ours-args", nargs=argparse.REMAINDER, default=[],
                   help="further `bench throughput` flags (last on the line)")
    p.add_argument("--llama", nargs="+", type=Path, default=[], help="GGUF files for llama.cpp")
    p.add_argument("--llama-bin", type=Path, required=True, help="dir with llama-batched-bench")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--output", type=Path, default=None, help="JSON of every round")
    args = p.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {"roseinfer": []}
    for i in range(args.rounds):
        rounds["roseinfer"].append(ours_round(args))
        for model in args.llama:
            rounds.setdefault(f"llama.cpp {model.name}", []).append(llama_round(args, model))
        print(f"round {i + 1}: " + json.dumps({k: v[-1] for k, v in rounds.items()}),
              file=sys.stderr)
    results = {k: medians(v) for k, v in rounds.items()}
    columns = [f"b{b}" for b in args.batch_sizes] + ["prefill"]
    print(f"cpu={cpu_flags()} threads={args.threads} prompt={args.prompt_len} "
          f"gen={args.gen_len} prefill={args.prefill_len} rounds={args.rounds} "
          f"(decode tok/s at each batch size, prefill tok/s; medians)")
    print(table(results, columns))
    ours = results["roseinfer"]
    if "b1_pct_of_limit" in ours:
        print(f"roseinfer batch 1: {ours['b1_pct_of_limit']:.0f}% of the bandwidth limit "
              f"(read bandwidth {ours['read_bandwidth_gbs']:.1f} GB/s)")
    if args.output:
        args.output.write_text(json.dumps({"cpu": cpu_flags(), "rounds": rounds,
                                           "medians": results}, indent=2))


if __name__ == "__main__":
    main()
