"""The routing policies the replay simulator compares, behind one small interface.

``prfaas`` is the real router: every arrival goes through ``scheduler.policy.route`` with the
prefix match from the real index, the link state a monitor would report for each PrfaaS
cluster's link and the live queue view; the short-term loop (``ThresholdController`` over
``effective_threshold``) adjusts ``t`` from link state and PrfaaS queue depth, and the long-term
loop (``LongTermPlanner``) re-solves the base ``t`` on a timer from observed uncached lengths
and the live link capacities. With several PrfaaS clusters it splits offloaded traffic by what
each sustains at its live link capacity, as the router does.

The baselines are deliberately plain rules, as in the paper's Table 6:
* ``homogeneous``: only PD-type instances, best ``N_p / N_d`` of the planner, no offload;
* ``naive``: every prefill on PrfaaS (``t = 0``), every PD instance decodes;
* ``static-threshold``: the prfaas split and ``t`` solved once at the nominal bandwidth and
  never adapted: offload when the uncached length in PD exceeds ``t``, whatever the link does.
Rule routers send a request to the prefill instance with the least queued work (any PrfaaS
cluster) and the decode instance with the least committed load; they never reject.

Two more for deployments with several PrfaaS clusters (``MULTI_POLICIES``):
* ``better-link``: the router, but every offload goes over the link with the highest
  configured capacity; the other clusters stay idle and the plan is solved for that one;
* ``single-cluster``: the router as it was before it knew about links by id: the PrfaaS
  clusters planned and routed as one pooled cluster (instances and bandwidth summed, one
  merged link state), each offload to the least-loaded PrfaaS node whatever its link.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from xdc.scheduler.cacheindex import PrefixMatch
from xdc.scheduler.link_table import LinkView, fresh
from xdc.scheduler.longterm import LongTermPlanner
from xdc.scheduler.planner import Plan, offload_shape, threshold_for_bandwidth
from xdc.scheduler.policy import (
    CacheTransfer,
    ClusterView,
    NodeLoad,
    PolicyParams,
    RouteRequest,
    ThresholdController,
    costs_from_profile,
    merge_links,
    offload_weights,
    queue_signal,
    route,
)
from xdc.scheduler.profile import DEFAULT_PRFAAS, PD_CLUSTER, Profile

PolicyName = Literal[
    "prfaas", "homogeneous", "naive", "static-threshold", "better-link", "single-cluster"
]
BASE_POLICIES: Final[tuple[PolicyName, ...]] = (
    "prfaas",
    "homogeneous",
    "naive",
    "static-threshold",
)
MULTI_POLICIES: Final[tuple[PolicyName, ...]] = ("better-link", "single-cluster")
POLICIES: Final[tuple[PolicyName, ...]] = (*BASE_POLICIES, *MULTI_POLICIES)

Links = Mapping[str, LinkView | None]


@dataclass(frozen=True, slots=True)
class Layout:
    """Instances a policy runs on and the threshold it starts from."""

    n_prfaas: int
    n_p: int
    n_d: int
    base_t: float


def layout_for(policy: PolicyName, plan: Plan) -> Layout:
    """Instance counts per policy, from the planner's solution and its two baselines."""
    if policy in ("prfaas", "static-threshold", "better-link", "single-cluster"):
        return Layout(plan.n_prfaas, plan.n_p, plan.n_d, plan.best.t)
    if policy == "homogeneous":
        h = plan.homogeneous
        return Layout(0, h.n_p, h.n_d, math.inf)
    n = plan.naive
    return Layout(n.n_prfaas, 0, n.n_d, 0.0)


def policy_profile(policy: PolicyName, profile: Profile) -> Profile:
    """The deployment a policy plans for: the best-link cluster alone for ``better-link``,
    the clusters pooled into one for ``single-cluster``, else the profile as it is."""
    if len(profile.fleet) < 2:
        return profile
    if policy == "better-link":
        best = max(profile.fleet, key=lambda c: (c.egress_gbps, c.instances))
        return profile.with_fleet(
            {c.name: (c.instances if c.name == best.name else 0) for c in profile.fleet},
            {c.name: (c.egress_gbps if c.name == best.name else 0.0) for c in profile.fleet},
        )
    if policy == "single-cluster":
        return profile.with_fleet()  # same totals, planned as one: see PooledRouter
    return profile


