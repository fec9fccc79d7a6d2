"""Where a batch-1 decode step's time goes, piece by piece (CPU time of the engine thread).

    PYTHONPATH=. python benchmarks/decode_split.py [THREADS] [STEPS]

Runs the default model on one 128-token prompt, then STEPS greedy decode steps, each
split into the engine's pieces as ``LLMEngine.step`` runs them: schedule, attention
metadata (with the step's token tensor), embedding, the C++ decoder stack, LM head,
sampling, scheduler update + outputs. Prints the median of each (ms). ``thread_time``
counts this thread's CPU only: with THREADS > 1 the stack's and head's other threads are
not in it (use ``roseinfer bench throughput`` for those).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.model.attention_metadata import build_attention_metadata
from roseinfer.runner.model_runner import StepLogits, layout_step


def main(threads: int, steps: int) -> None:
    torch.set_num_threads(threads)
    eng = LLM(num_threads=threads).engine
    eng.add_request("r0", [1] * 128, SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                     ignore_eos=True))
    eng.step()  # the prefill
    runner, model = eng.runner, eng.runner.model
    times: dict[str, list[float]] = {}
    for _ in range(steps):
        marks = [time.thread_time()]
        sched = eng.scheduler.schedule()
        marks.append(time.thread_time())
        with torch.inference_mode():
            layout = layout_step(sched.scheduled)
            meta = build_attention_metadata(layout.seqs, runner.block_size, runner.device)
            ids = torch.tensor(layout.token_ids, dtype=torch.long)
            marks.append(time.thread_time())
            h = model.embed(ids)
            marks.append(time.thread_time())
            stack = model._decode_stack(h)  # the default model has one
            hidden = stack.forward(
                h, meta.positions, model.model.rotary_emb.cos_sin_cache, runner.kv_caches,
                meta.block_tables, meta.token_seq, meta.token_context_lens, meta.slot_mapping,
                meta.block_size, None)
            marks.append(time.thread_time())
            logits = model.compute_logits(hidden[torch.tensor(layout.sample_rows)])
            marks.append(time.thread_time())
        sampled = eng.step_sampler.sample(sched.scheduled, StepLogits(logits, {}), {})
        marks.append(time.thread_time())
        eng._make_outputs(eng.scheduler.update(sched, sampled))
        marks.append(time.thread_time())
        names = ("schedule", "metadata", "embed", "stack", "lm_head", "sample", "update+out")
        for name, a, b in zip(names, marks[:-1], marks[1:], strict=True):
            times.setdefault(name, []).append((b - a) * 1e3)
        times.setdefault("total", []).append((marks[-1] - marks[0]) * 1e3)
    print(" ".join(f"{k}={statistics.median(v):.3f}" for k, v in times.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1,
         int(sys.argv[2]) if len(sys.argv) > 2 else 48)
