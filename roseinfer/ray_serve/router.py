"""``PrefixAffinityRouter``: Ray Serve's request-router hook running ``RoutingPolicy``.

Ray Serve (2.x) lets a deployment name its own ``RequestRouter`` class
(``request_router_config``); every ``DeploymentHandle`` to that deployment then asks
it which replica takes each call. The ingress's handle to the engine replicas uses
this one: ``choose_replicas`` ranks the live replicas with the policy (prefix
affinity or round-robin) from the call's ``ForwardedRequest.prefix_hashes``, and Ray
Serve does the rest (queue-length probes, ``max_ongoing_requests``, backoff, removing
dead replicas, sending the call). Each rank holds one replica, so the policy's order
is kept; a full replica is skipped for the next.

Load is the larger of two counts of calls in flight per replica: Ray Serve's own
queue-length cache (bumped as a call is sent, so a burst of calls spreads out at
once; entries go stale after 10 s) and the router's count from accepted
(``on_request_routed``) to finished (``on_request_completed``), which also covers
long streams. The policy compares them; they cover the calls this router sent (one
ingress replica sends them all). A prompt's prefix blocks become its replica's when
the replica is chosen (so a burst with a new prefix sticks together) and again when
the call is accepted (the replica that really took it).

A call with a ``replica_slot`` keyword (the ingress's per-replica stats) goes to the
slot-th replica in replica-id order.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from roseinfer.ray_serve.asgi_bridge import ForwardedRequest
from roseinfer.ray_serve.routing_policy import RoutingPolicy

SLOT_KWARG = "replica_slot"


def _prefix_hashes(request: PendingRequest | None) -> tuple[int, ...]:
    if request is None:
        return ()
    first = request.args[0] if request.args else None
    return first.prefix_hashes if isinstance(first, ForwardedRequest) else ()


def _slot(request: PendingRequest | None) -> int | None:
    if request is None:
        return None
    slot = request.kwargs.get(SLOT_KWARG)
    return slot if isinstance(slot, int) else None


class PrefixAffinityRouter(RequestRouter):
    """Prefix-cache-aware (or round-robin) choice among the engine replicas."""

    def initialize_state(self, routing: str = "prefix", imbalance_threshold: int = 4,
                         **_: Any) -> None:
        self.policy = RoutingPolicy(routing, imbalance_threshold)  # type: ignore[arg-type]
        self.loads: Counter[str] = Counter()  # replica unique id -> calls in flight
        self._in_flight: dict[str, str] = {}  # internal request id -> replica unique id

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        slot = _slot(pending_request)
        if slot is not None:
            ids = sorted(by_id)
            return [[by_id[ids[slot % len(ids)]]]]
        cache = self.replica_queue_len_cache
        loads = {rid: max(self.loads[rid], cache.get(r.replica_id) or 0)
                 for rid, r in by_id.items()}
        hashes = _prefix_hashes(pending_request)
        order = self.policy.rank(list(by_id), loads, hashes)
        self.policy.routed(order[0], hashes)  # claimed now; confirmed on acceptance
        return [[by_id[r]] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        if _slot(pending_request) is not None:
            return
        rid = replica_id.unique_id
        key = pending_request.metadata.internal_request_id
        self._release(key)  # a retry of a call whose first replica died
        self._in_flight[key] = rid
        self.loads[rid] += 1
        self.policy.routed(rid, _prefix_hashes(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._release(internal_request_id)

    def _release(self, key: str) -> None:
        rid = self._in_flight.pop(key, None)
        if rid is not None and self.loads[rid] > 0:
            self.loads[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for rid in before - {r.replica_id.unique_id for r in replicas}:
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        self.policy.forget(rid)
        self.loads.pop(rid, None)
        for key in [k for k, r in self._in_flight.items() if r == rid]:
            del self._in_flight[key]
