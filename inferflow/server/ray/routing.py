"""Prefix-cache-aware routing of the ingress -> engine hop (a Ray Serve ``RequestRouter``).

The prefix cache of a replica holds the KV of the full blocks of the prompts it ran, keyed by
chained block hashes. The router keys prompts the same way, on their token ids (what the cache
keys, after the chat template): the hash of each full ``BLOCK``-token prefix. A request goes to
the replica that last ran the longest of its prefixes, unless that replica has
``imbalance_threshold`` more requests in flight than the least loaded candidate; without a known
prefix (or when imbalanced) it is the power of two choices, as Ray Serve's default router
(``routing=power_of_two`` is this router without the prefix affinity).

A call whose first argument is a ``ReplicaProbe`` goes to the replica it names and nowhere else:
the ingress probes each engine replica through the request path (readiness) and sends LoRA
loads to every replica of a model this way.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from inferflow.server.messages import SubmitRequest

BLOCK = 16  # tokens per hashed prefix block (default; the host passes the cache's block size)
MAX_PREFIXES = 65536  # remembered prefix hashes (least recently routed forgotten first)


@dataclass(frozen=True)
class ReplicaProbe:
    """Route this call to the engine replica ``replica_id`` (Serve's ``unique_id``); None: any
    replica (a warm-up call that makes a scaled-to-zero deployment start one)."""

    replica_id: str | None = None


MISROUTED = "misrouted control call"  # in the error text the ingress sees (a RayTaskError)


class Misrouted(RuntimeError):
    """A call carrying a ``ReplicaProbe`` reached a replica other than the one it names (Serve's
    router does not always keep the replica ours chose: seen with two concurrent calls); the
    replica refuses it before touching anything and the ingress sends it again."""


def replica_key(replica: Any) -> str:
    """The ``unique_id`` of a router's ``RunningReplica`` (what replicas report themselves as)."""
    rid = replica.replica_id
    return str(getattr(rid, "unique_id", rid))


def prefix_hashes(token_ids: list[int], block: int = BLOCK) -> list[bytes]:
    """Chained hashes of each full ``block``-token prefix, shortest first."""
    out: list[bytes] = []
    parent = b""
    for end in range(block, len(token_ids) + 1, block):
        chunk = ",".join(map(str, token_ids[end - block : end])).encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    # no FIFOMixin: it would hand the replica chosen for one request's prefix to the oldest
    # pending request instead (Ray's own PrefixCacheAffinityRouter leaves it out too)
    """Power of two choices, preferring the replica that holds the request's longest prefix."""

    def initialize_state(
        self,
        imbalance_threshold: int = 8,
        block_size: int = BLOCK,
        prefix_affinity: bool = True,
        **kwargs: Any,
    ) -> None:
        self.imbalance_threshold, self.block_size = imbalance_threshold, block_size
        self.prefix_affinity = prefix_affinity
        self._holder: OrderedDict[bytes, Any] = OrderedDict()  # prefix hash -> ReplicaID

    def _hashes(self, pending_request: Any) -> list[bytes]:
        args = getattr(pending_request, "args", None) or ()
        request = args[0] if args else None
        if not isinstance(request, SubmitRequest) or not self.prefix_affinity:
            return []
        return prefix_hashes(list(request.prompt_token_ids), self.block_size)

    async def choose_replicas(
        self, candidate_replicas: list[Any], pending_request: Any = None
    ) -> list[list[Any]]:
        args = getattr(pending_request, "args", None) or ()
        if args and isinstance(args[0], ReplicaProbe) and args[0].replica_id is not None:
            # only the named replica; none while this router does not know it yet (the caller
            # bounds the wait)
            return [[r for r in candidate_replicas if replica_key(r) == args[0].replica_id]]
        hashes = self._hashes(pending_request) if pending_request is not None else []
        by_id = {r.replica_id: r for r in candidate_replicas}
        for h in reversed(hashes):  # the longest known prefix first
            holder = self._holder.get(h)
            if holder is None or holder not in by_id:
                continue
            if self._balanced(by_id[holder], candidate_replicas):
                # the holder first; if it refuses (full), the power of two choices among the rest
                others = [r for r in candidate_replicas if r.replica_id != holder]
                return [
                    [by_id[holder]],
                    *([random.sample(others, min(2, len(others)))] if others else []),
                ]
            break
        # power of two choices: the router takes the less loaded of the two
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def _balanced(self, holder: Any, candidates: list[Any]) -> bool:
        """The holder is neither full nor ``imbalance_threshold`` busier than the least loaded."""
        cache = self.replica_queue_len_cache
        lens = {r.replica_id: cache.get(r.replica_id) for r in candidates}
        known = [n for n in lens.values() if n is not None]
        mine = lens.get(holder.replica_id)
        if mine is None or not known:
            return True  # nothing known about the load: keep the affinity
        if mine >= holder.max_ongoing_requests:
            return False
        return mine - min(known) <= self.imbalance_threshold

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        for h in self._hashes(pending_request):
            self._holder[h] = replica_id
            self._holder.move_to_end(h)
        while len(self._holder) > MAX_PREFIXES:
            self._holder.popitem(last=False)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, r in self._holder.items() if r == replica_id]:
            del self._holder[h]
