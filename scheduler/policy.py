"""Per-request routing: PrfaaS section 3.4.3 (short term) with Mooncake's TTFT estimate.

Everything here is a pure function of explicit inputs, so the HTTP router and the replay
simulator run the same code and a decision can be replayed from its inputs. The rule:

* bandwidth **scarce** (link congested or warning, utilisation >= ``util_scarce``, PrfaaS
  waiting work surging, or link state unknown/stale): each cluster is judged on its own cache; if
  ``l_total - l_pd <= t`` prefill in PD-P, else offload to PrfaaS;
* bandwidth **abundant**: ``l_prefix = max(l_prfaas, l_pd)``; if ``l_total - l_prefix <= t``
  prefill in PD-P, else PrfaaS; when the longer prefix sits in the other cluster it is
  transferred across, provided moving it is faster than recomputing it (Mooncake's
  "fetch only when it beats recompute").

Predicted TTFT follows Mooncake Algorithm 1: transfer + queue + prefill, where a PrfaaS
prefill streams its KV layer by layer, so compute and the KV stream overlap. When the rule's
choice misses the TTFT SLO the other cluster is tried; when nothing meets it, the request is
rejected with the predicted numbers as the reason (the gateway answers 429).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import xxhash
from xdc.scheduler.cacheindex import PrefixMatch
from xdc.scheduler.link_table import LinkView, available_bps, fresh
from xdc.scheduler.planner import OffloadShape
from xdc.scheduler.profile import DEFAULT_PRFAAS, PD_CLUSTER

from xdc.linkreport import LinkCause, health_of_rank, health_rank

# A target is a cluster name: PD_CLUSTER ("pd") for PD-P, else a PrfaaS cluster's name.
Target = str
Pressure = Literal["raise", "hold", "lower"]
LinksArg = LinkView | None | Mapping[str, LinkView | None]


def _label(cluster: str) -> str:
    if cluster == PD_CLUSTER:
        return "PD-P"
    return "PrfaaS" if cluster == DEFAULT_PRFAAS else f"PrfaaS {cluster}"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the gateway knows when a request arrives; ``hashes`` are its block keys."""

    rid: str
    prompt_len: int
    hashes: tuple[int, ...] = ()
    ttft_slo_s: float | None = None


class QueueSignal(NamedTuple):
    """Mean predicted wait (seconds) before a new prefill starts, per PrfaaS and per PD-P
    instance. Seconds per instance, not a summed request count: a count includes requests in
    service and grows with the number of nodes, so it reads a normally busy cluster as a
    surge. ``pd_s`` is inf when there is no PD-P node (nothing can shift onto it)."""

    prfaas_s: float = 0.0
    pd_s: float = 0.0


class NodeLoad(NamedTuple):
    """One node's load: ``queue_s`` = predicted wait before a new prefill starts there;
    ``load`` = fraction of decode capacity in use (decode nodes; 1.0 is full).

    A NamedTuple rather than a frozen dataclass: the router builds one per node per request,
    and tuple construction costs about half."""

    name: str
    queue_s: float = 0.0
    load: float = 0.0
    # the engine instance the node is a role of ("" = its own): a PD instance that both
    # prefills and decodes is one PD-P and one PD-D node of one instance
    instance: str = ""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Snapshot of the nodes by role and the PrfaaS request queue depth.

    ``prfaas_prefill`` holds every PrfaaS node; ``prfaas_by_cluster`` splits them by PrfaaS
    cluster when there are several (None = they all belong to the one cluster ``prfaas``).
    """

    prfaas_prefill: tuple[NodeLoad, ...]
    pd_prefill: tuple[NodeLoad, ...]
    pd_decode: tuple[NodeLoad, ...]
    prfaas_queue_depth: int = 0
    prfaas_by_cluster: Mapping[str, tuple[NodeLoad, ...]] | None = None

    def prfaas_groups(self) -> Mapping[str, tuple[NodeLoad, ...]]:
        """PrfaaS prefill nodes by cluster name."""
        if self.prfaas_by_cluster is not None:
            return self.prfaas_by_cluster
        return {DEFAULT_PRFAAS: self.prfaas_prefill}


@dataclass(frozen=True, slots=True)
class CostModel:
    """Profile-derived costs. Prefill functions take (total tokens, cached tokens) and return
    seconds; ``kv_bytes(upto, already)`` is the KV bytes for tokens (already, upto], including
    the fixed per-request state of linear-attention layers; ``egress_bps`` is the PrfaaS
    egress link capacity assumed when the monitor has not reported one."""

    prfaas_prefill_s: Callable[[int, int], float]
    pd_prefill_s: Callable[[int, int], float]
    kv_bytes: Callable[[int, int], float]
    egress_bps: float
    egress_bps_by_cluster: Mapping[str, float] = field(default_factory=dict)

    def prefill_s(self, target: str, total: int, cached: int) -> float:
        fn = self.pd_prefill_s if target == PD_CLUSTER else self.prfaas_prefill_s
        return fn(total, cached)

    def egress_of(self, cluster: str) -> float:
        """The configured capacity of ``cluster``'s link (bits/s), for when none is reported."""
        return self.egress_bps_by_cluster.get(cluster, self.egress_bps)


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Knobs of the short-term policy; defaults are the router's."""

    block_size: int = 512
    ttft_slo_s: float = 10.0
    util_scarce: float = 0.8  # utilisation at/above which bandwidth is scarce and t rises
    util_clear: float = 0.6  # below this (link ok, queue clear) a raised t falls back
    queue_scarce_s: float = 8.0  # mean PrfaaS wait per instance counted as a surge
    queue_clear_s: float = 2.0  # mean PrfaaS wait per instance counted as clear
    stale_after_s: float = 5.0  # link state older than this is unknown
    min_link_share: float = 0.1  # bandwidth floor a new transfer gets on a busy link
    raise_per_s: float = 1.5  # t multiplier per second of pressure
    min_raise_tokens_per_s: float = 512.0  # so that a zero t can still rise
    max_raise: float = 4.0  # cap on t / base_t
    decay_half_life_s: float = 10.0  # excess t halves this fast once pressure clears
    max_decode_load: float = 1.0  # decode nodes at/over this load take no new requests
    # decode nodes within this much load of the least loaded one compete on cached prefix
    decode_affinity_slack: float = 0.2
    # an offload predicted no faster than PD-P stays local (router.keep_local_when_faster)
    keep_local_when_faster: bool = False


