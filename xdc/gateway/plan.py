"""What the gateway runs for one request, decided from the router's answer (pure).

Two shapes only. ``LOCAL``: one engine prefills and decodes (the router chose PD-P and the
prefill and decode nodes are the same instance). ``REMOTE``: one engine prefills and ships the
KV through xdc, another decodes; the two requests overlap. A cross-cluster cache transfer
towards the PD cluster (the longer prefix sits in a PrfaaS cluster) is a ``REMOTE`` plan whose
prefill runs on the PrfaaS node that *holds* the prefix: it computes only the uncached rest and
its connector ships every block of the request, cached ones included, so the prefix is moved,
not recomputed. A transfer the other way (prefix in PD, prefill offloaded to PrfaaS) would need
a PD -> PrfaaS KV path, which this deployment does not have: the router's prefill node runs and
recomputes that prefix (the route header says ``cache_transfer=recompute``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xdc.errors import ConfigurationError
from xdc.scheduler.profile import PD_CLUSTER


class Path(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"


class Source(enum.Enum):
    ROUTER = "router"
    FALLBACK = "fallback"  # router down, unset or unusable: gateway.fallback_*
    RECOVERY = "recovery"  # the planned prefill failed: the decode instance prefilled itself


class PlanError(ConfigurationError, ValueError):
    """The decision names something this gateway cannot run (e.g. a node it has no URL for)."""


@dataclass(frozen=True, slots=True)
class RequestPlan:
    path: Path
    source: Source
    target: str  # the router's target cluster ("pd", "prfaas", ...; "fallback" without one)
    prefill_node: str
    decode_node: str
    prefill_url: str
    decode_url: str
    cache_transfer: str = ""  # "moved": prefill where the prefix sits; "recompute": cannot move
    cached_tokens: int = 0
    # where the prefill ships the KV: the decode node's receiver ("" = the sender's own peer)
    decode_receiver: str = ""
    # the decode instance prefilled itself after all, and why (its answer says so)
    kv_recomputed: str = ""

    def header(self) -> str:
        """The ``x-xdc-route`` response header: what ran, for clients and logs."""
        parts = [
            f"path={self.path.value}",
            f"source={self.source.value}",
            f"target={self.target}",
            f"prefill={self.prefill_node}",
            f"decode={self.decode_node}",
        ]
        if self.cache_transfer:
            parts.append(f"cache_transfer={self.cache_transfer}")
        if self.cached_tokens:
            parts.append(f"cached={self.cached_tokens}")
        if self.kv_recomputed:
            parts.append(f"kv_recomputed={self.kv_recomputed}")
        return "; ".join(parts)


_TARGET = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _make(
    prefill: str,
    decode: str,
    nodes: Mapping[str, str],
    *,
    source: Source,
    target: str,
    cache_transfer: str = "",
    cached_tokens: int = 0,
) -> RequestPlan:
    for role, name in (("prefill", prefill), ("decode", decode)):
        if name not in nodes:
            raise PlanError(f"{role} node {name!r} has no URL in gateway.nodes")
    p_url, d_url = nodes[prefill], nodes[decode]
    return RequestPlan(
        Path.LOCAL if p_url == d_url else Path.REMOTE,
        source,
        target,
        prefill,
        decode,
        p_url,
        d_url,
        cache_transfer,
        cached_tokens,
    )


def from_decision(decision: Mapping[str, Any], nodes: Mapping[str, str]) -> RequestPlan:
    """The router's /v1/route answer (accepted) -> a plan. A cache transfer moves the prefill
    to the node that holds the prefix (see the module docstring)."""
    prefill, decode = decision.get("prefill_node"), decision.get("decode_node")
    if not isinstance(prefill, str) or not isinstance(decode, str):
        raise PlanError(f"decision without prefill/decode nodes: {prefill!r}, {decode!r}")
    target = decision.get("target")
    if not (isinstance(target, str) and _TARGET.fullmatch(target)):
        target = "?"  # it goes into a response header: nothing but a plain name
    xfer = decision.get("cache_transfer")
    moved = ""
    if isinstance(xfer, Mapping):
        src = xfer.get("source_node")
        if xfer.get("dest_cluster") == PD_CLUSTER and isinstance(src, str):
            prefill, moved = src, "moved"
        else:
            moved = "recompute"
    cached = decision.get("cached_tokens", 0)
    return _make(
        prefill,
        decode,
        nodes,
        source=Source.ROUTER,
        target=target,
        cache_transfer=moved,
        cached_tokens=cached if isinstance(cached, int) and cached >= 0 else 0,
    )


def fallback(prefill: str, decode: str, nodes: Mapping[str, str]) -> RequestPlan:
    """The static plan for when the router cannot be asked."""
    return _make(prefill, decode, nodes, source=Source.FALLBACK, target="fallback")


def recovery(plan: RequestPlan) -> RequestPlan:
    """After a failed remote prefill: the decode instance does it all."""
    return RequestPlan(
        Path.LOCAL,
        Source.RECOVERY,
        plan.target,
        plan.decode_node,
        plan.decode_node,
        plan.decode_url,
        plan.decode_url,
    )
