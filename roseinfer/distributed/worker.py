"""A tensor-parallel worker process (ranks 1..N-1): load the shard, then follow rank 0.

Started by rank 0 with torch.multiprocessing's spawn context (``WorkerPool``) as
``worker_main(spec, rank)``.  The start-up handshake goes through rank 0's TCPStore:

1. connect to the store, load this rank's shard (``shard.load_shard``);
2. ``ready/<rank>`` in the store - or ``error/<rank>`` with the reason, then exit 1;
3. on rank 0's ``go`` (every rank is ready), join the process groups, add the
   collectives, allocate this rank's KV pool (``spec.num_blocks``, rank 0's choice);
4. run steps until ``STOP``.

A rank on another host is started by hand (``roseinfer tp-worker``: ``join_main``)
and reads the same spec from rank 0's store (``tp/spec``), then does the same.

A worker never outlives rank 0: a collective with a closed peer errors at once, and a
watchdog thread exits when the parent process is gone (e.g. while still loading).
SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group, and rank 0
decides when its workers stop.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from roseinfer.distributed.comm import Communicator, Rendezvous
from roseinfer.distributed.layers import parallelize
from roseinfer.distributed.plan import TensorParallelPlan
from roseinfer.distributed.shard import load_shard
from roseinfer.distributed.step import ShardExecutor

logger = logging.getLogger("roseinfer.distributed")

STARTUP_TIMEOUT_S = 600.0  # loading a shard (the store's client timeout meanwhile)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs (pickled to the spawned process)."""

    model: str | None  # checkpoint path (None: the default model)
    plan: TensorParallelPlan
    rendezvous: Rendezvous  # rank 0's store, port resolved
    dtype: torch.dtype  # weights and activations
    device: str  # rank 0's device; rank r uses index + r on CUDA
    quantization: str  # resolved weight format
    kv_dtype: torch.dtype
    block_size: int
    num_blocks: int
    num_threads: int
    timeout_s: float  # bound on each collective
    parent_pid: int


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or cuda:<index of ``device`` + rank>."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def worker_main(spec: WorkerSpec, rank: int) -> None:
    """The body of worker process ``rank``, spawned by rank 0 on its host."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True,
                     name="roseinfer-tp-watchdog").start()
    store = spec.rendezvous.connect(spec.plan.size, STARTUP_TIMEOUT_S)
    _serve(spec, rank, store, spec.rendezvous.host, spec.num_threads)


def join_main(init_method: str, rank: int, bind_host: str | None = None,
              num_threads: int | None = None) -> int:
    """``roseinfer tp-worker``: rank ``rank`` started on another host, joining the
    group whose rank 0 listens at ``init_method`` (``tcp://HOST:PORT``). The spec
    (model path, plan, formats) comes from rank 0's store; the model path must exist
    here too. ``bind_host``: this host's address for the group (default: the one on the
    route to rank 0). Returns 0 once rank 0 stops the group."""
    from roseinfer.distributed.comm import local_address_towards

    rendezvous = Rendezvous.from_init_method(init_method)
    store = dist.TCPStore(rendezvous.host, rendezvous.port, None, False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    spec: WorkerSpec = pickle.loads(store.get("tp/spec"))  # waits for rank 0
    if not 1 <= rank < spec.plan.size:
        raise ValueError(f"--rank must be in [1, {spec.plan.size - 1}] for this group of "
                         f"{spec.plan.size} ranks, got {rank}")
    host = bind_host or local_address_towards(rendezvous.host, rendezvous.port)
    _serve(spec, rank, store, host, num_threads or spec.num_threads)
    return 0


def _serve(spec: WorkerSpec, rank: int, store: dist.Store, bind_host: str,
           num_threads: int) -> None:
    """Load this rank's shard, report ready, join the groups, follow rank 0's steps."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    torch.set_num_threads(num_threads)
    size = spec.plan.size
    device = rank_device(spec.device, rank)
    try:
        model = load_shard(spec.model, spec.plan, rank, spec.dtype, device,
                           spec.quantization)
    except BaseException as exc:
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{rank}", "1")
    store.wait(["go"])  # every rank is ready: join the groups together
    comm = Communicator(store, spec.rendezvous, rank, size, device, spec.timeout_s, bind_host)
    parallelize(model, spec.plan.shards[rank], comm)
    executor = ShardExecutor(model, spec.plan.rank_config(rank), spec.plan.vocab_sizes, comm,
                             spec.num_blocks, spec.block_size, spec.kv_dtype,
                             device)
    try:
        while executor.follow():
            pass
    except Exception:
        logger.exception("tensor-parallel rank %d failed; exiting", rank)
        os._exit(1)  # no cleanup that could wait on a peer


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)  # rank 0 is gone
