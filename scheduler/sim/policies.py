"""The four routing policies the replay simulator compares, behind one small interface.

``prfaas`` is the real router: every arrival goes through ``scheduler.policy.route`` with the
prefix match from the real index, the link state a monitor would report and the live queue
view; the short-term loop (``ThresholdController`` over ``effective_threshold``) adjusts ``t``
from link state and PrfaaS queue depth, and the long-term loop (``LongTermPlanner``) re-solves
the base ``t`` on a timer from observed uncached lengths and the live link capacity.

The baselines are deliberately plain rules, as in the paper's Table 6:
* ``homogeneous``: only PD-type instances, best ``N_p / N_d`` of the planner, no offload;
* ``naive``: every prefill on PrfaaS (``t = 0``), every PD instance decodes;
* ``static-threshold``: the prfaas split and ``t`` solved once at the nominal bandwidth and
  never adapted: offload when the uncached length in PD exceeds ``t``, whatever the link does.
Rule routers send a request to the prefill instance with the least queued work and the decode
instance with the least committed load; they never reject.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from xdc.scheduler.cacheindex import PrefixMatch
from xdc.scheduler.linkstate import LinkView
from xdc.scheduler.longterm import LongTermPlanner
from xdc.scheduler.planner import Plan, threshold_for_bandwidth
from xdc.scheduler.policy import (
    CacheTransfer,
    ClusterView,
    NodeLoad,
    PolicyParams,
    RouteRequest,
    ThresholdController,
    costs_from_profile,
    queue_signal,
    route,
)
from xdc.scheduler.profile import Profile

PolicyName = Literal["prfaas", "homogeneous", "naive", "static-threshold"]
POLICIES: Final[tuple[PolicyName, ...]] = ("prfaas", "homogeneous", "naive", "static-threshold")


@dataclass(frozen=True, slots=True)
class Layout:
    """Instances a policy runs on and the threshold it starts from."""

    n_prfaas: int
    n_p: int
    n_d: int
    base_t: float


def layout_for(policy: PolicyName, plan: Plan) -> Layout:
    """Instance counts per policy, from the planner's solution and its two baselines."""
    if policy in ("prfaas", "static-threshold"):
        return Layout(plan.n_prfaas, plan.n_p, plan.n_d, plan.best.t)
    if policy == "homogeneous":
        h = plan.homogeneous
        return Layout(0, h.n_p, h.n_d, math.inf)
    n = plan.naive
    return Layout(n.n_prfaas, 0, n.n_d, 0.0)


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
        link: LinkView | None,
    ) -> Routing: ...

    def on_link(self, now: float, link: LinkView | None, prfaas_depth: int) -> None: ...

    def on_accept(self, now: float, uncached_tokens: int) -> None: ...

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: int,
        link: LinkView | None,
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
        self.params = params
        self.costs = costs_from_profile(profile)
        # the short-term raise stops at the planner's t for the live link and this split
        bw_t: Callable[[tuple[float, ...]], float] | None = None
        if split is not None:
            bw_t = functools.partial(threshold_for_bandwidth, profile, *split)
        self.controller = ThresholdController(base_t, params, 0.0, bandwidth_t=bw_t)
        self.longterm = LongTermPlanner(profile) if long_term else None
        self.replans = 0

    @property
    def t(self) -> float:
        return self.controller.t

    @property
    def base_t(self) -> float:
        return self.controller.base_t

    def decide(
        self,
        now: float,
        rid: int,
        prompt_len: int,
        hashes: tuple[int, ...],
        match: PrefixMatch,
        view: ClusterView,
        link: LinkView | None,
    ) -> Routing:
        t = self.controller.update(link, queue_signal(view), now)
        req = RouteRequest(str(rid), prompt_len, hashes)
        d = route(req, match, t, link, view, self.costs, self.params, now)
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

    def on_link(self, now: float, link: LinkView | None, prfaas_depth: int) -> None:
        self.controller.update(link, None, now)  # queue signal: the last decision's view

    def on_accept(self, now: float, uncached_tokens: int) -> None:
        if self.longterm is not None:
            self.longterm.observe_arrival(now, uncached_tokens)

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: int,
        link: LinkView | None,
        utilisation: dict[str, float],
    ) -> None:
        """The router's periodic replan: re-solve t for the current split and live link."""
        if self.longterm is None:
            return
        self.longterm.observe_utilisation(utilisation)
        bw = link.capacity_bps / 1e9 if link is not None and link.capacity_bps > 0 else None
        rec = self.longterm.replan(now, roles, n_prfaas, bw)
        self.controller.set_base(rec.t)
        self.replans += 1


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
        link: LinkView | None,
    ) -> Routing:
        total = max(prompt_len, 1)
        own = {c: min(match.blocks.get(c, 0) * self.block_tokens, total) for c in ("prfaas", "pd")}
        target: Literal["prfaas", "pd"] = "pd" if total - own["pd"] <= self._t else "prfaas"
        nodes = view.prfaas_prefill if target == "prfaas" else view.pd_prefill
        if not nodes:  # e.g. naive has no PD-P: whatever the rule says, PrfaaS prefills
            target = "prfaas" if target == "pd" else "pd"
            nodes = view.prfaas_prefill if target == "prfaas" else view.pd_prefill
        prefill = _least(nodes, lambda n: n.queue_s)
        decode = _least(view.pd_decode, lambda n: n.load)
        return Routing(
            target=target,
            prefill_node=prefill,
            decode_node=decode,
            cached_tokens=own[target],
            transfer=None,
            effective_t=self._t,
            rejected=prefill is None or decode is None,
        )

    def on_link(self, now: float, link: LinkView | None, prfaas_depth: int) -> None:
        return None

    def on_accept(self, now: float, uncached_tokens: int) -> None:
        return None

    def replan(
        self,
        now: float,
        roles: dict[str, str],
        n_prfaas: int,
        link: LinkView | None,
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
    if policy == "prfaas":
        return PrfaasRouter(
            profile, layout.base_t, params, long_term=long_term, split=(layout.n_p, layout.n_d)
        )
    return RuleRouter(policy, layout.base_t, params.block_size)


__all__ = [
    "POLICIES",
    "Layout",
    "PolicyName",
    "PrfaasRouter",
    "Router",
    "Routing",
    "RuleRouter",
    "layout_for",
    "make_router",
]
