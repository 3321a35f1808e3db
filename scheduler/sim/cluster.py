"""Simulated instances and prefix caches for the replay simulator.

Prefill instances are FIFO single servers: one prefill at a time (an instance's GPUs work on
one long prompt together), service time from the profile's curve for the uncached length.

Decode instances are batch servers with ``slots`` concurrent requests, each holding its slot
for ``output_tokens * tpot_s`` seconds. The profile carries only the product, the per-instance
rate ``decode_rate_rps = BS_max / (T_decode * L_out)`` of eq. (5); the simulator takes a
per-token time (default 25 ms, the paper's 40 tokens/s SLO), sets
``slots = round(decode_rate_rps * L_out * tpot)`` (20 on the case study, the BS_max its
profile derives) and then rescales the per-token time to ``slots / (decode_rate_rps * L_out)``
so an instance decodes exactly ``decode_rate_rps`` requests/s of the profile's output length.
Requests with other output lengths (traces) hold a slot proportionally longer or shorter.

Each cluster's prefix cache is a ``PrefixIndex`` (the router's own index) fed with "stored"
events for every block a prefill computes, bounded by the cluster's capacity in blocks (LRU).
A cluster pools its nodes' caches (Mooncake store over RDMA), so a hit anywhere in the cluster
counts; the cache a request uses is the one of the cluster it prefills in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from xdc.scheduler.cacheindex import CLUSTERS, CacheEvent, Cluster, PrefixIndex, PrefixMatch
from xdc.scheduler.profile import InstanceProfile


@dataclass(slots=True, eq=False)
class PrefillServer:
    """One prefill instance and its FIFO queue of request ids."""

    name: str
    cluster: Cluster
    inst: InstanceProfile
    queue: deque[tuple[int, float]] = field(default_factory=deque)  # (rid, service s)
    busy_rid: int = -1
    busy_end: float = 0.0
    queued_work: float = 0.0
    busy_time: float = 0.0  # total service time started, for utilisation

    def queue_s(self, now: float) -> float:
        """Seconds until a prefill enqueued now would start: the router's ``queue_s``."""
        ahead = max(self.busy_end - now, 0.0) if self.busy_rid >= 0 else 0.0
        return ahead + self.queued_work

    def depth(self) -> int:
        """Requests waiting or in service."""
        return len(self.queue) + (1 if self.busy_rid >= 0 else 0)

    def enqueue(self, rid: int, service_s: float) -> None:
        self.queue.append((rid, service_s))
        self.queued_work += service_s

    def start_next(self, now: float) -> tuple[int, float] | None:
        """Begin the head of the queue if idle; (rid, service s) of what started."""
        if self.busy_rid >= 0 or not self.queue:
            return None
        rid, service = self.queue.popleft()
        self.queued_work = max(self.queued_work - service, 0.0) if self.queue else 0.0
        self.busy_rid = rid
        self.busy_end = now + service
        self.busy_time += service
        return rid, service

    def finish(self) -> int:
        rid = self.busy_rid
        self.busy_rid = -1
        return rid


@dataclass(slots=True, eq=False)
class DecodeServer:
    """One decode instance: ``slots`` concurrent requests, a FIFO of those waiting for one.

    ``load`` is what the router books (``nodes.NodeRegistry``): requests routed here over the
    last ``window_s`` divided by what the instance decodes in that window. It counts a request
    from the moment it is routed, so a burst of arrivals is spread over the instances instead
    of herding onto the one that looked idle; and it does not count requests still waiting
    in a prefill queue as decode load, which would turn prefill congestion into rejections.
    """

    name: str
    slots: int
    rate_rps: float
    window_s: float = 60.0
    active: int = 0
    inbound: int = 0  # routed here, still in prefill or transfer
    waiting: deque[int] = field(default_factory=deque)
    routed: deque[float] = field(default_factory=deque)

    def book(self, now: float) -> None:
        self.inbound += 1
        self.routed.append(now)

    def load(self, now: float) -> float:
        cutoff = now - self.window_s
        routed = self.routed
        while routed and routed[0] <= cutoff:
            routed.popleft()
        return len(routed) / (self.rate_rps * self.window_s)


def decode_slots(decode_rate_rps: float, output_tokens: float, tpot_s: float) -> int:
    """Batch slots per decode instance implied by the profile's rate and a per-token time."""
    if decode_rate_rps <= 0 or output_tokens <= 0 or tpot_s <= 0:
        raise ValueError("decode rate, output tokens and tpot must be > 0")
    return max(1, round(decode_rate_rps * output_tokens * tpot_s))


def decode_token_s(decode_rate_rps: float, output_tokens: float, slots: int) -> float:
    """Per-token decode time that makes ``slots`` slots finish ``decode_rate_rps`` req/s."""
    return slots / (decode_rate_rps * output_tokens)


class ClusterCache:
    """One cluster's prefix cache: a PrefixIndex holding only this cluster's nodes."""

    def __init__(self, cluster: Cluster, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("cache capacity must be >= 1 block")
        self.cluster: Cluster = cluster
        self.block_tokens = block_tokens
        self.index = PrefixIndex(capacity_blocks, tombstone_capacity=0, clusters=(cluster,))
        self._seq: dict[str, int] = {}

    def store(self, node: str, hashes: Sequence[int], tokens: int) -> None:
        """``node`` computed (or received) the full blocks of a ``tokens``-long prompt."""
        full = min(tokens // self.block_tokens, len(hashes))
        if full <= 0:
            return
        seq = self._seq.get(node, 0) + 1
        self._seq[node] = seq
        self.index.apply(CacheEvent("stored", self.cluster, node, seq, tuple(hashes[:full])))

    def touch(self, node: str, hashes: Sequence[int], tokens: int) -> None:
        used = -(-tokens // self.block_tokens)
        self.index.touch(self.cluster, node, hashes[:used])

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        return self.index.match(hashes)


def merged_match(caches: dict[str, ClusterCache], hashes: Sequence[int]) -> PrefixMatch:
    """One PrefixMatch over the per-cluster indexes, as the router's single index reports it."""
    if not hashes or not caches:
        return PrefixMatch.empty()
    blocks: dict[str, int] = {c: 0 for c in CLUSTERS}
    node_blocks: dict[str, dict[str, int]] = {c: {} for c in CLUSTERS}
    best: dict[str, str | None] = {c: None for c in CLUSTERS}
    for c, cache in caches.items():
        m = cache.match(hashes)
        blocks[c] = m.blocks.get(c, 0)
        node_blocks[c] = m.node_blocks.get(c, {})
        best[c] = m.best_node.get(c)
    return PrefixMatch(blocks=blocks, node_blocks=node_blocks, best_node=best)


def cached_tokens(match: PrefixMatch, cluster: str, total: int, block_tokens: int) -> int:
    return min(match.blocks.get(cluster, 0) * block_tokens, total)


__all__ = [
    "ClusterCache",
    "DecodeServer",
    "PrefillServer",
    "cached_tokens",
    "decode_slots",
    "decode_token_s",
    "merged_match",
]