@dataclass(frozen=True, slots=True)
class CacheTransfer:
    """A cross-cluster prefix move: blocks [first_block, first_block + blocks) of the request."""

    source_cluster: str
    source_node: str | None
    dest_cluster: str
    first_block: int
    blocks: int
    bytes: float
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "source_cluster": self.source_cluster,
            "source_node": self.source_node,
            "dest_cluster": self.dest_cluster,
            "first_block": self.first_block,
            "blocks": self.blocks,
            "bytes": round(self.bytes),
            "seconds": _r(self.seconds),
        }


@dataclass(slots=True)
class Decision:
    """The router's answer. ``predicted_ttft_s = transfer_s + queue_s + prefill_s``, where
    ``transfer_s`` is cache-transfer time plus any part of the KV stream not hidden behind
    prefill; ``kv_bytes`` is what crosses the link PrfaaS -> PD (0 for PD-P)."""

    rid: str
    target: Target
    prefill_node: str | None
    decode_node: str | None
    uncached_tokens: int
    cached_tokens: int
    cache_transfer: CacheTransfer | None
    predicted_ttft_s: float
    effective_t: float
    reasons: list[str]
    rejected: bool
    mode: str = "scarce"
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    kv_bytes: float = 0.0
    link: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "rid": self.rid,
            "target": self.target,
            "prefill_node": self.prefill_node,
            "decode_node": self.decode_node,
            "uncached_tokens": self.uncached_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_transfer": None
            if self.cache_transfer is None
            else self.cache_transfer.to_json(),
            "predicted_ttft_s": _r(self.predicted_ttft_s),
            "effective_t": _r(self.effective_t),
            "reasons": list(self.reasons),
            "rejected": self.rejected,
            "mode": self.mode,
            "queue_s": _r(self.queue_s),
            "prefill_s": _r(self.prefill_s),
            "transfer_s": _r(self.transfer_s),
            "kv_bytes": round(self.kv_bytes),
            "link": self.link,
        }


def _r(x: float) -> float | None:
    """JSON has no infinity; an impossible option reports null."""
    return round(x, 6) if math.isfinite(x) else None


# --- bandwidth state and the threshold -------------------------------------------------------


def queue_signal(view: ClusterView) -> QueueSignal:
    """Mean predicted wait per PrfaaS and per PD-P prefill instance."""
    pr, pd = view.prfaas_prefill, view.pd_prefill
    prfaas_s = sum(n.queue_s for n in pr) / len(pr) if pr else 0.0
    pd_s = sum(n.queue_s for n in pd) / len(pd) if pd else math.inf
    return QueueSignal(prfaas_s, pd_s)


def queue_surge(queues: QueueSignal, params: PolicyParams) -> bool:
    """PrfaaS has a real backlog *and* PD-P could absorb work: PD-P's predicted queue is
    shorter. At the balanced optimum both are equally loaded; shifting work onto a PD-P that
    is as backed up as PrfaaS only moves the queue (and nothing would push it back)."""
    return queues.prfaas_s >= params.queue_scarce_s and queues.pd_s < queues.prfaas_s


