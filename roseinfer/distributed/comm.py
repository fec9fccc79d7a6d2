"""The ranks' communicator: explicit process groups over one TCPStore, no global state.

``torch.distributed.init_process_group`` keeps one default group per process; an
engine instead owns its groups, so several engines (and pytest's many) live in one
process.  Rank 0 runs the ``TCPStore`` server (``Rendezvous.serve``: a free port on
127.0.0.1 unless ``distributed_init_method`` names one, listening on that address only,
never on every interface); the other ranks connect to it.  Gloo's pairs listen on the
same address (rank 0 and the workers it starts) or the joining host's own.  Everything
the ranks exchange through the store, gloo's addresses included, is signed with the
group's secret (``auth.SignedStore``); tensors travel as raw bytes, never pickled.

Two groups on it:

* ``cpu``: gloo, for the step messages (int64 tensors on the CPU) - on CUDA too, since
  an idle worker waits in it for the next step for as long as the engine is idle (a
  broadcast with a long per-op timeout; gloo errors at once when a peer's socket
  closes, so a dead rank 0 still ends it);
* ``device``: the activations' collectives - the same gloo group on CPU, NCCL on CUDA.

Every collective but that idle wait is bounded by ``distributed_timeout_s``; after a
timeout gloo closes the pair, so any failure is final (the engine stops).

Sums on the CPU are exchanges of point-to-point messages: every rank sends its partial
sum to every other and adds all of them in rank order, so the result is bitwise the
same on every rank and row-local (a ring all-reduce's order would depend on the
buffer's size, i.e. on the batch).  It is also cheaper here: in a tight loop gloo's
all-reduce of a decode step's [1, 576] took ~2 ms on 2 cores, a send/recv pair ~0.15 ms;
between layers' compute both pay ~1 ms of gloo's thread wake-ups (docs/scaling-out.md, Tensor
parallel).  NCCL's all-reduce is used as it is on CUDA (identical on every rank; batch
invariance is not promised off the CPU kernels).  The logits' vocabulary columns reach
rank 0 by point-to-point messages too.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from roseinfer.config import parse_init_method
from roseinfer.distributed.auth import SignedStore

IDLE_TIMEOUT = datetime.timedelta(days=3650)  # a worker waiting for the next step
_SUM_TAG, _GATHER_TAG = 1, 2  # point-to-point message tags


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCPStore address."""

    host: str
    port: int  # 0 until rank 0's store has bound one

    @classmethod
    def from_init_method(cls, method: str | None) -> Rendezvous:
        if method is None:
            return cls("127.0.0.1", 0)
        host, port = parse_init_method(method)
        return cls(host, port)

    def serve(self, size: int, timeout_s: float) -> tuple[dist.TCPStore, Rendezvous]:
        """Rank 0: start the store, listening on ``host`` only (torch's own listener
        would take every interface); returns it and the address with its actual port."""
        listener = listen_socket(self.host, self.port)
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns it from here
        try:
            store = dist.TCPStore(self.host, port, size, True,
                                  timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        return store, Rendezvous(self.host, port)

    def connect(self, size: int | None, timeout_s: float) -> dist.TCPStore:
        """Ranks 1..: a client of rank 0's store."""
        return dist.TCPStore(self.host, self.port, size, False,
                             timeout=datetime.timedelta(seconds=timeout_s))


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` (its first address) and listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (a worker joining from another
    host listens there); loopback stays loopback."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((host, port))
        return probe.getsockname()[0]


class Communicator:
    """One rank's view of the tensor-parallel group (all collectives go through it)."""

    def __init__(self, store: SignedStore, rendezvous: Rendezvous, rank: int, size: int,
                 device: torch.device, timeout_s: float, bind_host: str | None = None) -> None:
        """``bind_host``: the address this rank's gloo pairs listen on (default: the
        rendezvous host, which is this host for rank 0 and the workers it starts)."""
        self.rank, self.size, self.device = rank, size, device
        self.store = store  # kept alive: rank 0 serves it
        timeout = datetime.timedelta(seconds=timeout_s)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(
            hostname=bind_host or rendezvous.host)]
        # The prefix outside the signed store: a tag covers the whole key.
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp/cpu", store), rank, size, opts)
        self.dev: dist.ProcessGroup = self.cpu
        if device.type == "cuda":
            torch.cuda.set_device(device)
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            # NCCL may keep counters in its store, which cannot be signed: the raw store.
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("tp/nccl", store.inner), rank,
                                             size, nccl_opts)

    # ------------------------------------------------------------ step messages (CPU)
    def broadcast(self, tensor: Tensor, idle: bool = False) -> Tensor:
        """Rank 0's ``tensor`` (CPU) into every rank's, in place.  ``idle``: a worker
        waiting for the next step, as long as it takes."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if idle:
            opts.timeout = IDLE_TIMEOUT
        self.cpu.broadcast([tensor], opts).wait()
        return tensor

    # ------------------------------------------------------------ activations (device)
    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's ``x`` (same shape everywhere), on every rank."""
        x = x.contiguous()
        if self.dev is not self.cpu:  # NCCL
            self.dev.allreduce([x]).wait()
            return x
        parts = self._exchange(x)
        total = parts[0] + parts[1]
        for p in parts[2:]:
            total += p  # rank order, on every rank alike
        return total

    def _exchange(self, x: Tensor) -> list[Tensor]:
        """Every rank's ``x`` (same shape), by point-to-point messages."""
        peers = [r for r in range(self.size) if r != self.rank]
        parts = [x if r == self.rank else torch.empty_like(x) for r in range(self.size)]
        works = [self.cpu.recv([parts[r]], r, _SUM_TAG) for r in peers]
        works += [self.cpu.send([x], r, _SUM_TAG) for r in peers]
        for work in works:
            work.wait()
        return parts

    def gather_columns(self, x: Tensor, widths: tuple[int, ...]) -> Tensor | None:
        """Rank 0: every rank's ``x`` [R, widths[rank]] side by side -> [R, sum(widths)];
        the other ranks (which send theirs): None."""
        x = x.contiguous()
        if self.rank != 0:
            self.dev.send([x], 0, _GATHER_TAG).wait()
            return None
        parts = [x] + [x.new_empty(x.shape[0], w) for w in widths[1:]]
        works = [self.dev.recv([parts[r]], r, _GATHER_TAG) for r in range(1, self.size)]
        for work in works:
            work.wait()
        return torch.cat(parts, dim=1)
