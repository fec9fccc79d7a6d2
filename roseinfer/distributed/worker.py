"""A tensor-parallel worker process (ranks 1..N-1): load the shard, then follow rank 0.

Every worker is ``roseinfer tp-worker`` (``join_main``): rank 0 starts its local ones as
``python -m roseinfer.cli tp-worker ... --parent-pid <its pid>`` (``pool``: a fresh
interpreter that never imports the user's ``__main__``), the other hosts by hand.  The
group's secret comes from the environment (``ROSEINFER_TP_SECRET``) or ``--secret-file``,
never the command line.  The start-up handshake goes through rank 0's store, every value
signed (``auth.SignedStore``):

1. connect to the store, read ``tp/spec`` - a signed, versioned JSON document, checked
   field by field (``spec.WorkerSpec``); anything else is refused before it is used;
2. load this rank's shard (``shard.load_shard``; the plan made again from this host's
   checkpoint and checked against rank 0's);
3. ``ready/<rank>`` naming the spec it read (its SHA-256) - or ``error/<rank>`` with the
   traceback, then exit 1;
4. on rank 0's ``go`` (every rank is ready), join the process groups, add the
   collectives, allocate this rank's KV pool (``spec.num_blocks``, rank 0's choice);
5. run steps until ``STOP``.

A local worker never outlives rank 0: a collective with a closed peer errors at once,
and a watchdog thread exits when the parent process is gone (e.g. while still loading;
not ``PR_SET_PDEATHSIG``, which fires when the parent *thread* that started the worker
ends).  It ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and rank
0 decides when its workers stop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import torch

from roseinfer.distributed.auth import SignedStore, StoreAuthError, digest, read_secret
from roseinfer.distributed.comm import Communicator, Rendezvous, local_address_towards
from roseinfer.distributed.layers import parallelize
from roseinfer.distributed.shard import load_shard
from roseinfer.distributed.spec import WorkerSpec, plan_for
from roseinfer.distributed.step import ShardExecutor

logger = logging.getLogger("roseinfer.distributed")

STARTUP_TIMEOUT_S = 600.0  # loading a shard (the store's client timeout meanwhile)
SPEC_KEY = "tp/spec"
MAX_ERROR_CHARS = 8000  # of a worker's traceback in error/<rank>


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or cuda:<index of ``device`` + rank>."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def join_main(init_method: str, rank: int, bind_host: str | None = None,
              num_threads: int | None = None, secret_file: str | None = None,
              parent_pid: int | None = None) -> int:
    """``roseinfer tp-worker``: rank ``rank`` of the group whose rank 0 listens at
    ``init_method`` (``tcp://HOST:PORT``).  The spec (model path, plan, formats) comes
    from rank 0's store; the model path must exist here too. ``bind_host``: this host's
    address for the group (default: the one on the route to rank 0). ``parent_pid``: a
    worker rank 0 started itself (exits with it). Returns 0 once rank 0 stops the group."""
    if parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="roseinfer-tp-watchdog").start()
    secret = read_secret(secret_file)
    rendezvous = Rendezvous.from_init_method(init_method)
    raw = rendezvous.connect(None, STARTUP_TIMEOUT_S)
    store = SignedStore(raw, secret)
    try:
        text = store.get(SPEC_KEY).decode()  # waits for rank 0
    except StoreAuthError as exc:  # say so to rank 0 (unsigned: it refuses it as such)
        raw.set(f"error/{rank}", f"rank {rank} refused the spec: {exc}")
        raise
    spec = WorkerSpec.from_json(text)
    spec.check_rank(rank)
    host = bind_host or local_address_towards(rendezvous.host, rendezvous.port)
    _serve(spec, digest(text), rank, store, host, num_threads or spec.num_threads)
    return 0


def _serve(spec: WorkerSpec, spec_digest: str, rank: int, store: SignedStore, bind_host: str,
           num_threads: int) -> None:
    """Load this rank's shard, report ready, join the groups, follow rank 0's steps."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    torch.set_num_threads(num_threads)
    device = rank_device(spec.device, rank)
    try:
        plan = plan_for(spec)
        model = load_shard(spec.model, plan, rank, spec.torch_dtype, device, spec.quantization)
    except BaseException as exc:
        why = "".join(traceback.format_exception(exc))[-MAX_ERROR_CHARS:]
        store.set_json(f"error/{rank}", {"rank": rank, "spec": spec_digest, "error": why})
        raise
    store.set_json(f"ready/{rank}", {"rank": rank, "spec": spec_digest})
    store.wait(["go"])  # every rank is ready: join the groups together
    if store.get_json("go") != {"spec": spec_digest}:
        raise StoreAuthError("rank 0's 'go' names another spec than the one this rank read")
    rendezvous = Rendezvous(spec.host, spec.port)
    comm = Communicator(store, rendezvous, rank, spec.size, device, spec.timeout_s, bind_host)
    parallelize(model, plan.shards[rank], comm)
    executor = ShardExecutor(model, plan.rank_config(rank), plan.vocab_sizes, comm,
                             spec.num_blocks, spec.block_size, spec.torch_kv_dtype, device)
    try:
        while executor.follow():
            pass
    except Exception:
        logger.exception("tensor-parallel rank %d failed; exiting", rank)
        os._exit(1)  # no cleanup that could wait on a peer


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # rank 0 is gone
        time.sleep(0.5)