@dataclass(frozen=True, slots=True)
class Routing:
    """Where one request goes. ``cached_tokens`` is the prefix the prefill skips (after any
    cross-cluster ``transfer``); ``predicted_ttft_s`` is the router's estimate (nan for rules).
    """

    target: str
    prefill_node: str | None
    decode_node: str | None
    cached_tokens: int
    transfer: CacheTransfer | None
    effective_t: float
    predicted_ttft_s: float = math.nan
    rejected: bool = False


class Router(Protocol):
    """What the simulator asks of a policy."""

    name: PolicyName

    def decide(
        self,
        now: float,
        rid: int,
        prompt_len: int,
        hashes: tuple[int, ...],
        match: PrefixMatch,
        view: ClusterView,
        links: Links,
    ) -> Routing: ...

    def on_link(self, now: float, links: Links, prfaas_depth: int) -> None: ...

    def on_accept(self, now: float, uncached_tokens: int) -> None: ...

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: dict[str, int],
        links: Links,
        utilisation: dict[str, float],
    ) -> None: ...

    @property
    def t(self) -> float: ...

    @property
    def base_t(self) -> float: ...


class PrfaasRouter:
    """The production routing path: ``policy.route`` plus both scheduling loops."""

    name: PolicyName = "prfaas"

    def __init__(
        self,
        profile: Profile,
        base_t: float,
        params: PolicyParams,
        *,
        long_term: bool = True,
        split: tuple[int, int] | None = None,
    ) -> None:
        self.profile = profile
        self.params = params
        self.costs = costs_from_profile(profile)
        self.fleet = profile.fleet
        # the short-term raise stops at the planner's t for the live links and this split
        bw_t: Callable[[tuple[float, ...]], float] | None = None
        if split is not None:
            bw_t = functools.partial(threshold_for_bandwidth, profile, *split)
        self.controller = ThresholdController(base_t, params, 0.0, bandwidth_t=bw_t)
        self.longterm = LongTermPlanner(profile) if long_term else None
        self.shape = offload_shape(profile, base_t)
        self.replans = 0

    @property
    def t(self) -> float:
        return self.controller.t

    @property
    def base_t(self) -> float:
        return self.controller.base_t

    def _capacities(self, links: Links, now: float) -> tuple[float, ...] | None:
        """Live capacity per cluster (configured where unreported); None if none reported."""
        stale = self.params.stale_after_s
        out: list[float] = []
        live_any = False
        for c in self.fleet:
            v = fresh(links.get(c.name), now, stale)
            if v is not None and v.capacity_bps > 0:
                out.append(v.capacity_bps / 1e9)
                live_any = True
            else:
                out.append(float(c.egress_gbps))
        return tuple(out) if live_any else None

    def _update(self, links: Links, view: ClusterView | None, now: float) -> float:
        stale = self.params.stale_after_s
        merged = merge_links(fresh(v, now, stale) for v in links.values())
        queues = queue_signal(view) if view is not None else None
        return self.controller.update(merged, queues, now, self._capacities(links, now))

    def decide(
        self,
        now: float,
        rid: int,
        prompt_len: int,
        hashes: tuple[int, ...],
        match: PrefixMatch,
        view: ClusterView,
        links: Links,
    ) -> Routing:
        t = self._update(links, view, now)
        weights = None
        if len(self.fleet) > 1:
            caps = self._capacities(links, now) or tuple(c.egress_gbps for c in self.fleet)
            groups = view.prfaas_groups()
            weights = offload_weights(
                [
                    (c.name, len(groups.get(c.name, ())), g * 1e9)
                    for c, g in zip(self.fleet, caps, strict=True)
                ],
                self.shape,
            )
        req = RouteRequest(str(rid), prompt_len, hashes)
        d = route(req, match, t, links, view, self.costs, self.params, now, weights)
        return Routing(
            target=d.target,
            prefill_node=d.prefill_node,
            decode_node=d.decode_node,
            cached_tokens=d.cached_tokens,
            transfer=d.cache_transfer,
            effective_t=d.effective_t,
            predicted_ttft_s=d.predicted_ttft_s,
            rejected=d.rejected or d.prefill_node is None or d.decode_node is None,
        )

    def on_link(self, now: float, links: Links, prfaas_depth: int) -> None:
        self._update(links, None, now)  # queue signal: the last decision's view

    def on_accept(self, now: float, uncached_tokens: int) -> None:
        if self.longterm is not None:
            self.longterm.observe_arrival(now, uncached_tokens)

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: dict[str, int],
        links: Links,
        utilisation: dict[str, float],
    ) -> None:
        """The router's periodic replan: re-solve t for the current split and live links."""
        if self.longterm is None:
            return
        self.longterm.observe_utilisation(utilisation)
        caps = self._capacities(links, now)
        bw = None if caps is None else {c.name: g for c, g in zip(self.fleet, caps, strict=True)}
        counts = {c.name: n_prfaas.get(c.name, 0) for c in self.fleet}
        rec = self.longterm.replan(now, roles, counts, bw)
        self.controller.set_base(rec.t)
        self.shape = offload_shape(self.profile, rec.t)
        self.replans += 1