def bandwidth_scarce(
    link: LinkView | None, queues: QueueSignal, now: float, params: PolicyParams
) -> tuple[bool, str]:
    """Scarce or abundant, and why (the why goes into the decision's reasons)."""
    if link is None:
        return True, "no live link report"
    live = fresh(link, now, params.stale_after_s)
    if live is None:
        return True, f"link state stale ({link.age_s(now):.1f}s old)"
    if live.state == "congested":
        return True, f"link congested ({live.cause})"
    if live.state == "warn":
        return True, "link warning (loss or RTT rising)"
    if live.utilisation >= params.util_scarce:
        return True, f"utilisation {live.utilisation:.0%} >= {params.util_scarce:.0%}"
    if queue_surge(queues, params):
        return True, (
            f"PrfaaS wait {queues.prfaas_s:.1f}s/instance >= {params.queue_scarce_s:.1f}s "
            f"(PD-P {queues.pd_s:.1f}s)"
        )
    return False, (
        f"link ok, utilisation {live.utilisation:.0%}, PrfaaS wait {queues.prfaas_s:.1f}s/instance"
    )


def _link_hot(live: LinkView | None, params: PolicyParams) -> bool:
    return live is not None and (
        live.state == "congested" or live.utilisation >= params.util_scarce
    )


def link_pressure(
    link: LinkView | None, queues: QueueSignal, now: float, params: PolicyParams
) -> Pressure:
    """Whether t should rise, hold, or fall back.

    The gap between ``util_clear`` and ``util_scarce`` (and the "warn" state) is a hysteresis
    band: t neither rises nor falls there, so it does not flap around a single threshold. An
    unknown link holds t: there is no evidence either way. A raised t also falls back on a
    quiet link when PD-P's queue has caught up with PrfaaS's: the raise moved load onto PD-P,
    and that is the signal it went far enough.
    """
    live = fresh(link, now, params.stale_after_s)
    if _link_hot(live, params) or queue_surge(queues, params):
        return "raise"
    if live is None:
        return "hold"
    if (
        live.state == "ok"
        and live.utilisation <= params.util_clear
        and (queues.prfaas_s <= params.queue_clear_s or queues.pd_s >= queues.prfaas_s)
    ):
        return "lower"
    return "hold"


def effective_threshold(
    base_t: float,
    link: LinkView | None,
    queues: QueueSignal,
    *,
    prev_t: float,
    dt_s: float,
    now: float,
    params: PolicyParams,
    bandwidth_t: float | None = None,
) -> float:
    """The threshold to route with, given the planner's ``base_t`` and the previous value.

    Under pressure t grows geometrically with time (fewer, longer requests offload, which
    cuts bytes per second on the link). A raise for *link* pressure stops at ``bandwidth_t``,
    the planner's t for the live capacity, when known: beyond it the link idles while PD-P
    overloads. A raise for *queue* pressure (or link pressure with no bandwidth target) stops
    at ``max_raise * base_t``. When pressure clears the excess decays with a half-life back
    to ``base_t``. Time-based, so calling it per request or per link report gives the same
    trajectory. Never below ``base_t``.
    """
    if not math.isfinite(base_t):
        return base_t  # t = inf: nothing offloads, there is nothing to raise
    dt = max(dt_s, 0.0)
    cur = max(prev_t, base_t) if math.isfinite(prev_t) else base_t
    p = link_pressure(link, queues, now, params)
    if p == "raise":
        fixed_cap = max(base_t * params.max_raise, base_t + params.min_raise_tokens_per_s * 60)
        cap = 0.0
        if queue_surge(queues, params):
            cap = fixed_cap
        if _link_hot(fresh(link, now, params.stale_after_s), params):
            cap = max(cap, fixed_cap if bandwidth_t is None else bandwidth_t)
        if cap <= cur:
            return cur  # at the bound: hold, never fall under pressure
        grown = max(
            cur * math.pow(params.raise_per_s, dt), cur + params.min_raise_tokens_per_s * dt
        )
        return min(grown, cap)
    if p == "lower":
        excess = (cur - base_t) * math.pow(0.5, dt / params.decay_half_life_s)
        return base_t if excess < 1.0 else base_t + excess
    return cur


