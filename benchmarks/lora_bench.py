"""LoRA serving cost (issue #28): decode tok/s of 16 concurrent requests spread over 4
rank-16 adapters vs the base model at the same batch, and the swap-in time of an
adapter from disk.

Random PEFT-format adapters (all seven projections, rank 16) are written for the
default model (SmolLM2-135M-Instruct Q4_1), one ``LLM(enable_lora=True)`` engine serves
both cases: 16 prompts are prefilled, then ``--steps`` decode steps are timed (every
row decoding), base and LoRA rounds interleaved, medians reported.  The swap-in time
is ``LoRAManager.make_resident`` of an adapter that is not resident (safetensors read
+ layout into the adapter's buffer; the file is in the page cache after its first
read), into a free slot and as the LRU swap of a full engine (the evicted adapter's
buffer reused):

    PYTHONPATH=. .venv/bin/python benchmarks/lora_bench.py [--rounds 3 --steps 24 --swaps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from roseinfer.engine.engine import LLMEngine
from roseinfer.llm import LLM
from roseinfer.lora import LoRARequest
from roseinfer.lora.adapter import TARGETS, module_shapes
from roseinfer.model.config import ModelConfig
from roseinfer.sampling_params import SamplingParams

BATCH = 16


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT LoRA over every projection of every layer (small values)."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out_f, in_f) in module_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{TARGETS[module][0]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": sorted(TARGETS), "base_model_name_or_path": "SmolLM2-135M-Instruct"}))


def decode_tok_s(engine: LLMEngine, loras: list[LoRARequest | None], steps: int
                 ) -> tuple[float, float]:
    """Prefill BATCH requests, then time ``steps`` all-decode steps: tokens per second
    of wall time and of process CPU time (steadier on a shared machine)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(BATCH):
        prompt = [(37 * i + 11 * j) % 40000 + 100 for j in range(24)]
        engine.add_request(f"r{i}", prompt, params, lora_request=loras[i % len(loras)])
    for _ in range(200):  # until every request has its first token
        engine.step()
        if all(r.num_output_tokens > 0 for r in engine.scheduler.running) and \
                len(engine.scheduler.running) == BATCH:
            break
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    engine.abort_all()
    return BATCH * steps / elapsed, BATCH * steps / cpu


def timed_load(manager: object, lora: LoRARequest) -> tuple[float, float]:
    """(wall, CPU) seconds of ``make_resident`` of an adapter that is not resident."""
    start, cpu = time.perf_counter(), time.process_time()
    assert manager.make_resident(lora, pinned=set())  # type: ignore[attr-defined]
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--swaps", type=int, default=8, help="timed swap-ins of each kind")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    args = ap.parse_args()
    llm = LLM(enable_lora=True, max_loras=4, max_num_seqs=BATCH, num_threads=args.threads)
    engine = llm.engine
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(5):
            write_adapter(Path(tmp) / f"a{i}", engine.model_config, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        four = adapters[:4]
        decode_tok_s(engine, four, 4)  # warm up: loads the four adapters, builds kernels
        base, lora = [], []
        for _ in range(args.rounds):
            base.append(decode_tok_s(engine, [None], args.steps))
            lora.append(decode_tok_s(engine, four, args.steps))
        manager = engine.lora.manager
        # Swap-in from disk, two ways: into a free slot (a fresh buffer), and the LRU swap
        # of a full engine (4 resident; the least recently used one is evicted and its
        # buffer reused), cycling over the five adapters so each load is a real one.
        fresh, lru = [], []
        for k in range(args.swaps):
            target = adapters[k % 5]
            manager.resident.pop(target.lora_int_id, None)
            while len(manager.resident) >= 4:  # a free slot: drop the LRU one too
                manager.resident.popitem(last=False)
            fresh.append(timed_load(manager, target))
        manager.resident.clear()
        for a in adapters[:4]:
            manager.make_resident(a, pinned=set())
        for k in range(args.swaps):  # each load evicts the LRU one, the next to come back
            lru.append(timed_load(manager, adapters[(4 + k) % 5]))
    print(f"threads {torch.get_num_threads()}, batch {BATCH}, {args.steps} decode steps, "
          f"{args.rounds} rounds interleaved (medians; wall / CPU-time tok/s)")
    for what, i in (("wall", 0), ("CPU", 1)):
        b = statistics.median(x[i] for x in base)
        lo = statistics.median(x[i] for x in lora)
        print(f"{what}: base {b:.1f} tok/s, 4 x rank-{args.rank} LoRA {lo:.1f} tok/s, "
              f"ratio {lo / b:.2f} (target >= 0.8)")
    for what, runs in (("into a free slot", fresh), ("LRU swap, 4 resident", lru)):
        print(f"swap-in from disk, {what}: median "
              f"{statistics.median(x[0] for x in runs) * 1e3:.1f} ms wall, "
              f"{statistics.median(x[1] for x in runs) * 1e3:.1f} ms CPU, over {len(runs)} "
              "(target <= 50 ms)")


if __name__ == "__main__":
    main()
