"""The router's state and operations, without HTTP.

``api.py`` is a thin aiohttp shell over this class, so everything the endpoints do can be
driven (and tested) directly with an explicit clock: cache index, link state, node loads, the
short-term threshold controller, and the long-term planner's latest recommendation. Not
thread-safe: the aiohttp app calls it from its single event loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from xdc.scheduler.cacheindex import CacheEvent, PrefixIndex, PrefixMatch
from xdc.scheduler.linkstate import LinkState, fresh
from xdc.scheduler.longterm import LongTermPlanner, Observations, Recommendation
from xdc.scheduler.nodes import NodeRegistry, Role
from xdc.scheduler.planner import Plan, solve, threshold_for_bandwidth
from xdc.scheduler.policy import (
    Decision,
    PolicyParams,
    RouteRequest,
    ThresholdController,
    costs_from_profile,
    queue_signal,
    route,
)
from xdc.scheduler.profile import Profile

from xdc.config import RouterConfig


@dataclass(frozen=True, slots=True)
class ReplanInputs:
    obs: Observations
    roles: dict[str, str]
    n_prfaas: int
    bandwidth_gbps: float | None


@dataclass(frozen=True, slots=True)
class LinkReport:
    """The link state as the policy sees it (router clock) plus what the monitor sent."""

    state: LinkState
    reported_at: float


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
        self.profile = profile
        self.clock = clock
        self.params = params or params_from_config(cfg)
        self.costs = costs_from_profile(profile)
        self.index = PrefixIndex(cfg.cache_capacity_blocks)
        self.nodes = NodeRegistry(profile.pd.decode_rate_rps)
        self.plan: Plan = solve(profile)
        now = clock()
        self.threshold = ThresholdController(
            self.plan.best.t, self.params, now, bandwidth_t=self._bandwidth_t
        )
        self.longterm = LongTermPlanner(profile)
        self.recommendation: Recommendation | None = None
        self.link: LinkReport | None = None
        self.started_at = now
        # capacity the current t was solved for, and when: a large change replans early
        self.planned_capacity_bps = float(profile.egress_gbps) * 1e9
        self.last_replan_at = -math.inf
        self.counts: dict[str, int] = {
            "decisions": 0,
            "rejected": 0,
            "events": 0,
            "events_changed": 0,
            "link_reports": 0,
            "link_ignored": 0,
            "replans": 0,
            "capacity_replans": 0,
        }
        if seed_nodes:
            self.nodes.seed(self.plan.n_prfaas, self.plan.n_p, self.plan.n_d)

    # -- requests

    def route(self, req: RouteRequest, *, dry_run: bool = False) -> tuple[Decision, PrefixMatch]:
        """Decide, and unless ``dry_run`` book the decision against node queues."""
        now = self.clock()
        view = self.nodes.view(now)
        link = self.link.state if self.link is not None else None
        t = self.threshold.update(link, queue_signal(view), now)
        match = self.index.match(req.hashes) if req.hashes else PrefixMatch.empty()
        d = route(req, match, t, link, view, self.costs, self.params, now)
        if not dry_run:
            self.counts["decisions"] += 1
            # rejected requests are demand too: the long-term loop must see them
            self.longterm.observe_arrival(now, d.uncached_tokens)
            if d.rejected:
                self.counts["rejected"] += 1
            else:
                self.nodes.book(d.target, d.prefill_node, d.decode_node, d.prefill_s, now)
                if d.prefill_node is not None and d.cached_tokens > 0:
                    used = -(-d.cached_tokens // self.cfg.block_size)
                    self.index.touch(d.target, d.prefill_node, req.hashes[:used])
        return d, match

    # -- daemon reports

    def apply_events(self, events: Iterable[CacheEvent]) -> tuple[int, int]:
        """Apply cache events; (applied, changed)."""
        applied = changed = 0
        for e in events:
            applied += 1
            changed += self.index.apply(e)
        self.counts["events"] += applied
        self.counts["events_changed"] += changed
        return applied, changed

    def update_link(self, state: LinkState) -> bool:
        """Accept a monitor report unless it is older than the one we have."""
        self.counts["link_reports"] += 1
        if self.link is not None and state.updated_at < self.link.reported_at:
            self.counts["link_ignored"] += 1
            return False
        now = self.clock()
        self.link = LinkReport(dataclasses.replace(state, updated_at=now), state.updated_at)
        view = self.nodes.view(now)
        self.threshold.update(self.link.state, queue_signal(view), now)
        return True

    def capacity_replan_due(self) -> bool:
        """The live capacity moved more than ``replan_capacity_change`` from the one t was
        solved for, and the last replan is at least ``replan_min_interval_s`` old: the timer
        (minutes) is too slow for a link that just lost most of its bandwidth."""
        now = self.clock()
        if now - self.last_replan_at < self.cfg.replan_min_interval_s:
            return False
        live = fresh(self.link.state if self.link else None, now, self.params.stale_after_s)
        if live is None or live.capacity_bps <= 0:
            return False
        planned = self.planned_capacity_bps
        if planned <= 0:
            return True
        return abs(live.capacity_bps - planned) / planned > self.cfg.replan_capacity_change

    def report_node(
        self,
        cluster: str,
        name: str,
        role: Role,
        *,
        queue_s: float | None = None,
        queue_depth: int | None = None,
        decode_load: float | None = None,
        healthy: bool | None = None,
    ) -> None:
        self.nodes.upsert(
            cluster,
            name,
            role,
            now=self.clock(),
            queue_s=queue_s,
            queue_depth=queue_depth,
            decode_load=decode_load,
            healthy=healthy,
        )

    # -- long term

    def replan_inputs(self) -> ReplanInputs:
        """Snapshot what the long-term planner needs (on the event loop; cheap)."""
        now = self.clock()
        self.longterm.observe_utilisation(self.nodes.utilisation(now))
        n_prfaas, _, _ = self.nodes.counts()
        live = fresh(self.link.state if self.link else None, now, self.params.stale_after_s)
        bw = live.capacity_bps / 1e9 if live is not None and live.capacity_bps > 0 else None
        roles: dict[str, str] = {
            n.name: n.role for n in self.nodes.nodes() if n.cluster == "pd" and n.healthy
        }
        self.last_replan_at = now
        if bw is not None:
            self.planned_capacity_bps = bw * 1e9
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

    def replan(self) -> Recommendation:
        """Re-solve from observations in one go (tests, replay)."""
        rec = self.solve(self.replan_inputs())
        self.adopt(rec)
        return rec

    def _bandwidth_t(self, gbps: float) -> float:
        """The planner's t for a live capacity and the PD split the router sees now."""
        _, n_p, n_d = self.nodes.counts()
        if n_p == 0 and n_d == 0:
            n_p, n_d = self.plan.n_p, self.plan.n_d
        return threshold_for_bandwidth(self.profile, n_p, n_d, gbps)

    # -- read side

    def effective_t(self) -> float:
        return self.threshold.t

    def state(self) -> dict[str, Any]:
        now = self.clock()
        st = self.index.stats()
        link: dict[str, Any] | None = None
        if self.link is not None:
            s = self.link.state
            link = {
                **s.to_json(),
                "age_s": round(s.age_s(now), 3),
                "stale": s.is_stale(now, self.params.stale_after_s),
                "reported_updated_at": self.link.reported_at,
            }
        view = self.nodes.view(now)
        return {
            "uptime_s": round(now - self.started_at, 3),
            "threshold": {
                "base_t": _num(self.threshold.base_t),
                "effective_t": _num(self.threshold.t),
            },
            "link": link,
            "prfaas_queue_depth": view.prfaas_queue_depth,
            "cache_index": {
                "entries": st.entries,
                "capacity": st.capacity,
                "distinct_blocks": st.distinct_blocks,
                "tombstones": st.tombstones,
                "capacity_evictions": st.capacity_evictions,
                "stale_ignored": st.stale_ignored,
                "per_node": st.per_node,
            },
            "nodes": self.nodes.snapshot(now),
            "utilisation": {k: round(v, 6) for k, v in self.nodes.utilisation(now).items()},
            "counts": dict(self.counts),
        }

    def plan_json(self) -> dict[str, Any]:
        rec = self.recommendation
        out: dict[str, Any] = _finite(
            {
                "profile_plan": self.plan.to_dict(),
                "n_prfaas": self.plan.n_prfaas,
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


__all__ = ["LinkReport", "ReplanInputs", "RouterService", "params_from_config", "role_of"]