class ThresholdController:
    """Holds the current effective t between calls of :func:`effective_threshold`.

    ``bandwidth_t(capacities_gbps)`` gives the planner's t for the live link capacities, one
    per PrfaaS cluster in the profile's order (e.g. ``planner.threshold_for_bandwidth`` for the
    current split); results are cached per capacities rounded to 3 significant digits, since
    the solve costs milliseconds. The last queue signal is remembered so a link report (which
    carries none) still sees it.
    """

    _CACHE_MAX = 256

    def __init__(
        self,
        base_t: float,
        params: PolicyParams,
        now: float,
        *,
        bandwidth_t: Callable[[tuple[float, ...]], float] | None = None,
    ) -> None:
        self.base_t = base_t
        self.t = base_t
        self.params = params
        self.queues = QueueSignal()
        self._bandwidth_t = bandwidth_t
        self._bw_cache: dict[tuple[float, ...], float] = {}
        self._last = now

    def bandwidth_target(
        self, link: LinkView | None, now: float, capacities_gbps: Sequence[float] | None = None
    ) -> float | None:
        """The planner's t for the live capacities; None when unknown.

        ``capacities_gbps`` are the per-cluster figures (the caller fills in the configured
        capacity of a link nobody reports on); without them the one ``link``'s capacity is
        used, if fresh.
        """
        if self._bandwidth_t is None:
            return None
        if capacities_gbps is None:
            live = fresh(link, now, self.params.stale_after_s)
            if live is None or live.capacity_bps <= 0:
                return None
            capacities_gbps = (live.capacity_bps / 1e9,)
        key = tuple(float(f"{c:.3g}") for c in capacities_gbps)
        t = self._bw_cache.get(key)
        if t is None:
            if len(self._bw_cache) >= self._CACHE_MAX:
                self._bw_cache.clear()
            t = self._bw_cache[key] = self._bandwidth_t(key)
        return t

    def forget_bandwidth_targets(self) -> None:
        """The split changed: cached targets were for the old one."""
        self._bw_cache.clear()

    def update(
        self,
        link: LinkView | None,
        queues: QueueSignal | None,
        now: float,
        capacities_gbps: Sequence[float] | None = None,
    ) -> float:
        """Advance t to ``now``. ``link`` is the PrfaaS egress as one (the fleet's links
        merged by ``merge_links``); ``capacities_gbps`` per cluster, see ``bandwidth_target``.
        """
        if queues is not None:
            self.queues = queues
        dt = now - self._last
        if dt < 0:
            return self.t
        self._last = now
        self.t = effective_threshold(
            self.base_t,
            link,
            self.queues,
            prev_t=self.t,
            dt_s=dt,
            now=now,
            params=self.params,
            bandwidth_t=self.bandwidth_target(link, now, capacities_gbps),
        )
        return self.t

    def set_base(self, base_t: float) -> None:
        """A replan changed t; a raise in progress continues from max(current, new base)."""
        raised = self.t > self.base_t
        self.base_t = base_t
        self.t = max(self.t, base_t) if raised else base_t


# --- the PrfaaS fleet: several clusters, each behind its own link ---------------------------


def merge_links(views: Iterable[LinkView | None]) -> LinkView | None:
    """The PrfaaS egress as a whole, from the (fresh) links of its clusters: goodput and
    capacity add up, loss, RTT and state are the worst, ``updated_at`` the newest. What the
    threshold controller watches; None when no link is known."""
    goodput = cap = retrans = rtt = 0.0
    worst = 0
    cause = LinkCause.CLEAR
    newest = -math.inf
    n = 0
    for v in views:
        if v is None:
            continue
        n += v.reporters
        goodput += v.goodput_bps
        cap += v.capacity_bps
        retrans = max(retrans, v.retrans_ratio)
        rtt = max(rtt, v.rtt_ms)
        rank = health_rank(v.state)
        if rank > worst or (rank == worst and cause == LinkCause.CLEAR):
            cause = v.cause
        worst = max(worst, rank)
        newest = max(newest, v.updated_at)
    if n == 0:
        return None
    return LinkView(
        utilisation=goodput / cap if cap > 0 else 0.0,
        goodput_bps=goodput,
        capacity_bps=cap,
        state=health_of_rank(worst),
        retrans_ratio=retrans,
        rtt_ms=rtt,
        updated_at=newest,
        reporters=n,
        cause=cause,
    )


def offload_weights(
    clusters: Sequence[tuple[str, int, float]], shape: OffloadShape
) -> dict[str, float]:
    """Requests/s each PrfaaS cluster sustains: ``min(N_c / T_prefill, B_c / S_kv)`` for
    ``(name, instances, link bits/s)``. Offloaded traffic is split in proportion to these,
    which is the split under which the fleet sustains the sum (the planner's eq. 3), and a
    link whose capacity drops loses its share at once."""
    out: dict[str, float] = {}
    for name, n, bps in clusters:
        compute = n / shape.prefill_s if shape.prefill_s > 0 else (math.inf if n > 0 else 0.0)
        egress = bps / shape.kv_bits if shape.kv_bits > 0 else math.inf
        w = min(compute, egress)
        out[name] = w if math.isfinite(w) else 1e12
    return out


def pick_prfaas(rid: str, weights: Mapping[str, float]) -> str | None:
    """Weighted rendezvous hashing: cluster c wins request ``rid`` with probability
    ``w_c / sum(w)``, and the choice is a pure function of (rid, weights), so every router
    replica sends the same request to the same cluster and a retried request lands where it
    did. Ties (none in practice) go to the smaller name."""
    best: str | None = None
    best_score = math.inf
    key = rid.encode()
    for name, w in weights.items():
        if not w > 0:
            continue
        h = xxhash.xxh3_64_intdigest(key, seed=_seed(name))
        u = (h + 0.5) / 18446744073709551616.0  # in (0, 1)
        score = -math.log(u) / w
        if score < best_score or (score == best_score and best is not None and name < best):
            best, best_score = name, score
    return best


