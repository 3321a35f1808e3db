"""The router's state and operations, without HTTP.

``app.py`` is a thin aiohttp shell over this class, so everything the endpoints do can be
driven (and tested) directly with an explicit clock: cache index, link table, node loads, the
short-term threshold controller, and the long-term planner's latest recommendation. Not
thread-safe: the aiohttp app calls it from its single event loop.

Every input that changes state (a link report, a node report, a batch of cache events, an
accepted decision's booking) goes through one ``apply_*`` method with the time it was
received, and is then handed to ``self.sync``: a no-op for the default single router, the Redis
backend (``service.shared``) for replicas, which sends it to the other replicas, where it
arrives through the same ``apply_*`` method with the same timestamp. State is the same on
every replica because its inputs are, not because one replica copies another's state.

The threshold t and the long-term plan are outputs, not inputs: with replicas only the leader
(``leads``) runs the controller and the planner and publishes what it concluded; the others
adopt it (``adopt_threshold``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from xdc.scheduler.cacheindex import CacheEvent, PrefixMatch
from xdc.scheduler.cacheintake import CacheIntake, XdcChainHash
from xdc.scheduler.drift import KINDS, DriftEstimator, Kind, PrefillWindow, scaled
from xdc.scheduler.link_table import LinkTable, LinkView, fresh, usable_capacity_bps
from xdc.scheduler.longterm import LongTermPlanner, Observations, Recommendation
from xdc.scheduler.nodes import NodeRegistry, Role
from xdc.scheduler.outages import Failure, Outages
from xdc.scheduler.planner import Plan, offload_shape, solve, threshold_for_bandwidth
from xdc.scheduler.policy import (
    Decision,
    PolicyParams,
    RouteRequest,
    ThresholdController,
    costs_from_profile,
    merge_links,
    offload_weights,
    queue_signal,
    route,
)
from xdc.scheduler.profile import PD_CLUSTER, Profile
from xdc.scheduler.vllm_events import add_vllm_sources

from xdc.config import RouterConfig
from xdc.config_entries import parse_targets
from xdc.errors import RemoteRequestError
from xdc.linkreport import LinkId, LinkReport

log = logging.getLogger("xdc.router")

THRESHOLD_TICK_S = 0.01  # the controller advances at most this often on the routing path


@dataclass(frozen=True, slots=True)
class ReplanInputs:
    obs: Observations
    roles: dict[str, str]
    n_prfaas: dict[str, int]
    bandwidth_gbps: dict[str, float] | None


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What ``POST /v1/nodes`` says about one node (None = not reported)."""

    cluster: str
    name: str
    role: Role
    queue_s: float | None = None
    queue_depth: int | None = None
    decode_load: float | None = None
    healthy: bool | None = None
    instance: str | None = None  # the engine instance it is a role of
    decode_waiting: int | None = None  # decodes the engine holds whose KV is on its way

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cluster": self.cluster, "name": self.name, "role": self.role}
        for k in ("queue_s", "queue_depth", "decode_load", "healthy", "instance", "decode_waiting"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> NodeReport:
        return NodeReport(
            obj["cluster"],
            obj["name"],
            role_of(obj["role"]),
            queue_s=obj.get("queue_s"),
            queue_depth=obj.get("queue_depth"),
            decode_load=obj.get("decode_load"),
            healthy=obj.get("healthy"),
            instance=obj.get("instance"),
            decode_waiting=obj.get("decode_waiting"),
        )


@dataclass(frozen=True, slots=True)
class Booking:
    """An accepted (or rejected) decision as the other replicas need it: node queues grow by
    it, and the long-term planner counts it as demand."""

    at: float
    target: str
    prefill_node: str | None
    decode_node: str | None
    prefill_s: float
    uncached_tokens: int
    rejected: bool


class Sync(Protocol):
    """Where local inputs go after they are applied (the Redis backend; or nowhere)."""

    def link_report(self, report: LinkReport, received_at: float) -> None: ...
    def node_reports(self, reports: Sequence[NodeReport], received_at: float) -> None: ...
    def cache_events(self, scheme: str, events: Sequence[CacheEvent]) -> None: ...
    def booking(self, booking: Booking) -> None: ...
    def failure(self, failure: Failure, received_at: float) -> None: ...


class NoSync:
    """One router: nothing to tell anyone."""

    def link_report(self, report: LinkReport, received_at: float) -> None:
        return None

    def node_reports(self, reports: Sequence[NodeReport], received_at: float) -> None:
        return None

    def cache_events(self, scheme: str, events: Sequence[CacheEvent]) -> None:
        return None

    def booking(self, booking: Booking) -> None:
        return None

    def failure(self, failure: Failure, received_at: float) -> None:
        return None


class UnknownCluster(RemoteRequestError, ValueError):
    """A report names a cluster the profile does not have."""


class RouterService:
    """Routing decisions plus the state they depend on."""

    def __init__(
        self,
        cfg: RouterConfig,
        profile: Profile,
        *,
        clock: Callable[[], float] = time.monotonic,
        params: PolicyParams | None = None,
        seed_nodes: bool = True,
    ) -> None:
        self.cfg = cfg
        self.profile = profile  # what the planner and the costs use: base_profile, corrected
        self.base_profile = profile  # as loaded
        self.drift = DriftEstimator()
        self.drift_applied: dict[Kind, float] = self.drift.factors()
        # the PrfaaS engines' own /metrics reach the drift estimate: gateway timings do not
        self.prfaas_scraped = any(
            t.cluster != PD_CLUSTER and t.role == "prefill" for t in parse_targets(cfg.vllm_metrics)
        )
        self.clock = clock
        self.params = params or params_from_config(cfg)
        self.costs = costs_from_profile(profile)
        self.fleet = profile.fleet
        self.prfaas_names = tuple(c.name for c in self.fleet)
        self.clusters = (*self.prfaas_names, PD_CLUSTER)
        self._link_ids = {c: LinkId(c, PD_CLUSTER) for c in self.prfaas_names}
        self.links = LinkTable(self._link_ids.values(), cfg.link_stale_s)
        self.outages = Outages(dark_after_s=cfg.link_dark_s, hold_s=cfg.outage_hold_s)
        self.cache = CacheIntake(
            cfg.cache_capacity_blocks, self.clusters, [XdcChainHash(cfg.block_size)]
        )
        self.index = self.cache.index
        self.vllm_sources = add_vllm_sources(self.cache, cfg)
        self.nodes = NodeRegistry(profile.pd.decode_rate_rps)
        self.plan: Plan = solve(profile)
        now = clock()
        self.threshold = ThresholdController(
            self.plan.best.t, self.params, now, bandwidth_t=self._bandwidth_t
        )
        self._t_at = -math.inf
        self.shape = offload_shape(profile, self.plan.best.t)
        self.longterm = LongTermPlanner(profile)
        self.recommendation: Recommendation | None = None
        self.started_at = now
        self.sync: Sync = NoSync()
        # True while this process runs the threshold controller and the planner: always for
        # one router; for replicas, the leader (and any replica cut off from Redis)
        self.leads = True
        # per-cluster capacity the current t was solved for, and when: a large change
        # replans early
        self.planned_capacity_bps = {c.name: float(c.egress_gbps) * 1e9 for c in self.fleet}
        self.last_replan_at = -math.inf
        self._links_version = -1
        self._link_by_cluster: dict[str, LinkView | None] = {}
        self.counts: dict[str, int] = {
            "decisions": 0,
            "rejected": 0,
            "events": 0,
            "events_changed": 0,
            "link_reports": 0,
            "link_ignored": 0,
            "replans": 0,
            "capacity_replans": 0,
            "profile_corrections": 0,
            "gateway_prefills": 0,  # remote prefills gateways timed (drift input without scrapes)
            "replicated_in": 0,
            "failures": 0,
        }
        if seed_nodes:
            self.nodes.seed(
                [(c.name, c.instances) for c in self.fleet], self.plan.n_p, self.plan.n_d
            )

    # -- links, per PrfaaS cluster

    def link_views(self, now: float) -> Mapping[str, LinkView | None]:
        """Combined link state per PrfaaS cluster (its link to the PD cluster)."""
        views = self.links.views(now)
        if self._links_version != self.links.version:
            self._link_by_cluster = {c: views[k] for c, k in self._link_ids.items()}
            self._links_version = self.links.version
        return self._link_by_cluster

    def last_heard(self) -> dict[str, float | None]:
        """When each PrfaaS cluster's link was last reported on (None: never)."""
        heard = self.links.last_heard
        return {c: heard.get(k) for c, k in self._link_ids.items()}

    def links_down(self, now: float) -> dict[str, str]:
        """PrfaaS clusters whose link must not be offloaded over now, and why."""
        return self.outages.links_down(now, self.last_heard())

    def check_prfaas(self, cluster: str) -> None:
        if cluster not in self.prfaas_names:
            raise UnknownCluster(
                f"cluster {cluster!r} is not a PrfaaS cluster of the profile "
                f"(known: {', '.join(self.prfaas_names)})"
            )

    def apply_failure(
        self, f: Failure, received_at: float | None = None, *, local: bool = True
    ) -> str:
        """A remote plan whose KV did not come (the gateway's report); what it blamed.
        UnknownCluster for a cluster outside the profile."""
        self.check_prfaas(f.cluster)
        now = self.clock() if received_at is None else received_at
        self.counts["failures"] += 1
        blamed = self.outages.record(f, now)
        if local:
            self.sync.failure(f, now)
        else:
            self.counts["replicated_in"] += 1
        return blamed

    def fleet_link(self, now: float) -> LinkView | None:
        """The PrfaaS egress as a whole (fresh links merged): what t reacts to."""
        stale = self.params.stale_after_s
        return merge_links(fresh(v, now, stale) for v in self.link_views(now).values())

    def live_capacities_gbps(self, now: float, usable: bool = False) -> dict[str, float] | None:
        """Per PrfaaS cluster: the reported capacity where fresh, else the configured one;
        None when no link is reported at all (then the configured plan stands). ``usable``:
        a congested link counts with what it delivers now (``usable_capacity_bps``), which
        is what bounds the short-term raise of t; replans keep the capacity."""
        stale = self.params.stale_after_s
        out: dict[str, float] = {}
        any_live = False
        views = self.link_views(now)
        for c in self.fleet:
            live = fresh(views.get(c.name), now, stale)
            if live is not None and live.capacity_bps > 0:
                bps = (
                    usable_capacity_bps(live, self.params.min_link_share)
                    if usable
                    else live.capacity_bps
                )
                out[c.name] = bps / 1e9
                any_live = True
            else:
                out[c.name] = float(c.egress_gbps)
        return out if any_live else None

    def weights(self, now: float) -> dict[str, float]:
        """Offload share of each PrfaaS cluster at the live capacities (policy.offload_weights),
        counting only clusters with a healthy node."""
        caps = self.live_capacities_gbps(now) or {c.name: c.egress_gbps for c in self.fleet}
        counts = self.nodes.prfaas_counts()
        return offload_weights(
            [(c, counts.get(c, 0), caps[c] * 1e9) for c in self.prfaas_names], self.shape
        )

    # -- requests

    def route(self, req: RouteRequest, *, dry_run: bool = False) -> tuple[Decision, PrefixMatch]:
        """Decide, and unless ``dry_run`` book the decision against node queues."""
        match = self.index.match(req.hashes) if req.hashes else PrefixMatch.empty()
        return self.route_matched(req, match, dry_run=dry_run), match

    def route_matched(
        self, req: RouteRequest, match: PrefixMatch, *, dry_run: bool = False
    ) -> Decision:
        now = self.clock()
        view = self.nodes.view(now)
        if self.leads and now - self._t_at >= THRESHOLD_TICK_S:
            self._advance_threshold(now, view)
        t = self.threshold.t
        links = self.link_views(now)
        weights = self.weights(now) if len(self.fleet) > 1 else None
        d = route(
            req,
            match,
            t,
            links,
            view,
            self.costs,
            self.params,
            now,
            weights,
            links_down=self.links_down(now),
            intakes_down=self.outages.intakes_down(now),
        )
        if not dry_run:
            b = Booking(
                now,
                d.target,
                d.prefill_node,
                d.decode_node,
                d.prefill_s,
                d.uncached_tokens,
                d.rejected,
            )
            self.apply_booking(b)
            self.sync.booking(b)
            if not d.rejected and d.prefill_node is not None and d.cached_tokens > 0:
                used = -(-d.cached_tokens // self.cfg.block_size)
                self.index.touch(d.target, d.prefill_node, req.hashes[:used])
        return d

    def tick_threshold(self) -> None:
        """Advance the controller without a request (the replicas' leader, on a timer)."""
        self._advance_threshold(self.clock())

    def _advance_threshold(self, now: float, view: Any = None) -> None:
        self._t_at = now
        caps = self.live_capacities_gbps(now, usable=True)
        queues = queue_signal(view if view is not None else self.nodes.view(now))
        self.threshold.update(
            self.fleet_link(now),
            queues,
            now,
            None if caps is None else tuple(caps[c] for c in self.prfaas_names),
        )

    def apply_booking(self, b: Booking) -> None:
        """Count a decision (ours or another replica's) against node queues and demand."""
        self.counts["decisions"] += 1
        self.longterm.observe_arrival(b.at, b.uncached_tokens)
        if b.rejected:
            self.counts["rejected"] += 1
        else:
            self.nodes.book(b.target, b.prefill_node, b.decode_node, b.prefill_s, b.at)

    # -- daemon reports

    def apply_events(
        self, events: Sequence[CacheEvent], scheme: str | None = None, *, local: bool = True
    ) -> tuple[int, int]:
        """Apply cache events; (applied, changed). ValueError for an unknown cluster."""
        name = scheme or self.cache.default
        applied, changed = self.cache.apply(name, events)
        self.counts["events"] += applied
        self.counts["events_changed"] += changed
        if local:
            self.sync.cache_events(name, events)
        else:
            self.counts["replicated_in"] += 1
        return applied, changed

    def update_link(
        self, report: LinkReport, received_at: float | None = None, *, local: bool = True
    ) -> bool:
        """Keep a sender's report unless it already sent a newer one; UnknownLink (a
        ValueError) for a link outside the profile."""
        now = self.clock() if received_at is None else received_at
        self.counts["link_reports"] += 1
        accepted = self.links.accept(report, now)
        if not accepted:
            self.counts["link_ignored"] += 1
            return False
        if report.link.dst == PD_CLUSTER:
            self.outages.heard(report.link.src, now)
        if local:
            self.sync.link_report(report, now)
        else:
            self.counts["replicated_in"] += 1
        if self.leads:
            self._advance_threshold(self.clock())
        return True

    def capacity_replan_due(self) -> bool:
        """A PrfaaS link's live capacity moved more than ``replan_capacity_change`` from the
        one t was solved for, and the last replan is at least ``replan_min_interval_s`` old:
        the timer (minutes) is too slow for a link that just lost most of its bandwidth."""
        now = self.clock()
        if not self.leads or now - self.last_replan_at < self.cfg.replan_min_interval_s:
            return False
        stale = self.params.stale_after_s
        for c, v in self.link_views(now).items():
            live = fresh(v, now, stale)
            if live is None or live.capacity_bps <= 0:
                continue
            planned = self.planned_capacity_bps.get(c, 0.0)
            if planned <= 0:
                return True
            if abs(live.capacity_bps - planned) / planned > self.cfg.replan_capacity_change:
                return True
        return False

    def check_clusters(self, reports: Iterable[NodeReport]) -> None:
        for i, r in enumerate(reports):
            if r.cluster not in self.clusters:
                raise UnknownCluster(
                    f"nodes[{i}].cluster: {r.cluster!r} is not in the profile "
                    f"(known: {', '.join(self.clusters)})"
                )
            if r.cluster != PD_CLUSTER and r.role != "prefill":
                raise ValueError(f"nodes[{i}].role: PrfaaS nodes only prefill")

    def apply_node_reports(
        self, reports: Sequence[NodeReport], received_at: float | None = None, *, local: bool = True
    ) -> None:
        """Node roles and loads; ValueError (nothing applied) if any names an unknown cluster."""
        self.check_clusters(reports)
        now = self.clock() if received_at is None else received_at
        for r in reports:
            self.nodes.upsert(
                r.cluster,
                r.name,
                r.role,
                now=now,
                queue_s=r.queue_s,
                queue_depth=r.queue_depth,
                decode_load=r.decode_load,
                healthy=r.healthy,
                instance=r.instance,
                decode_waiting=r.decode_waiting,
            )
        if local:
            self.sync.node_reports(reports, now)
        else:
            self.counts["replicated_in"] += 1

    # -- long term

    def observe_prefill(self, cluster: str, window: PrefillWindow) -> None:
        """Prefills an engine of ``cluster`` finished since its last scrape (vLLM /metrics):
        folded into the profile-drift estimate the next replan applies."""
        kind: Kind = "pd" if cluster == PD_CLUSTER else "prfaas"
        inst = self.base_profile.pd if kind == "pd" else self.base_profile.prfaas
        self.drift.observe(kind, window, inst)

    def observe_gateway_prefill(self, cluster: str, seconds: float, uncached_tokens: int) -> bool:
        """A remote prefill as a gateway timed it (``POST /v1/outcomes`` ``prefills``):
        whether it was folded into the PrfaaS drift estimate. Only where the router scrapes
        no PrfaaS engine (across datacenters it often cannot): the engines' own histograms
        time the prefill alone, the gateway's time includes the PrfaaS queue, so there it
        would count queueing as slow prefill. Each replica folds what it is sent; the
        leader's factors are the ones all replicas use."""
        self.check_prfaas(cluster)
        self.counts["gateway_prefills"] += 1
        if self.prfaas_scraped:
            return False
        n = uncached_tokens
        window = PrefillWindow(1, seconds, float(n), ((float(n), float(n), 1),))
        self.drift.observe("prfaas", window, self.base_profile.prfaas)
        return True

    def _correct_profile(self) -> None:
        """Route and plan with the profile's prefill curves scaled by the drift measured
        since (the long timescale: at each replan, not per scrape)."""
        self.apply_drift(self.drift.factors())

    def apply_drift(self, factors: Mapping[Kind, float]) -> None:
        """Route and plan with the profile's prefill curves scaled by ``factors`` (this
        replica's estimate at a replan, or the leader's on a follower replica, so that all
        replicas price requests alike)."""
        factors = {k: float(factors.get(k, 1.0)) for k in KINDS}
        if factors == self.drift_applied:
            return
        self.profile = scaled(self.base_profile, factors)
        self.longterm.profile = self.profile
        self.costs = costs_from_profile(self.profile)
        self.drift_applied = factors
        self.counts["profile_corrections"] += 1
        log.info(
            "profile drift: prefill measured at %s the profile's; planning with it",
            ", ".join(f"{k} {f:.2f}x" for k, f in factors.items()),
        )

    def replan_inputs(self) -> ReplanInputs:
        """Snapshot what the long-term planner needs (on the event loop; cheap)."""
        self._correct_profile()
        now = self.clock()
        self.longterm.observe_utilisation(self.nodes.utilisation(now))
        counts = self.nodes.prfaas_counts()
        n_prfaas = {c: counts.get(c, 0) for c in self.prfaas_names}
        bw = self.live_capacities_gbps(now)
        roles: dict[str, str] = {
            n.name: n.role for n in self.nodes.nodes() if n.cluster == PD_CLUSTER and n.healthy
        }
        self.last_replan_at = now
        if bw is not None:
            self.planned_capacity_bps = {c: g * 1e9 for c, g in bw.items()}
        self.counts["replans"] += 1
        return ReplanInputs(self.longterm.snapshot(now), roles, n_prfaas, bw)

    def solve(self, inputs: ReplanInputs) -> Recommendation:
        """The expensive, pure part; safe to run in a worker thread."""
        return self.longterm.solve(inputs.obs, inputs.roles, inputs.n_prfaas, inputs.bandwidth_gbps)

    def adopt(self, rec: Recommendation) -> None:
        """Publish a recommendation and route with its t for the current split."""
        self.recommendation = rec
        self.threshold.forget_bandwidth_targets()  # the split may have changed since
        self.threshold.set_base(rec.t)
        self.shape = offload_shape(self.profile, rec.t)

    def adopt_threshold(
        self, base_t: float, t: float, drift: Mapping[Kind, float] | None = None
    ) -> None:
        """The leader's thresholds and profile-drift factors (a follower replica routes
        and prices requests with these: only the leader replans)."""
        before = self.drift_applied
        if drift is not None:
            self.apply_drift(drift)
        if base_t != self.threshold.base_t or self.drift_applied != before:
            self.shape = offload_shape(self.profile, base_t)
        self.threshold.base_t = base_t
        self.threshold.t = t

    def replan(self) -> Recommendation:
        """Re-solve from observations in one go (tests, replay)."""
        rec = self.solve(self.replan_inputs())
        self.adopt(rec)
        return rec

    def _bandwidth_t(self, gbps: tuple[float, ...]) -> float:
        """The planner's t for the live capacities and the PD split the router sees now."""
        _, n_p, n_d = self.nodes.counts()
        if n_p == 0 and n_d == 0:
            n_p, n_d = self.plan.n_p, self.plan.n_d
        return threshold_for_bandwidth(self.profile, n_p, n_d, gbps)

    # -- read side

    def effective_t(self) -> float:
        return self.threshold.t

    def links_json(self, now: float) -> dict[str, Any]:
        stale = self.params.stale_after_s
        out: dict[str, Any] = {}
        weights = self.weights(now)
        total_w = sum(weights.values())
        views = self.link_views(now)
        for c, lid in self._link_ids.items():
            v = views.get(c)
            out[str(lid)] = {
                "from_cluster": lid.src,
                "to_cluster": lid.dst,
                "configured_gbps": next(f.egress_gbps for f in self.fleet if f.name == c),
                "offload_share": round(weights.get(c, 0.0) / total_w, 6) if total_w > 0 else 0,
                "state": None
                if v is None
                else {
                    **v.to_json(),
                    "age_s": round(v.age_s(now), 3),
                    "stale": v.is_stale(now, stale),
                },
                "reporters": {
                    r: {
                        "goodput_bps": h.report.goodput_bps,
                        "capacity_bps": h.report.capacity_bps,
                        "state": h.report.state,
                        "age_s": round(now - h.received_at, 3),
                    }
                    for r, h in sorted(self.links.reporters(lid).items())
                },
            }
        return out

    def state(self) -> dict[str, Any]:
        now = self.clock()
        st = self.index.stats()
        fleet = self.fleet_link(now)
        view = self.nodes.view(now)
        return {
            "uptime_s": round(now - self.started_at, 3),
            # measured prefill / the profile's, per instance type; the factors the last
            # replan applied (t and the costs use the corrected curves)
            "profile_drift": {
                "measured": self.drift.state(),
                "applied": {k: round(f, 4) for k, f in self.drift_applied.items()},
            },
            "threshold": {
                "base_t": _num(self.threshold.base_t),
                "effective_t": _num(self.threshold.t),
            },
            "link": None if fleet is None else fleet.to_json(),
            "links": self.links_json(now),
            "outages": self.outages.to_json(now, self.last_heard()),
            "prfaas_queue_depth": view.prfaas_queue_depth,
            "cache_index": {
                "entries": st.entries,
                "capacity": st.capacity,
                "distinct_blocks": st.distinct_blocks,
                "tombstones": st.tombstones,
                "capacity_evictions": st.capacity_evictions,
                "stale_ignored": st.stale_ignored,
                "per_node": st.per_node,
                "schemes": {k: len(v) for k, v in self.cache.indexes.items()},
                "vllm_sources": {
                    f"{s.endpoint.cluster}/{s.endpoint.node}": {
                        **dict(s.counts),
                        "last_seq": s.last_seq,
                        "dropped": dict(s.translator.dropped),
                        "held_blocks": len(s.translator.held),
                        "held_window_blocks": len(s.translator.held_windows),
                    }
                    for s in self.vllm_sources
                },
            },
            "nodes": self.nodes.snapshot(now),
            "utilisation": {k: round(v, 6) for k, v in self.nodes.utilisation(now).items()},
            "counts": dict(self.counts),
            "leader": self.leads,
        }

    def plan_json(self) -> dict[str, Any]:
        rec = self.recommendation
        out: dict[str, Any] = _finite(
            {
                "profile_plan": self.plan.to_dict(),
                "n_prfaas": self.plan.n_prfaas,
                "prfaas_clusters": {c.name: c.instances for c in self.fleet},
                "n_p": self.plan.n_p,
                "n_d": self.plan.n_d,
                "base_t": _num(self.threshold.base_t),
                "effective_t": _num(self.threshold.t),
                "recommendation": None if rec is None else rec.to_json(),
            }
        )
        return out


def params_from_config(cfg: RouterConfig) -> PolicyParams:
    """The short-term policy knobs an operator sets in ``[router]``; the rest keep defaults."""
    return PolicyParams(
        block_size=cfg.block_size,
        ttft_slo_s=cfg.ttft_slo_s,
        util_scarce=cfg.util_scarce,
        util_clear=cfg.util_clear,
        stale_after_s=cfg.link_stale_s,
        queue_scarce_s=cfg.queue_scarce_s,
        queue_clear_s=cfg.queue_clear_s,
        keep_local_when_faster=cfg.keep_local_when_faster,
    )


def _num(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def _finite(obj: Any) -> Any:
    """JSON has no Infinity/NaN: replace them (e.g. a planner ratio over zero) with null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def role_of(value: object) -> Role:
    if value == "prefill":
        return "prefill"
    if value == "decode":
        return "decode"
    raise ValueError(f"role: {value!r} is not prefill or decode")


__all__ = [
    "Booking",
    "NoSync",
    "NodeReport",
    "ReplanInputs",
    "RouterService",
    "Sync",
    "UnknownCluster",
    "params_from_config",
    "role_of",
]