class PooledRouter(PrfaasRouter):
    """``single-cluster``: the router that sees the PrfaaS clusters as one (see module doc)."""

    name: PolicyName = "single-cluster"

    def __init__(self, profile: Profile, base_t: float, params: PolicyParams, **kw: object) -> None:
        self.real = profile.fleet
        pooled = dataclasses.replace(profile.with_fleet(), prfaas_clusters=())
        super().__init__(pooled, base_t, params, **kw)  # type: ignore[arg-type]
        self._cluster_of: dict[str, str] = {}

    def _pool(
        self, links: Links, view: ClusterView, match: PrefixMatch
    ) -> tuple[Links, ClusterView, PrefixMatch]:
        groups = view.prfaas_groups()
        for c, nodes in groups.items():
            for n in nodes:
                self._cluster_of[n.name] = c
        merged = merge_links(links.values())
        pooled_view = ClusterView(
            view.prfaas_prefill, view.pd_prefill, view.pd_decode, view.prfaas_queue_depth
        )
        names = [c for c in groups if c != PD_CLUSTER]
        blocks = {PD_CLUSTER: match.blocks.get(PD_CLUSTER, 0)}
        blocks[DEFAULT_PRFAAS] = max((match.blocks.get(c, 0) for c in names), default=0)
        nb: dict[str, dict[str, int]] = {PD_CLUSTER: dict(match.node_blocks.get(PD_CLUSTER, {}))}
        nb[DEFAULT_PRFAAS] = {n: k for c in names for n, k in match.node_blocks.get(c, {}).items()}
        best: dict[str, str | None] = {PD_CLUSTER: match.best_node.get(PD_CLUSTER)}
        pool = nb[DEFAULT_PRFAAS]
        best[DEFAULT_PRFAAS] = min(pool, key=lambda n: (-pool[n], n)) if pool else None
        return {DEFAULT_PRFAAS: merged}, pooled_view, PrefixMatch(blocks, nb, best)

    def decide(
        self,
        now: float,
        rid: int,
        prompt_len: int,
        hashes: tuple[int, ...],
        match: PrefixMatch,
        view: ClusterView,
        links: Links,
    ) -> Routing:
        plinks, pview, pmatch = self._pool(links, view, match)
        r = super().decide(now, rid, prompt_len, hashes, pmatch, pview, plinks)
        if r.target == DEFAULT_PRFAAS and r.prefill_node is not None:
            real = self._cluster_of.get(r.prefill_node, DEFAULT_PRFAAS)
            # the real cluster's own cache is what the prefill can use
            own = match.blocks.get(real, 0) * self.params.block_size
            r = dataclasses.replace(
                r, target=real, cached_tokens=min(r.cached_tokens, own), transfer=None
            )
        return r

    def on_link(self, now: float, links: Links, prfaas_depth: int) -> None:
        super().on_link(now, {DEFAULT_PRFAAS: merge_links(links.values())}, prfaas_depth)

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: dict[str, int],
        links: Links,
        utilisation: dict[str, float],
    ) -> None:
        pooled = {DEFAULT_PRFAAS: sum(n_prfaas.values())}
        super().replan(
            now, roles, pooled, {DEFAULT_PRFAAS: merge_links(links.values())}, utilisation
        )


