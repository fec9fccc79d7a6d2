"""Where one decode step's time goes.

Brings B sequences to a context of P tokens, then times ``--steps`` pure-decode
steps two ways:

1. engine phases, unprofiled wall clock: schedule, model runner (forward + logits, or
   the greedy head's tokens where every row is greedy, as ``LLMEngine.step`` runs it),
   sampler, scheduler update, outputs/detokenize — the same calls ``LLMEngine.step``
   makes, in its order;
2. inside the runner, under ``torch.profiler`` with labelled ranges: GEMMs (every
   linear layer and the LM head), attention (the paged-attention call, KV writes
   excluded), KV writes, other tensor ops (norms, rotary, embedding, residuals —
   self time of ops outside the labelled ranges), and Python overhead (the rest of
   the runner's wall time).  Shares are scaled to the unprofiled runner time.
   When decode steps run in the C++ decoder stack, its own timers split its time
   the same way (KV writes there include the rotary embedding), and its GEMM time by
   linear (qkv, o, gate/up, down over all layers), each with the weight bytes it read
   per second and its GFLOP/s: a small step's linears are bound by reading their
   weights, a large step's by arithmetic.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from roseinfer.bench.bandwidth import LINEAR_KINDS, linear_bytes_per_step, linear_weights
from roseinfer.bench.throughput import random_prompts, touch_next_blocks
from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.scheduler import SchedulerOutput
from roseinfer.model.loader import resolve_model_path
from roseinfer.sampling_params import SamplingParams

_LABELS = ("gemm", "attention", "kv_write")


def _prepare(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> None:
    """Admit ``batch`` sequences and step until every one of them is decoding; the KV
    blocks they will fill in ``steps`` more steps (and the profile's as many again) are
    backed first (``touch_next_blocks``)."""
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    touch_next_blocks(engine, [prompt_len + 2 * steps + 4] * batch)
    for p in random_prompts(batch, prompt_len, vocab, seed):
        engine.add_request(engine.next_request_id(), p, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        engine.step()


def _timed_step(engine: LLMEngine, acc: dict[str, float]) -> None:
    """One ``LLMEngine.step`` split into its phases (mirrors ``step``)."""
    t = [time.perf_counter()]
    sched = engine.scheduler.schedule()
    t.append(time.perf_counter())
    failed: dict = {}
    scheduled, logits = engine._execute(sched.scheduled, failed,
                                        engine.greedy_step(sched.scheduled))
    t.append(time.perf_counter())
    sampled = engine.step_sampler.sample(scheduled, logits, failed)
    engine._record_prompt_logprobs(scheduled, logits)
    failed_groups = engine._fail(failed)
    t.append(time.perf_counter())
    advanced = engine.scheduler.update(SchedulerOutput(scheduled), sampled)
    t.append(time.perf_counter())
    engine._make_outputs(advanced, failed_groups)
    t.append(time.perf_counter())
    for name, a, b in zip(("schedule", "runner", "sample", "update", "outputs"), t, t[1:],
                          strict=False):
        acc[name] = acc.get(name, 0.0) + (b - a)


@contextlib.contextmanager
def _labelled(engine: LLMEngine) -> Iterator[None]:
    """Wrap linear layers, paged attention and KV writes in profiler ranges."""
    import roseinfer.model.gpt2 as gpt2
    import roseinfer.model.layers as layers
    import roseinfer.model.llama as llama

    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(owner, attr)

        def inner(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        patched.append((owner, attr, fn))
        setattr(owner, attr, inner)

    for mod in (layers, llama, gpt2):
        if hasattr(mod, "paged_attention"):
            wrap(mod, "paged_attention", "attention")
    wrap(layers, "write_kv_cache", "kv_write")
    for m in engine.runner.model.modules():
        if isinstance(m, nn.Linear) or type(m).__name__.endswith("Linear"):
            wrap(m, "forward", "gemm")
    model = engine.runner.model
    wrap(model, "compute_logits", "gemm")
    if hasattr(model, "compute_greedy"):  # the greedy steps' LM head
        wrap(model, "compute_greedy", "gemm")
    try:
        yield
    finally:
        for owner, attr, fn in reversed(patched):
            if isinstance(owner, nn.Module) and attr == "forward":
                del owner.forward
            elif owner is model and attr in ("compute_logits", "compute_greedy"):
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)


class _LabelledStack:
    """Stands in for the model's C++ decode stack while profiling: a labelled range."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack

    def forward(self, *args: Any) -> Any:
        with record_function("decoder_stack"):
            return self.stack.forward(*args)


def _runner_breakdown(engine: LLMEngine, steps: int) -> tuple[dict[str, float],
                                                                dict[str, float]]:
    """Seconds per category over ``steps`` profiled decode steps, and the C++ stack's
    GEMM seconds by linear (empty without the stack)."""
    from torch.profiler import ProfilerActivity, profile

    runner_wall = 0.0
    model = engine.runner.model
    stack = getattr(model, "_stack", None)  # C++ decode stack: it has its own timers
    if stack is not None:
        stack.set_profiling(True)
        model._stack = _LabelledStack(stack)
    with _labelled(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sched = engine.scheduler.schedule()
            t0 = time.perf_counter()
            with record_function("runner"):
                logits = engine.runner.execute(sched.scheduled,
                                               greedy=engine.greedy_step(sched.scheduled))
            runner_wall += time.perf_counter() - t0
            sampled = engine.step_sampler.sample(sched.scheduled, logits, {})
            engine._make_outputs(engine.scheduler.update(sched, sampled))
    if stack is not None:
        model._stack = stack
    events = prof.events()
    totals = {k: 0.0 for k in _LABELS}
    other_ops = 0.0
    labelled_ids: set[int] = set()
    runner_ids: set[int] = set()
    inside: dict[str, set[int]] = {k: set() for k in _LABELS}

    def mark(ev: Any, into: set[int]) -> None:
        for child in ev.cpu_children:
            into.add(id(child))
            mark(child, into)

    for ev in events:
        if ev.name in _LABELS:
            if id(ev) not in inside[ev.name]:  # nested same label (lm_head in logits)
                totals[ev.name] += ev.cpu_time_total / 1e6
            mark(ev, labelled_ids)
            mark(ev, inside[ev.name])
        elif ev.name == "runner":
            mark(ev, runner_ids)
        elif ev.name == "decoder_stack":  # its ATen calls are covered by its own timers
            mark(ev, labelled_ids)
    # KV writes happen inside attention: report attention without them.
    totals["attention"] = max(0.0, totals["attention"] - totals["kv_write"])
    for ev in events:
        if (id(ev) in runner_ids and id(ev) not in labelled_ids
                and ev.name not in (*_LABELS, "decoder_stack")):
            other_ops += ev.self_cpu_time_total / 1e6
    totals["other_ops"] = other_ops
    linears: dict[str, float] = {}
    if stack is not None:
        gemm, attention, kv_write, row_ops = stack.profile()
        linears = dict(zip(LINEAR_KINDS, stack.linear_profile(), strict=True))
        stack.set_profiling(False)
        totals["gemm"] += gemm
        totals["attention"] += attention
        totals["kv_write"] += kv_write
        totals["other_ops"] += row_ops
    totals["python"] = max(0.0, runner_wall - sum(totals.values()))
    totals["runner_wall"] = runner_wall
    return totals, linears


def run_profile(engine: LLMEngine, batch: int, prompt_len: int = 128, steps: int = 16,
                seed: int = 0) -> dict[str, Any]:
    """Profile ``steps`` decode steps with ``batch`` sequences at ~``prompt_len`` context."""
    _prepare(engine, batch, prompt_len, steps, seed)
    for _ in range(2):
        engine.step()  # warm-up
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    for _ in range(steps):
        _timed_step(engine, phases)
    wall = time.perf_counter() - t0
    inner, linears = _runner_breakdown(engine, steps)
    engine.abort_all()
    scale = phases["runner"] / inner["runner_wall"] if inner["runner_wall"] else 1.0
    runner = {k: v * scale / steps for k, v in inner.items() if k != "runner_wall"}
    path = resolve_model_path(engine.config.model)
    weight_bytes = linear_bytes_per_step(path, engine.model_config, engine.quantization)
    weights = linear_weights(engine.model_config)
    return {
        "batch": batch, "prompt_len": prompt_len, "steps": steps,
        "step_ms": wall / steps * 1e3,
        "decode_tok_s": batch * steps / wall,
        "phases_ms": {k: v / steps * 1e3 for k, v in phases.items()},
        "runner_ms": {k: v * 1e3 for k, v in runner.items()},
        # the stack's linears: ms a step, weight bytes read per second, GFLOP/s
        "linears": {k: {"ms": v * scale / steps * 1e3,
                        "gb_s": weight_bytes[k] * steps / (v * scale) / 1e9 if v else 0.0,
                        "gflop_s": 2 * weights[k] * batch * steps / (v * scale) / 1e9
                        if v else 0.0}
                    for k, v in linears.items()},
    }


def format_profile(p: dict[str, Any]) -> str:
    step = p["step_ms"]
    lines = [f"batch={p['batch']} context~{p['prompt_len']} steps={p['steps']}: "
             f"{step:.2f} ms/step, {p['decode_tok_s']:.1f} tok/s"]
    lines.append("  engine phases (unprofiled):")
    for k, v in p["phases_ms"].items():
        lines.append(f"    {k:<10} {v:8.2f} ms  {100 * v / step:5.1f}%")
    lines.append("  runner breakdown (profiled, scaled to the runner's unprofiled time):")
    for k in ("gemm", "attention", "kv_write", "other_ops", "python"):
        v = p["runner_ms"][k]
        lines.append(f"    {k:<10} {v:8.2f} ms  {100 * v / step:5.1f}%")
    if p["linears"]:
        lines.append("  the stack's GEMMs by linear (all layers; weight bytes read per second, "
                     "arithmetic rate):")
        for k, v in p["linears"].items():
            lines.append(f"    {k:<10} {v['ms']:8.2f} ms  {v['gb_s']:6.1f} GB/s "
                         f"{v['gflop_s']:7.1f} GFLOP/s")
    return "\n".join(lines)


def torch_threads() -> int:
    return torch.get_num_threads()