_SEEDS: dict[str, int] = {}


def _seed(name: str) -> int:
    seed = _SEEDS.get(name)
    if seed is None:
        if len(_SEEDS) > 4096:
            _SEEDS.clear()
        seed = _SEEDS[name] = xxhash.xxh3_64_intdigest(name.encode())
    return seed


# --- options and the route -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Option:
    target: Target
    cached: int
    transfer: CacheTransfer | None
    node: str | None
    ttft: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    kv_bytes: float


def _evaluate(
    target: Target,
    cached: int,
    transfer: CacheTransfer | None,
    total: int,
    l_pd: int,
    match: PrefixMatch,
    nodes: tuple[NodeLoad, ...],
    costs: CostModel,
    bw_bps: float,
    slo: float,
) -> _Option:
    """Predict TTFT on each prefill node of ``target`` and pick one.

    Node choice is cache affinity, then load: among nodes that meet the SLO, the one holding
    the longest prefix itself (no intra-cluster fetch), then the shortest queue, then name
    for determinism. If none meets the SLO, the fastest, so the caller can report it.
    """
    prefill = costs.prefill_s(target, total, cached)
    xfer = transfer.seconds if transfer is not None else 0.0
    kv = 0.0
    exposed = 0.0
    if target != PD_CLUSTER:
        kv = costs.kv_bytes(total, min(l_pd, total))
        exposed = max(kv * 8.0 / bw_bps - prefill, 0.0)
    affinity = match.node_blocks.get(target, {})
    best: NodeLoad | None = None
    best_key: tuple[int, float, float, str] | None = None
    for n in nodes:
        ttft = xfer + n.queue_s + prefill + exposed
        key = (0 if ttft <= slo else 1, -affinity.get(n.name, 0), n.queue_s, n.name)
        if key[0] == 1:
            key = (1, 0, ttft, n.name)
        if best_key is None or key < best_key:
            best, best_key = n, key
    queue = best.queue_s if best is not None else math.inf
    return _Option(
        target=target,
        cached=cached,
        transfer=transfer,
        node=best.name if best is not None else None,
        ttft=xfer + queue + prefill + exposed,
        queue_s=queue,
        prefill_s=prefill,
        transfer_s=xfer + exposed,
        kv_bytes=kv,
    )


def _cache_transfer(
    src: Target,
    dst: Target,
    match: PrefixMatch,
    total: int,
    block_size: int,
    costs: CostModel,
    bw_bps: float,
) -> CacheTransfer:
    src_blocks, dst_blocks = match.blocks.get(src, 0), match.blocks.get(dst, 0)
    src_tok = min(src_blocks * block_size, total)
    dst_tok = min(dst_blocks * block_size, total)
    nbytes = costs.kv_bytes(src_tok, dst_tok)
    return CacheTransfer(
        source_cluster=src,
        source_node=match.best_node.get(src),
        dest_cluster=dst,
        first_block=dst_blocks,
        blocks=src_blocks - dst_blocks,
        bytes=nbytes,
        seconds=nbytes * 8.0 / bw_bps,
    )


def _cmp(a: int, t: float) -> str:
    return f"{a} <= t={t:.0f}" if a <= t else f"{a} > t={t:.0f}"


def _mean_queue(nodes: tuple[NodeLoad, ...], empty: float) -> float:
    return sum(n.queue_s for n in nodes) / len(nodes) if nodes else empty