class RuleRouter:
    """A fixed threshold on the uncached length in PD; no link, queue or SLO awareness."""

    def __init__(self, name: PolicyName, t: float, block_tokens: int) -> None:
        self.name = name
        self._t = t
        self.block_tokens = block_tokens

    @property
    def t(self) -> float:
        return self._t

    @property
    def base_t(self) -> float:
        return self._t

    def decide(
        self,
        now: float,
        rid: int,
        prompt_len: int,
        hashes: tuple[int, ...],
        match: PrefixMatch,
        view: ClusterView,
        links: Links,
    ) -> Routing:
        total = max(prompt_len, 1)
        l_pd = min(match.blocks.get(PD_CLUSTER, 0) * self.block_tokens, total)
        offload = total - l_pd > self._t
        if offload and not view.prfaas_prefill:
            offload = False  # e.g. homogeneous: nothing to offload to
        elif not offload and not view.pd_prefill:
            offload = True  # e.g. naive has no PD-P: whatever the rule says, PrfaaS prefills
        decode = _least(view.pd_decode, lambda n: n.load)
        if not offload:
            prefill = _least(view.pd_prefill, lambda n: n.queue_s)
            return Routing(
                PD_CLUSTER, prefill, decode, l_pd, None, self._t, rejected=not prefill or not decode
            )
        best: tuple[float, str, str] | None = None
        for c, nodes in view.prfaas_groups().items():
            for n in nodes:
                if best is None or (n.queue_s, n.name) < (best[0], best[1]):
                    best = (n.queue_s, n.name, c)
        assert best is not None
        cached = min(match.blocks.get(best[2], 0) * self.block_tokens, total)
        return Routing(best[2], best[1], decode, cached, None, self._t, rejected=decode is None)

    def on_link(self, now: float, links: Links, prfaas_depth: int) -> None:
        return None

    def on_accept(self, now: float, uncached_tokens: int) -> None:
        return None

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: dict[str, int],
        links: Links,
        utilisation: dict[str, float],
    ) -> None:
        return None


def _least(nodes: tuple[NodeLoad, ...], key: Callable[[NodeLoad], float]) -> str | None:
    best: NodeLoad | None = None
    best_key: tuple[float, str] | None = None
    for n in nodes:
        k = (key(n), n.name)
        if best_key is None or k < best_key:
            best, best_key = n, k
    return None if best is None else best.name


def make_router(
    policy: PolicyName,
    profile: Profile,
    layout: Layout,
    params: PolicyParams,
    *,
    long_term: bool = True,
) -> Router:
    split = (layout.n_p, layout.n_d)
    if policy in ("prfaas", "better-link"):
        r = PrfaasRouter(profile, layout.base_t, params, long_term=long_term, split=split)
        r.name = policy
        return r
    if policy == "single-cluster":
        return PooledRouter(profile, layout.base_t, params, long_term=long_term, split=split)
    return RuleRouter(policy, layout.base_t, params.block_size)


__all__ = [
    "BASE_POLICIES",
    "MULTI_POLICIES",
    "POLICIES",
    "Layout",
    "PolicyName",
    "PooledRouter",
    "PrfaasRouter",
    "Router",
    "Routing",
    "RuleRouter",
    "layout_for",
    "make_router",
    "policy_profile",
]
