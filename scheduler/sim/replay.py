"""`xdc replay`'s engine: a discrete-event simulation of PrfaaS + PD clusters and their link.

Why a simulator: the throughput model (``model.py``) says what a configuration sustains in
steady state; it cannot say what queues, TTFT tails, prefix caches or a link that degrades
mid-run do to a *routing policy*. The replay runs the real router code (``policy.route``, the
threshold controller, the long-term planner, the prefix index) against simulated instances, so
a policy can be judged on the same arrivals as its alternatives, deterministically.

A request's life: arrival -> routing decision -> (optional cross-cluster prefix transfer) ->
FIFO prefill on the chosen instance -> for PrfaaS, its KV streams over the link layer by layer
while it is computed (``sim_link``), so TTFT = queueing + max(prefill, transfer) -> decode slot
on the chosen PD-D instance (waiting for one if the instance is full) -> done. PD-P to PD-D
KV moves over intra-cluster RDMA and costs nothing here, as in eq. (4). A monitor samples
the link every ``monitor_interval_s`` (utilisation, goodput, capacity, standing backlog as the
congestion signal) and hands the router a ``LinkView``, as the real monitor does over HTTP.

Time is simulated seconds; a heap orders events, ties broken by insertion order, so a run is a
pure function of its inputs (the seed only enters through the arrivals).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from xdc.scheduler.link_table import LinkView
from xdc.scheduler.planner import Plan, solve
from xdc.scheduler.policy import ClusterView, NodeLoad, PolicyParams
from xdc.scheduler.profile import Profile
from xdc.scheduler.sim.cluster import (
    ClusterCache,
    DecodeServer,
    PrefillServer,
    cached_tokens,
    decode_slots,
    decode_token_s,
    merged_match,
)
from xdc.scheduler.sim.link import FluidLink
from xdc.scheduler.sim.policies import (
    BASE_POLICIES,
    MULTI_POLICIES,
    POLICIES,
    Layout,
    PolicyName,
    Router,
    layout_for,
    make_router,
    policy_profile,
)
from xdc.scheduler.sim.replay_metrics import ReplayResult, RequestRecord, TickSample, summarise
from xdc.scheduler.sim.workload import LinkSchedule, ReplayInputError, SimRequest

from xdc.linkreport import LinkHealth

# Event kinds; the heap holds (time, seq, kind, a, b).
_LINK_CHANGE = 0
_ARRIVAL = 1
_PREFILL_DONE = 2
_DECODE_DONE = 3
_LINK_WAKE = 4
_MONITOR = 5
_REPLAN = 6
_EGRESS, _REVERSE = 0, 1  # link directions: PrfaaS -> PD (KV and cache moves), PD -> PrfaaS


@dataclass(frozen=True)
class ReplayOptions:
    """Simulation knobs; the defaults model the case study's deployment.

    ``link`` is the PrfaaS egress bandwidth over time (default: the profile's, constant); its
    value at t = 0 is the *nominal* bandwidth the plan is solved for. With several PrfaaS
    clusters, ``links`` gives a schedule per cluster (by name; others keep their configured
    egress), and ``link`` applies to the first cluster if ``links`` does not name it.
    ``params`` are the router's policy knobs (``PolicyParams()`` with ``block_size =
    block_tokens`` by default).
    The link counts as congested when its standing backlog (produced, unsent KV) would take
    ``congested_backlog_s`` to drain, and as warning at ``warn_backlog_s``.
    """

    link: LinkSchedule | None = None
    links: Mapping[str, LinkSchedule] | None = None
    monitor_interval_s: float = 1.0
    replan_interval_s: float | None = 300.0
    block_tokens: int = 512
    cache_blocks_per_instance: int = 20_000
    decode_tpot_s: float = 0.025
    params: PolicyParams | None = None
    congested_backlog_s: float = 0.5
    warn_backlog_s: float = 0.1
    base_rtt_ms: float = 1.0
    max_drain_s: float = 86_400.0

    def problems(self) -> list[str]:
        p: list[str] = []
        if not (math.isfinite(self.monitor_interval_s) and self.monitor_interval_s > 0):
            p.append("monitor interval must be > 0 s")
        if self.replan_interval_s is not None and not (
            math.isfinite(self.replan_interval_s) and self.replan_interval_s > 0
        ):
            p.append("replan interval must be > 0 s")
        if self.block_tokens < 1:
            p.append("block tokens must be >= 1")
        if self.cache_blocks_per_instance < 1:
            p.append("cache blocks per instance must be >= 1")
        if not (math.isfinite(self.decode_tpot_s) and self.decode_tpot_s > 0):
            p.append("decode time per token must be > 0")
        if not (0 < self.warn_backlog_s <= self.congested_backlog_s):
            p.append("need 0 < warn backlog <= congested backlog")
        if not self.max_drain_s > 0:
            p.append("max drain must be > 0 s")
        return p


class _Req:
    """Mutable per-request state; plain slots because there are tens of thousands."""

    __slots__ = (
        "arrival",
        "cached",
        "decode",
        "decode_start",
        "done",
        "hashes",
        "kv_bytes",
        "kv_done",
        "node",
        "out",
        "predicted",
        "prefill_end",
        "prefill_start",
        "queued_at",
        "ready",
        "rejected",
        "rid",
        "service",
        "t",
        "target",
        "total",
    )

    def __init__(self, idx: int, r: SimRequest) -> None:
        self.rid = idx  # position in arrival order; flows and events are keyed by it
        self.arrival = r.arrival_s
        self.total = max(r.input_tokens, 1)
        self.out = r.output_tokens
        self.hashes = r.hashes
        self.target = ""
        self.cached = 0
        self.kv_bytes = 0.0
        self.kv_done = False
        self.node: PrefillServer | None = None
        self.decode: DecodeServer | None = None
        self.service = 0.0
        self.queued_at = math.nan
        self.prefill_start = math.nan
        self.prefill_end = math.nan
        self.ready = math.nan
        self.decode_start = math.nan
        self.done = math.nan
        self.rejected = False
        self.predicted = math.nan
        self.t = math.nan


ProgressFn = Callable[[float, float, int, int], None]  # (sim time, fraction, done, total)


@dataclass
class _Counters:
    completed: int = 0
    rejected: int = 0
    events: int = 0
    ticks: list[TickSample] = field(default_factory=list)


class ReplaySim:
    """One policy over one list of arrivals. ``run()`` once; it returns the summary."""

    def __init__(
        self,
        profile: Profile,
        requests: Sequence[SimRequest],
        policy: PolicyName,
        options: ReplayOptions | None = None,
        *,
        plan: Plan | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        opts = options or ReplayOptions()
        problems = opts.problems()
        if policy not in POLICIES:
            problems.append(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if not requests:
            problems.append("no requests to replay")
        if problems:
            raise ReplayInputError("; ".join(problems))
        self.opts = opts
        fleet = profile.fleet
        self.schedules: dict[str, LinkSchedule] = {}
        for i, pc in enumerate(fleet):
            sched = (opts.links or {}).get(pc.name)
            if sched is None and i == 0 and opts.link is not None:
                sched = opts.link
            self.schedules[pc.name] = sched or LinkSchedule((0.0,), (pc.egress_gbps,))
        unknown = sorted(set(opts.links or {}) - set(self.schedules))
        if unknown:
            raise ReplayInputError(
                f"link schedule for {', '.join(unknown)}: not a PrfaaS cluster of the profile "
                f"({', '.join(self.schedules)})"
            )
        self.schedule = _total(self.schedules)
        # Plan and router costs assume the nominal links, as an operator would size them.
        nominal = {c: sch.at(0.0) for c, sch in self.schedules.items()}
        base = profile.with_fleet(egress_gbps=nominal)
        self.policy: PolicyName = policy
        self.profile = policy_profile(policy, base)
        own_plan = policy in MULTI_POLICIES and len(fleet) > 1
        self.plan = plan if plan is not None and not own_plan else solve(self.profile)
        self.layout: Layout = layout_for(policy, self.plan)
        self.params = opts.params or PolicyParams(block_size=opts.block_tokens)
        self.router: Router = make_router(
            policy,
            self.profile,
            self.layout,
            self.params,
            long_term=opts.replan_interval_s is not None,
        )
        self.progress = progress
        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
        self.reqs = [_Req(i, r) for i, r in enumerate(ordered)]
        lay = self.layout
        # PrfaaS servers per cluster: the profile's fleet scaled to the layout's count (the
        # naive and prfaas layouts use all of it; homogeneous none)
        counts = _spread(lay.n_prfaas, [(c.name, c.instances) for c in self.profile.fleet])
        single = len(self.profile.fleet) == 1
        self.clusters = [c.name for c in self.profile.fleet]
        self.prfaas_groups: dict[str, list[PrefillServer]] = {
            c: [
                PrefillServer(f"prfaas-{i}" if single else f"{c}-{i}", c, self.profile.prfaas)
                for i in range(counts[c])
            ]
            for c in self.clusters
        }
        self.prfaas = [n for c in self.clusters for n in self.prfaas_groups[c]]
        self.pd_prefill = [PrefillServer(f"pd-{i}", "pd", self.profile.pd) for i in range(lay.n_p)]
        out_tokens = self.profile.workload.output_tokens
        rate = self.profile.pd.decode_rate_rps
        slots = decode_slots(rate, out_tokens, opts.decode_tpot_s)
        self.token_s = decode_token_s(rate, out_tokens, slots)
        # The booked decode load counts requests, so it needs requests/s per instance for
        # *these* requests: a trace with short outputs decodes many more per second than the
        # profile's L_out implies (same slots, same per-token time).
        mean_out = max(sum(r.output_tokens for r in requests) / len(requests), 1.0)
        booked_rate = slots / (self.token_s * mean_out)
        self.decoders = [
            DecodeServer(f"pd-{lay.n_p + j}", slots, booked_rate) for j in range(lay.n_d)
        ]
        self.prefill_by_name = {(n.cluster, n.name): n for n in self.prfaas + self.pd_prefill}
        self.node_index = {
            id(n): (ci, i)
            for ci, c in enumerate(self.clusters)
            for i, n in enumerate(self.prfaas_groups[c])
        }
        self.node_index.update(
            {id(n): (len(self.clusters), i) for i, n in enumerate(self.pd_prefill)}
        )
        self.decode_by_name = {d.name: d for d in self.decoders}
        self.caches: dict[str, ClusterCache] = {}
        per = opts.cache_blocks_per_instance
        for c in self.clusters:
            if self.prfaas_groups[c]:
                self.caches[c] = ClusterCache(
                    c, per * len(self.prfaas_groups[c]), opts.block_tokens
                )
        if lay.n_p:
            self.caches["pd"] = ClusterCache("pd", per * lay.n_p, opts.block_tokens)
        # two directions per PrfaaS cluster's link: index 2*ci + _EGRESS / _REVERSE
        self.links: list[FluidLink] = []
        for c in self.clusters:
            bps = self.schedules[c].at(0.0) * 1e9 if self.prfaas_groups[c] else 0.0
            self.links += [FluidLink(bps), FluidLink(bps)]
        self._link_version = [0] * len(self.links)
        self.link_states: dict[str, LinkView | None] = dict.fromkeys(self.clusters)
        self._tick = [(0.0, 0.0)] * len(self.clusters)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._live = 0  # pending events that make progress on their own (not ticks or wakes)
        self.now = 0.0
        self.outstanding = len(self.reqs)
        self._next_arrival = 0
        self.c = _Counters()
        self._replan_busy = {"prfaas": 0.0, "pd_prefill": 0.0}
        self._stopped = ""

    # -- event plumbing

    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self._seq += 1
        if kind in (_LINK_CHANGE, _ARRIVAL, _PREFILL_DONE, _DECODE_DONE):
            self._live += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _push_next_arrival(self) -> None:
        if self._next_arrival < len(self.reqs):
            r = self.reqs[self._next_arrival]
            self._push(r.arrival, _ARRIVAL, self._next_arrival)
            self._next_arrival += 1

    def _wake_link(self, idx: int) -> None:
        self._link_version[idx] += 1
        nt = self.links[idx].next_event()
        if math.isfinite(nt):
            self._push(max(nt, self.now), _LINK_WAKE, idx, self._link_version[idx])

    # -- main loop

    def run(self) -> ReplayResult:
        wall0 = time.perf_counter()
        last_arrival = self.reqs[-1].arrival
        horizon = last_arrival + self.opts.max_drain_s
        for ci, c in enumerate(self.clusters):
            sched = self.schedules[c]
            for k in range(1, len(sched.times)):
                self._push(sched.times[k], _LINK_CHANGE, ci, k)
        self._push(0.0, _MONITOR)
        if self.opts.replan_interval_s is not None and self.policy in (
            "prfaas",
            *MULTI_POLICIES,
        ):
            self._push(self.opts.replan_interval_s, _REPLAN)
        self._push_next_arrival()
        next_report = wall0 + 2.0
        heap = self._heap
        while heap:
            if self.outstanding <= 0:
                break  # everything finished; what is left are ticks and future link changes
            t, _, kind, a, b = heapq.heappop(heap)
            if t > horizon:
                self._stopped = f"stopped at the drain limit ({self.opts.max_drain_s:g}s)"
                break
            self.now = t
            self.c.events += 1
            if kind in (_LINK_CHANGE, _ARRIVAL, _PREFILL_DONE, _DECODE_DONE):
                self._live -= 1
            if kind == _ARRIVAL:
                self._push_next_arrival()
                self._arrival(self.reqs[a])
            elif kind == _PREFILL_DONE:
                self._prefill_done(self._prefill_node(a, b))
            elif kind == _DECODE_DONE:
                self._decode_done(self.reqs[a])
            elif kind == _LINK_WAKE:
                if b == self._link_version[a]:
                    self._flows_done(self.links[a].advance(t))
                    self._wake_link(a)
            elif kind == _MONITOR:
                if not self._monitor():
                    break
            elif kind == _REPLAN:
                self._replan()
            elif kind == _LINK_CHANGE:
                bps = self.schedules[self.clusters[a]].gbps[b] * 1e9
                for i in (2 * a + _EGRESS, 2 * a + _REVERSE):
                    self._flows_done(self.links[i].set_capacity(t, bps))
                    self._wake_link(i)
            if self.progress is not None and self.c.events % 2048 == 0:
                wall = time.perf_counter()
                if wall >= next_report:
                    next_report = wall + 2.0
                    done = self.c.completed + self.c.rejected
                    self.progress(t, done / len(self.reqs), done, len(self.reqs))
        return self._summary(time.perf_counter() - wall0)

    def _prefill_node(self, cluster: int, idx: int) -> PrefillServer:
        if cluster == len(self.clusters):
            return self.pd_prefill[idx]
        return self.prfaas_groups[self.clusters[cluster]][idx]

    # -- handlers

    def _view(self) -> ClusterView:
        now = self.now
        groups = {
            c: tuple(NodeLoad(n.name, queue_s=n.queue_s(now)) for n in self.prfaas_groups[c])
            for c in self.clusters
        }
        return ClusterView(
            prfaas_prefill=tuple(x for c in self.clusters for x in groups[c]),
            pd_prefill=tuple(NodeLoad(n.name, queue_s=n.queue_s(now)) for n in self.pd_prefill),
            pd_decode=tuple(NodeLoad(d.name, load=d.load(now)) for d in self.decoders),
            prfaas_queue_depth=sum(n.depth() for n in self.prfaas),
            prfaas_by_cluster=None if len(self.clusters) == 1 else groups,
        )

    def _arrival(self, r: _Req) -> None:
        now = self.now
        bs = self.opts.block_tokens
        match = merged_match(self.caches, r.hashes)
        d = self.router.decide(now, r.rid, r.total, r.hashes, match, self._view(), self.link_states)
        r.t = d.effective_t
        r.predicted = d.predicted_ttft_s
        node = self.prefill_by_name.get((d.target, d.prefill_node or ""))
        decode = self.decode_by_name.get(d.decode_node or "")
        if d.rejected or node is None or decode is None:
            r.rejected = True
            self.c.rejected += 1
            self.outstanding -= 1
            return
        r.target = d.target
        r.node = node
        r.decode = decode
        decode.book(now)
        r.cached = max(min(d.cached_tokens, r.total), 0)
        uncached = r.total - r.cached
        r.service = node.inst.prefill_time(max(uncached, 1))
        if d.target != "pd":
            l_pd = cached_tokens(match, "pd", r.total, bs) if "pd" in self.caches else 0
            r.kv_bytes = self.profile.prfaas.kv_size(r.total - l_pd) if r.total > l_pd else 0.0
        cache = self.caches.get(d.target)
        if cache is not None and r.cached > 0:
            cache.touch(node.name, r.hashes, r.cached)
        self.router.on_accept(now, uncached)
        x = d.transfer
        if x is not None and x.bytes > 0:
            far = x.source_cluster if x.dest_cluster == "pd" else x.dest_cluster
            ci = self.clusters.index(far) if far in self.clusters else 0
            idx = 2 * ci + (_EGRESS if x.dest_cluster == "pd" else _REVERSE)
            self._flows_done(self.links[idx].add_flow(now, 2 * r.rid + 1, x.bytes, 0.0))
            self._wake_link(idx)
        else:
            self._enqueue(r)

    def _enqueue(self, r: _Req) -> None:
        node = r.node
        assert node is not None
        r.queued_at = self.now
        node.enqueue(r.rid, r.service)
        self._try_start(node)

    def _try_start(self, node: PrefillServer) -> None:
        started = node.start_next(self.now)
        if started is None:
            return
        r = self.reqs[started[0]]
        r.prefill_start = self.now
        is_prfaas = node.cluster != "pd"
        ci, idx = self.node_index[id(node)]
        self._push(self.now + r.service, _PREFILL_DONE, ci, idx)
        if is_prfaas and r.kv_bytes > 0:
            li = 2 * ci + _EGRESS
            self._flows_done(self.links[li].add_flow(self.now, 2 * r.rid, r.kv_bytes, r.service))
            self._wake_link(li)
        elif is_prfaas:
            r.kv_done = True

    def _prefill_done(self, node: PrefillServer) -> None:
        r = self.reqs[node.finish()]
        r.prefill_end = self.now
        cache = self.caches.get(node.cluster)
        if cache is not None and r.hashes:
            cache.store(node.name, r.hashes, r.total)
        if r.target == "pd" or r.kv_done:
            self._ready(r)
        self._try_start(node)

    def _flows_done(self, keys: list[int]) -> None:
        for key in keys:
            r = self.reqs[key // 2]
            if key % 2 == 0:
                r.kv_done = True
                if not math.isnan(r.prefill_end):
                    self._ready(r)
            else:
                self._enqueue(r)  # the cross-cluster prefix has arrived: prefill can queue

    def _ready(self, r: _Req) -> None:
        """KV is complete on the decode side: the first token is out (TTFT ends here)."""
        r.ready = self.now
        d = r.decode
        assert d is not None
        d.inbound -= 1
        if d.active < d.slots:
            self._start_decode(d, r)
        else:
            d.waiting.append(r.rid)

    def _start_decode(self, d: DecodeServer, r: _Req) -> None:
        d.active += 1
        r.decode_start = self.now
        self._push(self.now + r.out * self.token_s, _DECODE_DONE, r.rid)

    def _decode_done(self, r: _Req) -> None:
        d = r.decode
        assert d is not None
        d.active -= 1
        r.done = self.now
        self.c.completed += 1
        self.outstanding -= 1
        if d.waiting:
            self._start_decode(d, self.reqs[d.waiting.popleft()])

    def _monitor(self) -> bool:
        """Sample every PrfaaS link as its senders' monitors would (one combined report per
        link); False when the run must stop."""
        now = self.now
        for i, link in enumerate(self.links):
            self._flows_done(link.advance(now))
            self._wake_link(i)
        interval = self.opts.monitor_interval_s
        total_bits = total_cap = 0.0
        sent_total = 0.0
        worst_backlog = 0.0
        for ci, c in enumerate(self.clusters):
            egress = self.links[2 * ci + _EGRESS]
            sent, cap_bits = egress.bytes_sent, egress.capacity_bits
            last_sent, last_cap = self._tick[ci]
            self._tick[ci] = (sent, cap_bits)
            d_bits = (sent - last_sent) * 8.0
            d_cap = cap_bits - last_cap
            total_bits += d_bits
            total_cap += d_cap
            sent_total += sent
            util = (
                min(max(d_bits / d_cap, 0.0), 1.0) if d_cap > 0 else (1.0 if len(egress) else 0.0)
            )
            capacity = egress.capacity_bps
            backlog_bits = egress.backlog_bytes() * 8.0
            backlog_s = (
                backlog_bits / capacity if capacity > 0 else (math.inf if backlog_bits else 0)
            )
            worst_backlog = max(worst_backlog, backlog_s)
            if backlog_s >= self.opts.congested_backlog_s:
                state = "congested"
            elif backlog_s >= self.opts.warn_backlog_s:
                state = "warn"
            else:
                state = "ok"
            rtt = self.opts.base_rtt_ms + min(backlog_s, 60.0) * 1000.0
            self.link_states[c] = (
                LinkView(
                    utilisation=util,
                    goodput_bps=d_bits / interval if now > 0 else 0.0,
                    capacity_bps=capacity,
                    state=LinkHealth(state),
                    retrans_ratio=0.0,
                    rtt_ms=rtt,
                    updated_at=now,
                )
                if self.prfaas_groups[c]
                else None
            )
        util_all = min(max(total_bits / total_cap, 0.0), 1.0) if total_cap > 0 else 0.0
        depth = sum(n.depth() for n in self.prfaas)
        self.router.on_link(now, self.link_states, depth)
        self.c.ticks.append(
            TickSample(
                t=now,
                egress_bytes=sent_total,
                egress_gbps=total_bits / interval / 1e9 if now > 0 else 0.0,
                utilisation=util_all,
                backlog_s=min(worst_backlog, 1e9),
                prfaas_waiting=sum(len(n.queue) for n in self.prfaas),
                pd_prefill_waiting=sum(len(n.queue) for n in self.pd_prefill),
                decode_waiting=sum(len(d.waiting) for d in self.decoders),
                t_effective=self.router.t,
                t_base=self.router.base_t,
            )
        )
        if self.outstanding <= 0:
            return True
        if self._live == 0 and all(not math.isfinite(k.next_event()) for k in self.links):
            self._stopped = "stopped: requests stuck on a link with no capacity"
            return False
        self._push(now + interval, _MONITOR)
        return True

    def _replan(self) -> None:
        interval = self.opts.replan_interval_s
        if interval is None or self.outstanding <= 0:
            return
        roles = {n.name: "prefill" for n in self.pd_prefill}
        roles.update({d.name: "decode" for d in self.decoders})
        util: dict[str, float] = {}
        for stage, nodes in (("prfaas", self.prfaas), ("pd_prefill", self.pd_prefill)):
            busy = sum(n.busy_time for n in nodes)
            if nodes:
                util[stage] = (busy - self._replan_busy[stage]) / (interval * len(nodes))
            self._replan_busy[stage] = busy
        if self.decoders:
            util["pd_decode"] = sum(d.active / d.slots for d in self.decoders) / len(self.decoders)
        counts = {c: len(self.prfaas_groups[c]) for c in self.clusters}
        self.router.replan(self.now, roles, counts, self.link_states, util)
        self._push(self.now + interval, _REPLAN)

    # -- results

    def _summary(self, wall_s: float) -> ReplayResult:
        records = [
            RequestRecord(
                arrival=r.arrival,
                input_tokens=r.total,
                cached_tokens=r.cached,
                target=r.target,
                rejected=r.rejected,
                queued_at=r.queued_at,
                prefill_start=r.prefill_start,
                prefill_end=r.prefill_end,
                ready=r.ready,
                decode_start=r.decode_start,
                done=r.done,
                predicted_ttft=r.predicted,
                effective_t=r.t,
            )
            for r in self.reqs
        ]
        return summarise(
            policy=self.policy,
            layout=(self.layout.n_prfaas, self.layout.n_p, self.layout.n_d),
            base_t=self.layout.base_t,
            records=records,
            ticks=self.c.ticks,
            schedule=self.schedule,
            egress_bytes=sum(self.links[i].bytes_sent for i in range(_EGRESS, len(self.links), 2)),
            reverse_bytes=sum(
                self.links[i].bytes_sent for i in range(_REVERSE, len(self.links), 2)
            ),
            end_time=self.now,
            events=self.c.events,
            wall_s=wall_s,
            note=self._stopped,
            final_t=self.router.t,
        )


def _spread(total: int, fleet: list[tuple[str, int]]) -> dict[str, int]:
    """``total`` instances over the clusters in proportion to their own counts (exact when
    ``total`` is the fleet's sum, as for every layout that uses PrfaaS)."""
    have = sum(n for _, n in fleet)
    if have == total or have == 0:
        return {c: (n if have == total else 0) for c, n in fleet}
    out = {c: total * n // have for c, n in fleet}
    short = total - sum(out.values())
    for c, _ in sorted(fleet, key=lambda x: -x[1])[:short]:
        out[c] += 1
    return out


def _total(schedules: Mapping[str, LinkSchedule]) -> LinkSchedule:
    """The summed egress over time, for phases and the header (one schedule: itself)."""
    if len(schedules) == 1:
        return next(iter(schedules.values()))
    times = sorted({t for s in schedules.values() for t in s.times})
    return LinkSchedule(
        tuple(times), tuple(sum(s.at(t) for s in schedules.values()) for t in times)
    )


def replay(
    profile: Profile,
    requests: Sequence[SimRequest],
    policy: PolicyName,
    options: ReplayOptions | None = None,
    *,
    plan: Plan | None = None,
    progress: ProgressFn | None = None,
) -> ReplayResult:
    """Simulate ``policy`` on ``requests``; see the module docstring for the model."""
    return ReplaySim(profile, requests, policy, options, plan=plan, progress=progress).run()


def compare(
    profile: Profile,
    requests: Sequence[SimRequest],
    options: ReplayOptions | None = None,
    policies: Sequence[PolicyName] | None = None,
    *,
    progress: Callable[[PolicyName], ProgressFn | None] | None = None,
) -> list[ReplayResult]:
    """Every policy on the same arrivals (the plan is solved once and shared; ``better-link``
    and ``single-cluster`` solve their own). By default the base policies, plus those two
    when the profile has several PrfaaS clusters."""
    if policies is None:
        policies = POLICIES if len(profile.fleet) > 1 else BASE_POLICIES
    opts = options or ReplayOptions()
    if len(profile.fleet) == 1:
        nominal = (opts.link or LinkSchedule((0.0,), (profile.egress_gbps,))).at(0.0)
        base = profile.with_fleet(egress_gbps={profile.fleet[0].name: nominal})
    else:
        base = profile.with_fleet(
            egress_gbps={c: sch.at(0.0) for c, sch in (opts.links or {}).items()}
        )
    plan = solve(base)
    return [
        replay(
            profile,
            requests,
            p,
            opts,
            plan=plan,
            progress=progress(p) if progress is not None else None,
        )
        for p in policies
    ]


__all__ = ["ReplayOptions", "ReplaySim", "compare", "replay"]