def route(
    req: RouteRequest,
    match: PrefixMatch,
    t: float,
    links: LinksArg,
    view: ClusterView,
    costs: CostModel,
    params: PolicyParams,
    now: float,
    weights: Mapping[str, float] | None = None,
    links_down: Mapping[str, str] | None = None,
    intakes_down: Mapping[str, str] | None = None,
) -> Decision:
    """Decide where ``req`` prefills and decodes; see the module docstring for the rule.

    ``links_down`` (PrfaaS cluster -> why) and ``intakes_down`` (decode node -> why) are out
    of use (``scheduler.outages``): nothing is offloaded over a link that is down, and no
    offloaded request's KV goes to a decode node that can not take it in (that node still
    decodes what PD-P prefills).

    ``links`` is the link state per PrfaaS cluster (a single value stands for the one
    cluster's link); ``weights`` the offload share of each PrfaaS cluster
    (``offload_weights``; None = equal among clusters with nodes). The PrfaaS cluster a
    request would go to is picked by ``pick_prfaas`` from those weights, unless another
    PrfaaS cluster holds a longer prefix of it and predicts a TTFT at least as good there
    (cache affinity); the paper's rule then decides between that cluster and PD-P on that
    cluster's link, and every other cluster is an alternative when the choice misses the SLO.
    """
    total = max(int(req.prompt_len), 1)
    slo = req.ttft_slo_s if req.ttft_slo_s is not None else params.ttft_slo_s
    bs = params.block_size
    groups = view.prfaas_groups()
    reasons: list[str] = []
    if links_down:
        for c in sorted(set(links_down) & set(groups)):
            reasons.append(f"PrfaaS {c} not used: {links_down[c]}")
        groups = {c: (() if c in links_down else n) for c, n in groups.items()}
    names = list(groups)
    if isinstance(links, Mapping):
        link_of: Mapping[str, LinkView | None] = links
    else:
        link_of = {names[0] if names else DEFAULT_PRFAAS: links}
    stale = params.stale_after_s
    blocks = match.blocks
    l_pd = min(blocks.get(PD_CLUSTER, 0) * bs, total)
    own: dict[str, int] = {PD_CLUSTER: l_pd}
    bw: dict[str, float] = {}
    for c in names:
        own[c] = min(blocks.get(c, 0) * bs, total)
        bw[c] = available_bps(
            fresh(link_of.get(c), now, stale), costs.egress_of(c), params.min_link_share
        )

    def nodes_of(target: Target) -> tuple[NodeLoad, ...]:
        return view.pd_prefill if target == PD_CLUSTER else groups.get(target, ())

    def ev(target: Target, cached: int, xfer: CacheTransfer | None) -> _Option:
        return _evaluate(
            target,
            cached,
            xfer,
            total,
            l_pd,
            match,
            nodes_of(target),
            costs,
            bw.get(target, 1.0),
            slo,
        )

    # Which PrfaaS cluster this request would offload to.
    fc = DEFAULT_PRFAAS
    if len(names) == 1:
        fc = names[0]
    elif names:
        w = weights if weights is not None else {c: 1.0 for c in names if groups[c]}
        if links_down:
            w = {c: x for c, x in w.items() if c not in links_down}
        home = pick_prfaas(req.rid, w) or names[0]
        fc = home
        aff = max(names, key=lambda c: (own[c], c == home))
        why = f"PrfaaS cluster {home} by capacity share"
        if aff != home and own[aff] > own[home]:
            a, h = ev(aff, own[aff], None), ev(home, own[home], None)
            if a.ttft <= h.ttft:
                fc = aff
                why = (
                    f"PrfaaS cluster {aff} holds {own[aff]} cached tokens "
                    f"(share pick {home} holds {own[home]})"
                )
        reasons.append(why)
    l_prfaas = own.get(fc, 0)
    fc_nodes = groups.get(fc, ())
    queues = QueueSignal(_mean_queue(fc_nodes, 0.0), _mean_queue(view.pd_prefill, math.inf))
    scarce, why = bandwidth_scarce(link_of.get(fc), queues, now, params)

    def other(target: Target) -> Target:
        return fc if target == PD_CLUSTER else PD_CLUSTER

    def own_cache_choice() -> _Option:
        target: Target = PD_CLUSTER if total - l_pd <= t else fc
        reasons.append(
            f"uncached in PD l_total-l_pd = {_cmp(total - l_pd, t)} -> {_label(target)}"
            + ("" if target == PD_CLUSTER else f" (PrfaaS own cache {l_prfaas} tokens)")
        )
        return ev(target, own[target], None)

    alts: list[_Option] = []
    if scarce:
        reasons.append(f"bandwidth scarce: {why}; each cluster judged on its own cache")
        primary = own_cache_choice()
    else:
        reasons.append(f"bandwidth abundant: {why}; best prefix across clusters")
        l_prefix = max(l_prfaas, l_pd)
        target: Target = PD_CLUSTER if total - l_prefix <= t else fc
        reasons.append(f"l_total-l_prefix = {_cmp(total - l_prefix, t)} -> {_label(target)}")
        src: Target | None = None
        if l_prfaas != l_pd:
            src = fc if l_prfaas > l_pd else PD_CLUSTER
        if src is None or src == target:
            primary = ev(target, l_prefix, None)
        else:
            xfer = _cache_transfer(src, target, match, total, bs, costs, bw.get(fc, 1.0))
            saved = costs.prefill_s(target, total, own[target]) - costs.prefill_s(
                target, total, l_prefix
            )
            if xfer.seconds < saved:
                reasons.append(
                    f"cache transfer {src}->{target}: {xfer.blocks} blocks, "
                    f"{xfer.bytes / 2**20:.1f} MiB in {xfer.seconds:.3f}s saves {saved:.3f}s"
                )
                primary = ev(target, l_prefix, xfer)
            else:
                reasons.append(
                    f"cache transfer {src}->{target} would take {xfer.seconds:.3f}s but saves "
                    f"only {saved:.3f}s of prefill: judged on own caches instead"
                )
                primary = own_cache_choice()
        oth = other(primary.target)
        if own[oth] < l_prefix:
            alt_x = _cache_transfer(other(oth), oth, match, total, bs, costs, bw.get(fc, 1.0))
            alts.append(ev(oth, l_prefix, alt_x))
    alts.append(ev(other(primary.target), own[other(primary.target)], None))
    for c in names:
        if c != fc:
            alts.append(ev(c, own[c], None))

    chosen = primary
    rejected = False
    if not primary.ttft <= slo:
        ok = [o for o in alts if o.ttft <= slo]
        what = "no prefill node" if primary.node is None else f"predicted TTFT {primary.ttft:.2f}s"
        if ok:
            chosen = min(ok, key=lambda o: o.ttft)
            reasons.append(
                f"{_label(primary.target)}: {what} misses SLO {slo:.2f}s; "
                f"{_label(chosen.target)} meets it at {chosen.ttft:.2f}s"
            )
        else:
            rejected = True
            chosen = min([primary, *alts], key=lambda o: o.ttft)
            parts = ", ".join(
                f"{_label(o.target)} {'no node' if o.node is None else f'{o.ttft:.2f}s'}"
                for o in [primary, *alts]
            )
            reasons.append(f"reject: no choice meets TTFT SLO {slo:.2f}s ({parts})")

    if params.keep_local_when_faster and not rejected and chosen.target != PD_CLUSTER:
        local = next((o for o in alts if o.target == PD_CLUSTER and o.node is not None), None)
        if local is not None and local.ttft <= chosen.ttft and local.ttft <= slo:
            reasons.append(
                f"{_label(chosen.target)} predicts TTFT {chosen.ttft:.3f}s, PD-P "
                f"{local.ttft:.3f}s: kept local (keep_local_when_faster)"
            )
            chosen = local

    def pd_node(o: _Option) -> NodeLoad | None:
        if o.target != PD_CLUSTER:
            return None
        return next((n for n in view.pd_prefill if n.name == o.node), None)

    # an offloaded request's KV goes only to a decode node that can take it in
    avoid = intakes_down if chosen.target != PD_CLUSTER and not rejected else None
    decode = _pick_decode(view, params, avoid, prefill=pd_node(chosen), match=match)
    if decode is None and avoid:
        down = ", ".join(f"{n} ({w})" for n, w in sorted(avoid.items()))
        chosen = ev(PD_CLUSTER, own[PD_CLUSTER], None)
        reasons.append(f"no decode node takes KV in now: {down}; -> PD-P")
        decode = _pick_decode(view, params, prefill=pd_node(chosen), match=match)
    if decode is None:
        rejected = True
        reasons.append(
            "reject: no PD-D node"
            if not view.pd_decode
            else f"reject: all {len(view.pd_decode)} PD-D nodes at load >= "
            f"{params.max_decode_load:.2f}"
        )
    return Decision(
        rid=req.rid,
        target=chosen.target,
        prefill_node=chosen.node,
        decode_node=decode,
        uncached_tokens=total - chosen.cached,
        cached_tokens=chosen.cached,
        cache_transfer=chosen.transfer,
        predicted_ttft_s=chosen.ttft,
        effective_t=t,
        reasons=reasons,
        rejected=rejected,
        mode="scarce" if scarce else "abundant",
        queue_s=chosen.queue_s,
        prefill_s=chosen.prefill_s,
        transfer_s=chosen.transfer_s,
        kv_bytes=chosen.kv_bytes,
        link=None if chosen.target == PD_CLUSTER else f"{chosen.target}->{PD_CLUSTER}",
    )


