"""TensorParallelRunner: rank 0's drop-in for ``ModelRunner`` (same ``execute``).

``TensorParallelRunner.start`` (called by ``LLMEngine`` when ``tensor_parallel_size``
> 1):

1. reads the checkpoint's config and makes the plan - a model that cannot be split is
   a ``ValueError`` before any process starts;
2. sizes the KV pool from rank 0's shard (it has the most KV heads, so the largest
   blocks) and ``kv_cache_memory_gb`` (a per-rank budget) or ``num_kv_blocks``;
3. starts rank 0's TCPStore (on the init method's address only), publishes the
   workers' spec in it (JSON, signed with the group's secret: ``auth``, ``spec``),
   starts ranks 1..N-1 (``pool``; or the first ``distributed_local_workers`` of them,
   the others joining from other hosts with ``roseinfer tp-worker`` and the shared
   ``ROSEINFER_TP_SECRET``), loads shard 0 while they load theirs, waits until all are
   ready, joins the process groups.

``execute(scheduled)`` lays the step out exactly as ``ModelRunner`` does
(``layout_step``), broadcasts it, runs shard 0 and returns the gathered logits as
``StepLogits``.  Every failure is fatal: a dead worker (checked before each step) or
any exception during a step (a collective that errors or times out, or rank 0's own
forward, after which the workers may be inside a collective) marks the runner failed,
kills the workers and raises ``TensorParallelError`` / ``WorkerDiedError`` (both
``ModelFailedError``: the engine is dead, nothing is bisected or retried).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from roseinfer.config import EngineConfig
from roseinfer.distributed.auth import (
    SECRET_ENV,
    SignedStore,
    check_secret,
    digest,
    new_secret,
)
from roseinfer.distributed.comm import Communicator, Rendezvous
from roseinfer.distributed.errors import TensorParallelError, WorkerDiedError
from roseinfer.distributed.layers import parallelize
from roseinfer.distributed.plan import TensorParallelPlan, make_plan
from roseinfer.distributed.pool import WorkerPool
from roseinfer.distributed.shard import load_shard
from roseinfer.distributed.spec import SPEC_VERSION, WorkerSpec
from roseinfer.distributed.step import ShardExecutor, StepMessage
from roseinfer.distributed.worker import SPEC_KEY, STARTUP_TIMEOUT_S
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.model.loader import load_checkpoint
from roseinfer.runner.errors import describe
from roseinfer.runner.model_runner import StepLogits, layout_step, num_kv_blocks

logger = logging.getLogger("roseinfer.distributed")


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group: shard 0, the KV pool of its heads, the workers."""

    def __init__(self, plan: TensorParallelPlan, executor: ShardExecutor, pool: WorkerPool,
                 source: Path, num_blocks: int) -> None:
        self.plan = plan
        self.config = plan.config  # the whole model's (vocabulary, limits)
        self.executor = executor
        self.model = executor.model  # shard 0 (with its collectives)
        self.num_blocks = num_blocks
        self.source = source  # where the tokenizer is
        self.pool = pool
        self._failure: TensorParallelError | None = None

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype,
              quantization: str, kv_dtype: torch.dtype) -> TensorParallelRunner:
        size = config.tensor_parallel_size
        ckpt = load_checkpoint(config.model)
        plan = make_plan(ckpt.config, size, quantization)  # ValueError: nothing started yet
        if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} on {device} needs "
                             f"{(device.index or 0) + size} CUDA devices, "
                             f"{torch.cuda.device_count()} present")
        num_blocks = num_kv_blocks(config, plan.rank_config(0), kv_dtype, device=device)
        local = size - 1 if config.distributed_local_workers is None else \
            config.distributed_local_workers
        secret = group_secret(remote=local < size - 1)
        raw, rendezvous = Rendezvous.from_init_method(config.distributed_init_method).serve(
            size, STARTUP_TIMEOUT_S)
        store = SignedStore(raw, secret)
        spec = WorkerSpec(
            version=SPEC_VERSION, model=None if config.model is None else str(config.model),
            size=size, shards=WorkerSpec.shard_rows(plan), host=rendezvous.host,
            port=rendezvous.port, dtype=_dtype_name(dtype), device=str(device),
            quantization=quantization, kv_dtype=_dtype_name(kv_dtype),
            block_size=config.block_size, num_blocks=num_blocks,
            num_threads=config.resolved_num_threads(),
            timeout_s=float(config.distributed_timeout_s))
        text = spec.to_json()
        store.set(SPEC_KEY, text)
        pool = WorkerPool.start(f"tcp://{_url_host(rendezvous.host)}:{rendezvous.port}",
                                rendezvous.host, secret, size, local)
        try:
            model = load_shard(config.model, plan, 0, dtype, device, quantization)
            pool.wait_ready(store, digest(text), STARTUP_TIMEOUT_S)
            comm = Communicator(store, rendezvous, 0, size, device, config.distributed_timeout_s)
            parallelize(model, plan.shards[0], comm)
            executor = ShardExecutor(model, plan.rank_config(0), plan.vocab_sizes, comm,
                                     num_blocks, config.block_size, kv_dtype, device)
        except BaseException:
            pool.mark_failed()
            pool.close()
            raise
        pool.attach(executor.stop_workers)
        logger.info("tensor parallel: %d ranks (%s), rank 0 holds query heads %s, KV heads %s",
                    size, "nccl" if device.type == "cuda" else "gloo",
                    plan.shards[0].q_heads, plan.shards[0].kv_heads)
        return cls(plan, executor, pool, ckpt.source, num_blocks)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.executor.kv_caches

    @property
    def failure(self) -> BaseException | None:
        """Why this engine can no longer run (a failed step, a worker that exited, a
        shutdown); None while it can.  Cheap, from any thread (``/health``)."""
        if self._failure is None:
            dead = self.pool.dead()
            if dead:
                return WorkerDiedError(f"tensor-parallel worker {', '.join(dead)} has exited")
        return self._failure

    def execute(self, scheduled: list[ScheduledRequest], greedy: bool = False) -> StepLogits:
        """The step over every rank (``greedy`` is ModelRunner's hint: full logits here)."""
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        try:
            self.pool.check()
        except WorkerDiedError as exc:
            self._fail(exc)
            raise
        layout = layout_step(scheduled)
        prompt = layout.prompt_ranges
        rows = layout.sample_rows + [r for a, b in prompt.values() for r in range(a, b)]
        try:
            with self.pool.lock:
                logits = self.executor.lead(StepMessage(layout.token_ids, layout.seqs, rows))
        except BaseException as exc:  # the ranks are out of step now, whatever it was
            dead = self.pool.dead(timeout=1.0)  # a closed socket: usually a rank that died
            error: TensorParallelError = (
                WorkerDiedError(f"tensor-parallel worker {', '.join(dead)} has exited "
                                f"({describe(exc)})") if dead else
                TensorParallelError(f"a tensor-parallel step failed, the engine stops: "
                                    f"{describe(exc)}"))
            self._fail(error)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: as they are
            raise error from exc
        num_sample = len(layout.sample_rows)
        prompt_logits, start = {}, num_sample
        for i, (a, b) in prompt.items():
            prompt_logits[i] = logits[start:start + b - a]
            start += b - a
        return StepLogits(logits[:num_sample], prompt_logits)

    def _fail(self, error: TensorParallelError) -> None:
        logger.error("%s", error)
        self._failure = error
        self.pool.mark_failed()
        self.pool.close()  # the survivors may sit in a collective: they are killed

    def shutdown(self) -> None:
        """Stop the workers (idempotent): ``STOP`` when idle and healthy, else killed."""
        if self._failure is None:
            self._failure = TensorParallelError("the tensor-parallel engine was shut down")
        self.pool.close()


def group_secret(remote: bool) -> str:
    """A fresh secret per engine; with ranks on other hosts, the operator's shared one
    (``ROSEINFER_TP_SECRET``, which they also give each ``roseinfer tp-worker``)."""
    if not remote:
        return new_secret()
    secret = os.environ.get(SECRET_ENV)
    if secret is None:
        raise ValueError(f"ranks on other hosts (distributed_local_workers < "
                         f"tensor_parallel_size - 1) need a shared secret: set {SECRET_ENV} "
                         "here and for each `roseinfer tp-worker` (e.g. python -c 'import "
                         "secrets; print(secrets.token_hex(32))')")
    return check_secret(secret, SECRET_ENV)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
