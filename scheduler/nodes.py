"""The router's picture of node roles and load, between engine reports.

Engines report load now and then (``POST /v1/nodes``); in between, the router must not route
a burst of requests to the node that looked idle a second ago. So, like Mooncake's Conductor,
it books every accepted decision against the chosen nodes: a prefill node's backlog grows by
the predicted prefill time and drains in real time; a decode node's load is the requests
assigned over a sliding window divided by what the node decodes in that window
(``decode_rate_rps`` from the profile). A report overwrites the estimate; the decode requests
it says are on their way (``decode_waiting``: held by the engine, no KV blocks yet, so not in
its reported load) stay booked. Pure state over an explicit clock; no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal

from xdc.scheduler.policy import ClusterView, NodeLoad
from xdc.scheduler.profile import PD_CLUSTER

Role = Literal["prefill", "decode"]
MAX_NODES: Final = 4096


@dataclass(slots=True)
class NodeState:
    name: str
    cluster: str
    role: Role
    healthy: bool = True
    busy_until: float = 0.0
    pending: deque[float] = field(default_factory=deque)  # booked finish times, FIFO
    # a report's backlog: ``reported_depth`` requests finishing evenly over ``reported_span``
    # seconds from ``reported_from`` (a count, not a timestamp each: a report may say 10^6)
    reported_depth: int = 0
    reported_from: float = 0.0
    reported_span: float = 0.0
    decode_arrivals: deque[float] = field(default_factory=deque)
    decode_base: float = 0.0  # reported decode load, fading over the window
    decode_base_at: float = 0.0
    decode_waiting: int = 0  # reported decodes whose KV is on its way, booked at the report
    decode_waiting_at: float = 0.0
    work_log: deque[tuple[float, float]] = field(default_factory=deque)  # (time, prefill s)
    reported_at: float | None = None
    placeholder: bool = False  # seeded from the plan; replaced once real nodes report
    instance: str = ""  # the engine instance this node is a role of ("" = its own)
    last_load: NodeLoad | None = None  # reused while the figures do not change (most calls)

    def queue_s(self, now: float) -> float:
        return max(self.busy_until - now, 0.0)

    def prefill_load(self, now: float) -> NodeLoad:
        q = self.busy_until - now if self.busy_until > now else 0.0
        last = self.last_load
        if last is not None and last.queue_s == q:
            return last
        last = self.last_load = NodeLoad(self.name, q, 0.0, self.instance)
        return last

    def queue_depth(self, now: float) -> int:
        while self.pending and self.pending[0] <= now:
            self.pending.popleft()
        return len(self.pending) + self._reported_left(now)

    def _reported_left(self, now: float) -> int:
        """Of the reported backlog, the requests not finished by ``now``: the i-th (1..d)
        finishes at ``from + span * i / d``."""
        d = self.reported_depth
        if d == 0:
            return 0
        if self.reported_span <= 0 or now >= self.reported_from + self.reported_span:
            self.reported_depth = 0
            return 0
        done = math.floor((now - self.reported_from) * d / self.reported_span)
        return d - done if done > 0 else d


class NodeRegistry:
    """Nodes by name with their role, booked load and reported load."""

    def __init__(self, decode_rate_rps: float, window_s: float = 60.0) -> None:
        if decode_rate_rps <= 0:
            raise ValueError("decode_rate_rps must be > 0")
        self.decode_rate_rps = decode_rate_rps
        self.window_s = window_s
        self._nodes: dict[tuple[str, str], NodeState] = {}
        # healthy nodes by (cluster, role), rebuilt when membership, role or health changes
        self._groups: tuple[dict[str, list[NodeState]], list[NodeState], list[NodeState]] | None
        self._groups = None

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> Iterable[NodeState]:
        return self._nodes.values()

    def get(self, cluster: str, name: str) -> NodeState | None:
        return self._nodes.get((cluster, name))

    def seed(self, prfaas: int | Iterable[tuple[str, int]], n_p: int, n_d: int) -> None:
        """Placeholder nodes named after the plan, so a router no engine has reported to yet
        still routes (demos, benchmarks). The first real report from a cluster removes that
        cluster's placeholders, unless it reuses a placeholder's name. ``prfaas`` is the
        instance count of the one cluster ``prfaas`` or ``(cluster, count)`` pairs; nodes are
        named ``{cluster}-{i}``."""
        fleet = [("prfaas", prfaas)] if isinstance(prfaas, int) else list(prfaas)
        for cluster, n in fleet:
            for i in range(n):
                self.upsert(cluster, f"{cluster}-{i}", "prefill").placeholder = True
        for i in range(n_p + n_d):
            self.upsert(
                PD_CLUSTER, f"pd-{i}", "prefill" if i < n_p else "decode"
            ).placeholder = True

    def upsert(
        self,
        cluster: str,
        name: str,
        role: Role,
        *,
        now: float | None = None,
        queue_s: float | None = None,
        queue_depth: int | None = None,
        decode_load: float | None = None,
        healthy: bool | None = None,
        instance: str | None = None,
        decode_waiting: int | None = None,
    ) -> NodeState:
        key = (cluster, name)
        node = self._nodes.get(key)
        if node is None:
            if len(self._nodes) >= MAX_NODES:
                raise ValueError(f"node registry is full ({MAX_NODES} nodes)")
            if cluster != PD_CLUSTER and role != "prefill":
                raise ValueError(f"{name}: PrfaaS nodes only prefill")
            node = NodeState(name, cluster, role)
            self._nodes[key] = node
            self._groups = None
        elif cluster != PD_CLUSTER and role != "prefill":
            raise ValueError(f"{name}: PrfaaS nodes only prefill")
        if node.role != role:
            node.role = role
            node.last_load = None
            self._groups = None
        if instance is not None and instance != node.instance:
            node.instance = instance
            node.last_load = None
        if healthy is not None and healthy != node.healthy:
            self._groups = None
            node.healthy = healthy
        if now is not None:  # a real report, not seeding
            node.placeholder = False
            for k in [k for k, n in self._nodes.items() if n.placeholder and n.cluster == cluster]:
                del self._nodes[k]
                self._groups = None
            node.reported_at = now
            if queue_s is not None:
                node.busy_until = now + queue_s
                # the engine's own backlog replaces our bookings: no request counted twice
                node.pending.clear()
                node.reported_depth = (
                    queue_depth if queue_depth is not None else (1 if queue_s > 0 else 0)
                )
                node.reported_from, node.reported_span = now, queue_s
            if decode_load is not None:
                node.decode_base = decode_load
                node.decode_base_at = now
            if decode_load is not None or decode_waiting is not None:
                # the engine's own figures replace our bookings: no request counted twice
                node.decode_arrivals.clear()
                node.decode_waiting = decode_waiting or 0
                node.decode_waiting_at = now
        return node

    def remove(self, cluster: str, name: str) -> bool:
        self._groups = None
        return self._nodes.pop((cluster, name), None) is not None

    def decode_load(self, node: NodeState, now: float) -> float:
        cutoff = now - self.window_s
        arr = node.decode_arrivals
        while arr and arr[0] <= cutoff:
            arr.popleft()
        waiting = node.decode_waiting if node.decode_waiting_at > cutoff else 0
        booked = (len(arr) + waiting) / (self.decode_rate_rps * self.window_s)
        if not node.decode_base:
            return booked
        fade = max(1.0 - (now - node.decode_base_at) / self.window_s, 0.0)
        return node.decode_base * fade + booked

    def _grouped(
        self,
    ) -> tuple[dict[str, list[NodeState]], list[NodeState], list[NodeState]]:
        g = self._groups
        if g is None:
            prfaas: dict[str, list[NodeState]] = {}
            pd_p: list[NodeState] = []
            pd_d: list[NodeState] = []
            for n in self._nodes.values():
                if not n.healthy:
                    continue
                if n.cluster != PD_CLUSTER:
                    prfaas.setdefault(n.cluster, []).append(n)
                elif n.role == "prefill":
                    pd_p.append(n)
                else:
                    pd_d.append(n)
            g = self._groups = (prfaas, pd_p, pd_d)
        return g

    def view(self, now: float) -> ClusterView:
        """The nodes' loads at ``now`` (built per routing decision: NodeLoad tuples are reused
        while a node's figures do not change, which an idle node's never do)."""
        prfaas, pd_p, pd_d = self._grouped()
        depth = 0
        by_cluster: dict[str, tuple[NodeLoad, ...]] = {}
        all_prfaas: list[NodeLoad] = []
        for cluster, nodes in prfaas.items():
            loads = tuple([n.prefill_load(now) for n in nodes])
            by_cluster[cluster] = loads
            all_prfaas.extend(loads)
            for n in nodes:
                if n.pending or n.reported_depth:
                    depth += n.queue_depth(now)
        decode: list[NodeLoad] = []
        for n in pd_d:
            load = self.decode_load(n, now)
            last = n.last_load
            if last is None or last.load != load:
                last = n.last_load = NodeLoad(n.name, 0.0, load, n.instance)
            decode.append(last)
        return ClusterView(
            tuple(all_prfaas),
            tuple([n.prefill_load(now) for n in pd_p]),
            tuple(decode),
            depth,
            by_cluster,
        )

    def book(
        self,
        target: str,
        prefill_node: str | None,
        decode_node: str | None,
        prefill_s: float,
        now: float,
    ) -> None:
        """Count an accepted decision against the chosen nodes."""
        if prefill_node is not None:
            n = self._nodes.get((target, prefill_node))
            if n is not None:
                n.busy_until = max(n.busy_until, now) + prefill_s
                n.pending.append(n.busy_until)
                n.work_log.append((now, prefill_s))
        if decode_node is not None:
            d = self._nodes.get((PD_CLUSTER, decode_node))
            if d is not None:
                d.decode_arrivals.append(now)

    def utilisation(self, now: float) -> dict[str, float]:
        """Booked busy fraction per stage over the window (prefill) and mean decode load."""
        cutoff = now - self.window_s
        work = {"prfaas": 0.0, "pd_prefill": 0.0}
        count = {"prfaas": 0, "pd_prefill": 0}
        dec: list[float] = []
        for n in self._nodes.values():
            if not n.healthy:
                continue
            if n.role == "decode":
                dec.append(self.decode_load(n, now))
                continue
            while n.work_log and n.work_log[0][0] <= cutoff:
                n.work_log.popleft()
            stage = "pd_prefill" if n.cluster == PD_CLUSTER else "prfaas"
            work[stage] += sum(s for _, s in n.work_log)
            count[stage] += 1
        return {
            "prfaas": work["prfaas"] / (self.window_s * count["prfaas"])
            if count["prfaas"]
            else 0.0,
            "pd_prefill": (
                work["pd_prefill"] / (self.window_s * count["pd_prefill"])
                if count["pd_prefill"]
                else 0.0
            ),
            "pd_decode": sum(dec) / len(dec) if dec else 0.0,
        }

    def roles(self) -> dict[str, Role]:
        """PD node name -> role; what the long-term planner re-balances."""
        return {n.name: n.role for n in self._nodes.values() if n.cluster == PD_CLUSTER}

    def counts(self) -> tuple[int, int, int]:
        """Healthy (n_prfaas, n_p, n_d)."""
        f = p = d = 0
        for n in self._nodes.values():
            if not n.healthy:
                continue
            if n.cluster != PD_CLUSTER:
                f += 1
            elif n.role == "prefill":
                p += 1
            else:
                d += 1
        return f, p, d

    def prfaas_counts(self) -> dict[str, int]:
        """Healthy PrfaaS nodes per cluster."""
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.healthy and n.cluster != PD_CLUSTER:
                out[n.cluster] = out.get(n.cluster, 0) + 1
        return out

    def snapshot(self, now: float) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for n in sorted(self._nodes.values(), key=lambda x: (x.cluster, x.name)):
            row: dict[str, object] = {
                "name": n.name,
                "cluster": n.cluster,
                "role": n.role,
                "healthy": n.healthy,
            }
            if n.instance:
                row["instance"] = n.instance
            if n.role == "prefill":
                row["queue_s"] = round(n.queue_s(now), 6)
                row["queue_depth"] = n.queue_depth(now)
            else:
                row["decode_load"] = round(self.decode_load(n, now), 6)
            out.append(row)
        return out