def _pick_decode(
    view: ClusterView,
    params: PolicyParams,
    avoid: Mapping[str, str] | None = None,
    *,
    prefill: NodeLoad | None = None,
    match: PrefixMatch | None = None,
) -> str | None:
    """The decode node, among those with a free slot (Mooncake early rejection on decode
    load) and none of ``avoid``:

    * a PD-P ``prefill`` node's own instance decodes, if it may: its KV is there already
      (another instance would have to be sent it, and a PD-mixed instance has no sender);
    * else, among the nodes within ``decode_affinity_slack`` of the least load, the one whose
      instance holds the longest cached prefix of the request (its engine loads only the
      blocks it lacks), then the least loaded, then by name.
    """
    ok = [
        n
        for n in view.pd_decode
        if n.load < params.max_decode_load and not (avoid and n.name in avoid)
    ]
    if not ok:
        return None
    if prefill is not None and prefill.instance:
        for n in ok:
            if n.instance == prefill.instance:
                return n.name
    floor = min(n.load for n in ok)
    cached: dict[str, int] = {}
    if match is not None:
        held = match.node_blocks.get(PD_CLUSTER, {})
        if held:
            inst = {p.name: p.instance or p.name for p in view.pd_prefill}
            for name, blocks in held.items():
                key = inst.get(name, name)
                cached[key] = max(cached.get(key, 0), blocks)
    best = min(
        (n for n in ok if n.load <= floor + params.decode_affinity_slack),
        key=lambda n: (-cached.get(n.instance or n.name, 0), n.load, n.name),
    )
    return best.name


