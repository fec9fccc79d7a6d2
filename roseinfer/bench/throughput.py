"""Offline throughput: B sequences of P random prompt tokens, G generated tokens each.

For every batch size the engine runs the whole job through ``LLMEngine.step`` and
every step is timed on its own:

* prefill tok/s = prompt tokens / time of the steps that computed prompt tokens;
* decode tok/s = tokens made by pure-decode steps with all B sequences in flight /
  their time: the steady state, what llama-batched-bench's S_TG measures (B sequences
  decoding in lockstep).  The prompts' last chunks finish at different steps, so the
  first sequences finish first and the last steps run fewer than B rows; those count
  only when no step had all B (``max_num_seqs`` < B, or a token budget so small that
  the first sequences finish before the last prompt is in: batch 64 x 128 tokens takes
  32 steps of 256, so G = 32 needs ``--max-num-batched-tokens 8192`` for a full batch);
* output tok/s = B * G / wall time, total tok/s = B * (P + G) / wall time.

``--compare-hf`` runs HF transformers ``generate`` on the same prompts in the same
process (greedy, ``min_new_tokens = max_new_tokens = G``) and prints our output
tok/s over theirs.  Figures are medians over ``--repeat`` runs; the read bandwidth
behind batch 1's share of its limit is probed right before and after batch 1's runs
(the higher of the two).  Before each run the KV
blocks it will take are written once (``touch_next_blocks``): a run measures a server's
steady state, not the first backing of the pool's pages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from roseinfer.bench.bandwidth import (
    bandwidth_limit_tok_s,
    read_bandwidth_gbs,
    weight_bytes_per_step,
)
from roseinfer.engine.engine import LLMEngine
from roseinfer.model.loader import resolve_model_path
from roseinfer.runner.kv_pool import touch_blocks
from roseinfer.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    batch_size: int
    prompt_len: int
    gen_len: int
    prefill_tok_s: float
    decode_tok_s: float
    output_tok_s: float
    total_tok_s: float
    wall_s: float
    hf_output_tok_s: float | None = None
    # read bandwidth (GB/s) probed right before and after this batch size's runs, the
    # higher (batch 1, when run_throughput has a probe): the limit its runs had
    read_bandwidth_gbs: float | None = None

    @property
    def hf_ratio(self) -> float | None:
        if not self.hf_output_tok_s:
            return None
        return self.output_tok_s / self.hf_output_tok_s


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` ids drawn from the vocabulary (no specials)."""
    gen = torch.Generator().manual_seed(seed)
    low = min(1000, vocab // 2)
    ids = torch.randint(low, vocab, (batch, prompt_len), generator=gen)
    return ids.tolist()


def touch_next_blocks(engine: LLMEngine, num_tokens: list[int]) -> None:
    """Back the KV blocks that sequences of ``num_tokens`` will take next with memory
    before they are timed: on CPU the pool's pages are backed when first written, and on
    a fresh machine that first write cost one decode step 0.28 s for 64 sequences' new
    blocks (Zen 5 VM, 11-29), time a long-running server (and llama.cpp, which zeroes
    its cache at start) never spends mid-run."""
    runner = engine.runner
    if not hasattr(runner, "kv_caches"):  # a tensor-parallel runner's caches live in its workers
        return
    bm = engine.block_manager
    need = sum(bm.blocks_needed(n) for n in num_tokens)
    touch_blocks(runner.kv_caches, bm.next_fresh_blocks(need), bm.block_size)


def run_engine_once(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> ThroughputResult:
    """Run one job to completion; time prefill steps and pure-decode steps apart."""
    touch_next_blocks(engine, [len(p) + gen_len for p in prompts])
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    for p in prompts:
        engine.add_request(engine.next_request_id(), p, params)
    prefill_t = 0.0
    decode = {True: [0.0, 0], False: [0.0, 0]}  # all B in flight? -> [seconds, tokens]
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        in_flight = engine.scheduler.running + list(engine.scheduler.waiting)
        has_prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in in_flight)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if has_prefill:
            prefill_t += dt
        else:
            acc = decode[len(in_flight) == len(prompts)]
            acc[0] += dt
            acc[1] += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
    wall = time.perf_counter() - start
    decode_t, decode_tokens = decode[True] if decode[True][1] else decode[False]
    b, p = len(prompts), len(prompts[0])
    return ThroughputResult(
        batch_size=b, prompt_len=p, gen_len=gen_len,
        prefill_tok_s=b * p / prefill_t if prefill_t else 0.0,
        decode_tok_s=decode_tokens / decode_t if decode_t else 0.0,
        output_tok_s=b * gen_len / wall, total_tok_s=b * (p + gen_len) / wall, wall_s=wall,
    )


def _median_result(runs: list[ThroughputResult]) -> ThroughputResult:
    first = runs[0]
    med = {
        k: statistics.median(getattr(r, k) for r in runs)
        for k in ("prefill_tok_s", "decode_tok_s", "output_tok_s", "total_tok_s", "wall_s")
    }
    return ThroughputResult(first.batch_size, first.prompt_len, first.gen_len, **med)


def hf_generate_tok_s(model: Any, prompts: list[list[int]], gen_len: int) -> float:
    """HF transformers ``generate`` output tok/s on the same prompts (greedy, fp32)."""
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2,
                       min_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len,
                       do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    return len(prompts) * gen_len / dt


def load_hf_model(model_path: str | None) -> Any:
    """HF transformers' own load of the engine's model (GGUF or HF dir), fp32."""
    import transformers

    path = resolve_model_path(model_path)
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def run_throughput(
    engine: LLMEngine,
    batch_sizes: list[int],
    prompt_len: int = 128,
    gen_len: int = 128,
    repeat: int = 1,
    compare_hf: bool = False,
    hf_batch_sizes: list[int] | None = None,
    seed: int = 0,
    probe: Callable[[], float] | None = None,
) -> list[ThroughputResult]:
    """Run the offline benchmark for each batch size; optionally HF side by side.
    ``probe`` (read bandwidth, GB/s) runs right before and after batch 1's runs: a
    machine's memory speed can change within a benchmark (a VM's neighbours), and
    batch 1's share of the limit needs the speed its own runs had."""
    vocab = engine.model_config.vocab_size
    warm = random_prompts(1, min(prompt_len, 32), vocab, seed + 999)
    run_engine_once(engine, warm, 4)
    hf_model = load_hf_model(engine.config.model) if compare_hf else None
    results = []
    for b in batch_sizes:
        before = probe() if probe is not None and b == 1 else None
        runs = []
        for r in range(repeat):
            prompts = random_prompts(b, prompt_len, vocab, seed + 17 * r + b)
            runs.append(run_engine_once(engine, prompts, gen_len))
        res = _median_result(runs)
        if before is not None:
            res.read_bandwidth_gbs = max(before, probe())
        if hf_model is not None and (hf_batch_sizes is None or b in hf_batch_sizes):
            res.hf_output_tok_s = hf_generate_tok_s(
                hf_model, random_prompts(b, prompt_len, vocab, seed + b), gen_len)
        results.append(res)
    return results


def format_table(results: list[ThroughputResult], header: dict[str, Any]) -> str:
    lines = [" ".join(f"{k}={v}" for k, v in header.items())]
    lines.append(f"{'batch':>5} {'prefill tok/s':>13} {'decode tok/s':>12} {'output tok/s':>12} "
                 f"{'total tok/s':>11} {'HF out tok/s':>12} {'x HF':>6}")
    for r in results:
        hf = f"{r.hf_output_tok_s:12.1f}" if r.hf_output_tok_s else f"{'-':>12}"
        ratio = f"{r.hf_ratio:6.1f}" if r.hf_ratio else f"{'-':>6}"
        lines.append(f"{r.batch_size:5d} {r.prefill_tok_s:13.1f} {r.decode_tok_s:12.1f} "
                     f"{r.output_tok_s:12.1f} {r.total_tok_s:11.1f} {hf} {ratio}")
    return "\n".join(lines)


def results_json(results: list[ThroughputResult], header: dict[str, Any]) -> dict[str, Any]:
    return {"config": header,
            "results": [asdict(r) | {"hf_ratio": r.hf_ratio} for r in results]}


def bandwidth_report(engine: LLMEngine, results: list[ThroughputResult]) -> dict[str, Any]:
    """Read bandwidth, weight bytes per step, the one-stream limit and batch 1's share."""
    weight_bytes = weight_bytes_per_step(resolve_model_path(engine.config.model),
                                         engine.model_config, engine.quantization)
    b1_run = next((r for r in results if r.batch_size == 1), None)
    bandwidth = (b1_run.read_bandwidth_gbs if b1_run and b1_run.read_bandwidth_gbs
                 else read_bandwidth_gbs())
    limit = bandwidth_limit_tok_s(weight_bytes, bandwidth)
    b1 = next((r.decode_tok_s for r in results if r.batch_size == 1), None)
    return {"read_bandwidth_gbs": bandwidth, "weight_bytes_per_step": weight_bytes,
            "limit_tok_s": limit, "batch1_decode_tok_s": b1,
            "batch1_pct_of_limit": None if b1 is None else 100 * b1 / limit}


def format_bandwidth(report: dict[str, Any]) -> str:
    line = (f"bandwidth: read {report['read_bandwidth_gbs']:.1f} GB/s, weights "
            f"{report['weight_bytes_per_step'] / 1e9:.3f} GB per step -> one stream <= "
            f"{report['limit_tok_s']:.1f} tok/s")
    pct = report["batch1_pct_of_limit"]
    if pct is not None:
        line += f"; batch 1 decode at {pct:.0f}% of it"
        if pct > 100:
            line += " (above the limit: the memory's speed changed while batch 1 ran)"
    return line
