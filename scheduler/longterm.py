"""Long-term loop (PrfaaS 3.4.3): re-solve t and N_p / N_d from what traffic actually looks like.

The planner is solved on the *observed* workload: the uncached lengths of recent arrivals
(after prefix matching, which is what the threshold acts on) replace the profile's assumed
distribution once there are enough of them. The result is a recommendation, not an action:
role changes (PD node -> prefill or decode) need an operator or orchestrator to drain and
restart engines, so the router only publishes them (API and metrics). The threshold for the
*current* split is the router's own business and is applied directly.

A change is only recommended when it buys a real gain in Lambda_max (``min_gain``), so noise in
the observed distribution does not make nodes flip roles every cycle. Stage utilisation, as
booked by the router, is reported alongside so an operator can see which stage binds.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from xdc.scheduler.model import evaluate
from xdc.scheduler.planner import solve, threshold_for_bandwidth
from xdc.scheduler.profile import Profile, ProfileError, Workload

MAX_SAMPLES: Final = 100_000


@dataclass(frozen=True, slots=True)
class RoleChange:
    node: str
    from_role: str
    to_role: str


@dataclass(frozen=True)
class Recommendation:
    """What the long-term loop concluded at ``at`` (router clock, seconds)."""

    at: float
    t: float  # threshold for the current split: applied by the router
    target_t: float  # threshold once the recommended split is in place
    n_prfaas: int
    n_p: int
    n_d: int
    current_n_p: int
    current_n_d: int
    role_changes: tuple[RoleChange, ...]
    lambda_max: float  # at the recommended split
    lambda_current: float  # at the current split with its best t
    bottleneck: str
    arrival_rate: float
    samples: int
    workload: str
    utilisation: dict[str, float] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        def num(x: float) -> float | None:
            return round(x, 6) if math.isfinite(x) else None

        return {
            "at": num(self.at),
            "t": num(self.t),
            "target_t": num(self.target_t),
            "n_prfaas": self.n_prfaas,
            "n_p": self.n_p,
            "n_d": self.n_d,
            "current_n_p": self.current_n_p,
            "current_n_d": self.current_n_d,
            "role_changes": [
                {"node": c.node, "from": c.from_role, "to": c.to_role} for c in self.role_changes
            ],
            "lambda_max": num(self.lambda_max),
            "lambda_current": num(self.lambda_current),
            "bottleneck": self.bottleneck,
            "arrival_rate": num(self.arrival_rate),
            "samples": self.samples,
            "workload": self.workload,
            "utilisation": {k: num(v) for k, v in self.utilisation.items()},
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class Observations:
    """A copy of what the loop saw, so solving can run off the event loop."""

    now: float
    lengths: tuple[int, ...]
    arrival_rate: float
    utilisation: dict[str, float]


class LongTermPlanner:
    """Collects arrivals and utilisation; ``replan`` turns them into a Recommendation.

    ``snapshot`` (cheap, mutates the window) and ``solve`` (pure, tens of ms on a large
    window) are split so the router can run the latter in a worker thread.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        window_s: float = 3600.0,
        min_samples: int = 200,
        min_gain: float = 0.05,
        max_samples: int = MAX_SAMPLES,
    ) -> None:
        self.profile = profile
        self.window_s = window_s
        self.min_samples = min_samples
        self.min_gain = min_gain
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=max_samples)
        self._util: dict[str, float] = {}

    def observe_arrival(self, now: float, uncached_tokens: int) -> None:
        self._arrivals.append((now, max(int(uncached_tokens), 1)))

    def observe_utilisation(self, utilisation: Mapping[str, float]) -> None:
        self._util = dict(utilisation)

    def snapshot(self, now: float) -> Observations:
        cutoff = now - self.window_s
        while self._arrivals and self._arrivals[0][0] < cutoff:
            self._arrivals.popleft()
        arr = self._arrivals
        span = arr[-1][0] - arr[0][0] if len(arr) > 1 else 0.0
        rate = (len(arr) - 1) / span if span > 0 else 0.0
        return Observations(now, tuple(n for _, n in arr), rate, dict(self._util))

    def replan(
        self,
        now: float,
        roles: Mapping[str, str],
        n_prfaas: int | Mapping[str, int],
        bandwidth_gbps: float | Mapping[str, float] | None = None,
    ) -> Recommendation:
        """Solve on the observed workload for the nodes in ``roles`` (PD name -> role)."""
        return self.solve(self.snapshot(now), roles, n_prfaas, bandwidth_gbps)

    def solve(
        self,
        obs: Observations,
        roles: Mapping[str, str],
        n_prfaas: int | Mapping[str, int],
        bandwidth_gbps: float | Mapping[str, float] | None = None,
    ) -> Recommendation:
        """Solve for the PD nodes in ``roles``; ``n_prfaas`` and ``bandwidth_gbps`` are totals
        (one PrfaaS cluster) or per PrfaaS cluster (clusters not named keep the profile's)."""
        now, rate, samples = obs.now, obs.arrival_rate, len(obs.lengths)
        counts = n_prfaas if isinstance(n_prfaas, Mapping) else None
        links = bandwidth_gbps if isinstance(bandwidth_gbps, Mapping) else None
        if counts is not None or links is not None:
            fleet_profile = self.profile.with_fleet(counts, links)
            n_prfaas = fleet_profile.n_prfaas
            bandwidth_gbps = fleet_profile.egress_gbps if links is not None else None
        else:
            fleet_profile = self.profile
        assert not isinstance(n_prfaas, Mapping) and not isinstance(bandwidth_gbps, Mapping)
        reasons: list[str] = []
        profile = fleet_profile
        workload_desc = "profile: " + profile.workload.describe()
        if samples >= self.min_samples:
            wl = Workload.empirical(obs.lengths, output_tokens=profile.workload.output_tokens)
            workload_desc = "observed: " + wl.describe()
            reasons.append(f"solved on {samples} observed uncached lengths")
        else:
            wl = profile.workload
            reasons.append(
                f"only {samples} arrivals observed (< {self.min_samples}): "
                "solved on the profile's workload"
            )
        cur_p = sum(1 for r in roles.values() if r == "prefill")
        cur_d = sum(1 for r in roles.values() if r == "decode")
        n_pd = cur_p + cur_d
        hold = Recommendation(
            at=now,
            t=math.inf if n_prfaas == 0 else 0.0,
            target_t=math.inf if n_prfaas == 0 else 0.0,
            n_prfaas=n_prfaas,
            n_p=cur_p,
            n_d=cur_d,
            current_n_p=cur_p,
            current_n_d=cur_d,
            role_changes=(),
            lambda_max=0.0,
            lambda_current=0.0,
            bottleneck="unknown",
            arrival_rate=rate,
            samples=samples,
            workload=workload_desc,
            utilisation=obs.utilisation,
        )
        if n_pd < 2 or cur_d < 1:
            why = f"PD cluster has {cur_p} prefill / {cur_d} decode nodes: nothing to rebalance"
            return dataclasses.replace(hold, reasons=(*reasons, why))
        try:
            p2 = dataclasses.replace(
                profile.with_fleet({profile.fleet[0].name: n_prfaas})
                if len(profile.fleet) == 1
                else profile,
                workload=wl,
                n_pd=n_pd,
            )
        except ProfileError as e:
            return dataclasses.replace(hold, reasons=(*reasons, f"cannot build profile: {e}"))
        plan = solve(p2, bandwidth_gbps)
        bw = plan.bandwidth_gbps
        t_cur = threshold_for_bandwidth(p2, cur_p, cur_d, bw)
        cur = evaluate(p2, t_cur, n_prfaas, cur_p, cur_d, bandwidth_gbps=bw)
        lam_cur = cur.lambda_max
        gain = plan.best.lambda_max / lam_cur - 1.0 if lam_cur > 0 else math.inf
        changes: list[RoleChange] = []
        n_p, n_d = cur_p, cur_d
        if (plan.n_p, plan.n_d) != (cur_p, cur_d) and gain >= self.min_gain:
            n_p, n_d = plan.n_p, plan.n_d
            changes = _role_changes(roles, plan.n_p - cur_p)
            reasons.append(
                f"N_p/N_d {cur_p}/{cur_d} -> {n_p}/{n_d} raises Lambda_max "
                f"{lam_cur:.3f} -> {plan.best.lambda_max:.3f} req/s (+{gain:.1%}); "
                f"bottleneck now {plan.best.bottleneck}"
            )
        elif (plan.n_p, plan.n_d) != (cur_p, cur_d):
            reasons.append(
                f"best split {plan.n_p}/{plan.n_d} gains only {gain:.1%} "
                f"(< {self.min_gain:.0%}): keep {cur_p}/{cur_d}"
            )
        else:
            reasons.append(f"current split {cur_p}/{cur_d} is optimal")
        if rate > 0:
            reasons.append(
                f"observed arrivals {rate:.3f} req/s vs Lambda_max {lam_cur:.3f} at current split"
            )
        if obs.utilisation:
            neck = max(obs.utilisation, key=lambda k: obs.utilisation[k])
            reasons.append(f"busiest stage by booked utilisation: {neck}")
        return dataclasses.replace(
            hold,
            t=t_cur,
            target_t=plan.best.t if changes else t_cur,
            n_p=n_p,
            n_d=n_d,
            role_changes=tuple(changes),
            lambda_max=plan.best.lambda_max if changes else lam_cur,
            lambda_current=lam_cur,
            bottleneck=plan.best.bottleneck if changes else cur.bottleneck,
            reasons=tuple(reasons),
        )


def _role_changes(roles: Mapping[str, str], more_prefill: int) -> list[RoleChange]:
    """Which PD nodes to convert: ``more_prefill`` > 0 turns decode nodes into prefill nodes.

    Picks by name from the end of the sorted list so the choice is stable across replans.
    """
    if more_prefill > 0:
        pool = sorted((n for n, r in roles.items() if r == "decode"), reverse=True)
        return [RoleChange(n, "decode", "prefill") for n in pool[:more_prefill]]
    pool = sorted((n for n, r in roles.items() if r == "prefill"), reverse=True)
    return [RoleChange(n, "prefill", "decode") for n in pool[:-more_prefill]]