# --- costs from a profile --------------------------------------------------------------------


class InstanceCosts(Protocol):
    """What the policy needs from a profiled instance type (scheduler.profile.InstanceProfile)."""

    def prefill_time(self, length: float, /) -> float: ...
    def kv_size(self, length: float, /) -> float: ...


class ProfileLike(Protocol):
    @property
    def prfaas(self) -> InstanceCosts: ...
    @property
    def pd(self) -> InstanceCosts: ...
    @property
    def egress_gbps(self) -> float: ...


class Curve:
    """Piecewise-linear table lookup in pure Python.

    Same semantics as ``scheduler.profile.interpolate`` (linear between points, the end
    segments extended, clipped at zero) but ~20x cheaper per scalar call than going through
    numpy, which matters when every routing decision evaluates a dozen costs.
    """

    __slots__ = ("_hi", "_lo", "xs", "ys")

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        if len(xs) < 2 or len(xs) != len(ys):
            raise ValueError("a curve needs >= 2 points and as many ys as xs")
        self.xs = tuple(float(x) for x in xs)
        self.ys = tuple(float(y) for y in ys)
        self._lo = (self.ys[1] - self.ys[0]) / (self.xs[1] - self.xs[0])
        self._hi = (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2])

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            y = ys[0] + self._lo * (x - xs[0])
        elif x >= xs[-1]:
            y = ys[-1] + self._hi * (x - xs[-1])
        else:
            j = bisect.bisect_right(xs, x)
            x0, y0 = xs[j - 1], ys[j - 1]
            y = y0 + (ys[j] - y0) * (x - x0) / (xs[j] - x0)
        return y if y > 0.0 else 0.0


def _curve(
    inst: InstanceCosts, table: str, method: Callable[[float], float]
) -> Callable[[float], float]:
    """A fast Curve when the instance exposes its profiled table, else its own method."""
    xs, ys = getattr(inst, "lengths", None), getattr(inst, table, None)
    if isinstance(xs, tuple) and isinstance(ys, tuple) and len(xs) >= 2 and len(xs) == len(ys):
        return Curve(xs, ys)
    return method


def incremental_prefill(inst: InstanceCosts) -> Callable[[int, int], float]:
    """Prefill seconds for ``total`` tokens of which ``cached`` are already in cache.

    ``T(total) - T(cached)`` keeps the attention cost of the new tokens over the old context
    but drops the fixed per-request overhead; ``T(total - cached)`` keeps the overhead but
    drops the context. The larger of the two is the better estimate of both effects.
    """

    time_of = _curve(inst, "prefill_s", inst.prefill_time)

    def f(total: int, cached: int) -> float:
        new = max(total - cached, 1)
        if cached <= 0:
            return time_of(total)
        return max(time_of(total) - time_of(cached), time_of(new))

    return f


def incremental_kv(inst: InstanceCosts) -> Callable[[int, int], float]:
    """KV bytes for tokens (already, upto]: the growing part plus one fixed linear state."""

    size_of = _curve(inst, "kv_bytes", inst.kv_size)

    def f(upto: int, already: int) -> float:
        if upto <= already:
            return 0.0
        if already <= 0:
            return size_of(upto)
        return max(size_of(upto) - size_of(already), size_of(upto - already))

    return f


def costs_from_profile(profile: ProfileLike) -> CostModel:
    """PrfaaS prefill on the PrfaaS instance type; PD-P prefill and KV sizes on the PD one;
    each PrfaaS cluster's configured link capacity for when its link is not reported."""
    fleet = getattr(profile, "fleet", ())
    return CostModel(
        prfaas_prefill_s=incremental_prefill(profile.prfaas),
        pd_prefill_s=incremental_prefill(profile.pd),
        kv_bytes=incremental_kv(profile.prfaas),
        egress_bps=float(profile.egress_gbps) * 1e9,
        egress_bps_by_cluster={c.name: float(c.egress_gbps) * 1e9 for c in fleet},
    )


__all__ = [
    "CacheTransfer",
    "ClusterView",
    "CostModel",
    "Curve",
    "Decision",
    "NodeLoad",
    "OffloadShape",
    "PolicyParams",
    "QueueSignal",
    "RouteRequest",
    "ThresholdController",
    "bandwidth_scarce",
    "costs_from_profile",
    "effective_threshold",
    "link_pressure",
    "merge_links",
    "offload_weights",
    "pick_prfaas",
    "queue_signal",
    "queue_surge",
    "route",
]
