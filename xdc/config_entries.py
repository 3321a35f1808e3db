"""What list-valued config entries mean, parsed and validated in one place.

A list setting is a TOML array (``allowed_peers = ["h:1", "g:2=rx-g"]``); from the environment
or ``--set`` the same entries come comma-separated, and :func:`entries` is the one place that
splits them. Each kind of entry (a host:port, a peer with its TLS name, a node's engine URL, an
engine's event stream or metrics URL) has one parser here, used by the config's validation and
by the code that acts on it, so the two can not disagree. Pure: nothing here imports upward.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from xdc.linkreport import CLUSTER_NAME

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_URL = re.compile(r"^https?://[^\s/?#]+(:\d{1,5})?/?$")
_ENDPOINT = re.compile(r"^(tcp://[A-Za-z0-9.\-\[\]:*]+:\d{1,5}|ipc://[^\s,]+)$")
_METRICS_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/[^\s,]*)?$")


BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True}
BOOL_WORDS.update({"0": False, "false": False, "no": False, "off": False})
"""How a yes/no setting may be spelled in env, ``--set`` and other text flags (any case)."""


def entries(value: str | Iterable[str]) -> list[str]:
    """A list setting's entries: an array as it is, a string split on commas; each stripped,
    empty ones dropped."""
    items = value.split(",") if isinstance(value, str) else value
    return [s.strip() for s in items if s.strip()]


def host_port(addr: str, where: str) -> tuple[str, int]:
    """``host:port`` (the host may hold colons: an IPv6 literal), or ValueError naming it."""
    host, _, port = addr.strip().rpartition(":")
    if not host or any(c.isspace() for c in host) or not port.isdigit():
        raise ValueError(f"{where}: {addr[:100]!r} is not host:port")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}: {addr[:100]!r} is not host:port (port {port} is not 1..65535)")
    return host, int(port)


def parse_addresses(spec: str | Iterable[str], setting: str) -> tuple[tuple[str, int], ...]:
    """A list of ``host:port`` (``sender.peer_extra_addresses``)."""
    return tuple(host_port(a, setting) for a in entries(spec))


def parse_allowed_peers(spec: str | Iterable[str]) -> dict[tuple[str, int], str | None]:
    """``sender.allowed_peers``: ``host:port`` or ``host:port=tls-name`` -> (host, port) ->
    the name that receiver's certificate must carry (None: its host)."""
    out: dict[tuple[str, int], str | None] = {}
    for item in entries(spec):
        addr, eq, name = item.partition("=")
        where = f"sender.allowed_peers: {item[:80]!r} is not host:port[=tls-name]"
        try:
            key = host_port(addr, "sender.allowed_peers")
        except ValueError:
            raise ValueError(where) from None
        if eq and not name.strip():
            raise ValueError(where)
        out[key] = name.strip() or None
    return out


def check_node_name(cluster: str, node: str, where: str) -> None:
    """A config entry's cluster and node names, as the router's reports name them."""
    if not CLUSTER_NAME.match(cluster):
        raise ValueError(f"{where}: {cluster!r} is not a cluster name")
    if not node or len(node) > 128 or not node.isprintable():
        raise ValueError(f"{where}: node must be 1..128 printable characters")


# --- the router's engines ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine's event stream: which node it is and where it publishes."""

    cluster: str
    node: str
    endpoint: str
    replay: str | None = None


def parse_endpoints(spec: str | Iterable[str]) -> list[Endpoint]:
    """``router.vllm_kv_events``: ``cluster/node=tcp://host:port[|tcp://host:replay_port]``,
    comma-separated. ValueError names the entry that is wrong."""
    out: list[Endpoint] = []
    seen: set[tuple[str, str]] = set()
    for raw in entries(spec):
        if not raw:
            continue
        where = f"router.vllm_kv_events entry {raw[:120]!r}"
        name, sep, urls = raw.partition("=")
        cluster, slash, node = name.strip().partition("/")
        if not sep or not slash:
            raise ValueError(f"{where}: expected cluster/node=tcp://host:port")
        check_node_name(cluster, node, where)
        pub, bar, replay = urls.strip().partition("|")
        for url in (pub, replay) if bar else (pub,):
            if not _ENDPOINT.match(url.strip()):
                raise ValueError(f"{where}: {url.strip()!r} is not tcp://host:port or ipc://path")
        if (cluster, node) in seen:
            raise ValueError(f"{where}: {cluster}/{node} is listed twice")
        seen.add((cluster, node))
        out.append(Endpoint(cluster, node, pub.strip(), replay.strip() if bar else None))
    return out


@dataclass(frozen=True, slots=True)
class MetricsTarget:
    cluster: str
    node: str
    role: str  # "prefill" or "decode"
    url: str


def parse_targets(spec: str | Iterable[str]) -> list[MetricsTarget]:
    """``router.vllm_metrics``: ``cluster/node@role=http://host:port/metrics``, comma-separated.
    ValueError names the entry that is wrong."""
    out: list[MetricsTarget] = []
    seen: set[tuple[str, str]] = set()
    for raw in entries(spec):
        if not raw:
            continue
        where = f"router.vllm_metrics entry {raw[:120]!r}"
        name, eq, url = raw.partition("=")
        node_part, at, role = name.strip().partition("@")
        cluster, slash, node = node_part.partition("/")
        if not eq or not slash or not at:
            raise ValueError(f"{where}: expected cluster/node@role=http://host:port/metrics")
        check_node_name(cluster, node, where)
        if role not in ("prefill", "decode"):
            raise ValueError(f"{where}: role {role!r} is not prefill or decode")
        if not _METRICS_URL.match(url.strip()):
            raise ValueError(f"{where}: {url.strip()[:80]!r} is not an http(s) URL")
        if (cluster, node) in seen:
            raise ValueError(f"{where}: {cluster}/{node} is listed twice")
        seen.add((cluster, node))
        out.append(MetricsTarget(cluster, node, role, url.strip()))
    return out


# --- the gateway's nodes -------------------------------------------------------------------


def parse_nodes(spec: str | Iterable[str]) -> dict[str, str]:
    """``name=http://host:port,...`` -> {name: base URL without a trailing slash}. Several
    names may share a URL (one instance that both prefills and decodes); one name twice is
    an error, since a silent last-wins would send requests to the wrong engine."""
    out: dict[str, str] = {}
    for raw in entries(spec):
        name, sep, url = (x.strip() for x in raw.partition("="))
        where = f"gateway.nodes entry {raw[:120]!r}"
        if not sep or not _NAME.match(name):
            raise ValueError(
                f"{where}: expected name=http://host:port (name: letters, digits, ._-)"
            )
        if not _URL.match(url):
            raise ValueError(f"{where}: {url[:100]!r} is not http(s)://host:port")
        if name in out:
            raise ValueError(f"{where}: node {name!r} is listed twice")
        out[name] = url.rstrip("/")
    return out


def parse_receivers(spec: str | Iterable[str]) -> dict[str, str]:
    """``name=host:port,...`` -> {decode node name: the data address of its xdc receiver, as
    the prefill side's sender reaches it}. A remote prefill for a request the router sends to
    that node ships its KV there (the sender must allow it: ``sender.allowed_peers``)."""
    out: dict[str, str] = {}
    for raw in entries(spec):
        name, sep, addr = (x.strip() for x in raw.partition("="))
        where = f"gateway.receivers entry {raw[:120]!r}"
        if not sep or not _NAME.match(name):
            raise ValueError(f"{where}: expected name=host:port (name: letters, digits, ._-)")
        host_port(addr, where)
        if name in out:
            raise ValueError(f"{where}: node {name!r} is listed twice")
        out[name] = addr
    return out


VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""The block-hash algorithms of vLLM a router can reproduce (``scheduler/vllm_hash.py``)."""


def check_vllm_hash(algo: str, seed: str) -> None:
    """ValueError unless a router can reproduce vLLM's block hashes with ``algo`` and ``seed``:
    a known algorithm, and xxhash only with the engines' fixed seed (vLLM seeds it randomly
    per process unless PYTHONHASHSEED is set)."""
    if algo not in VLLM_HASH_ALGOS:
        raise ValueError(f"vllm_hash_algo: {algo!r} is not one of {', '.join(VLLM_HASH_ALGOS)}")
    if algo.startswith("xxhash") and not seed:
        raise ValueError(
            f"vllm_hash_algo {algo!r}: vLLM seeds it randomly per process unless "
            "PYTHONHASHSEED is set; set the engines' PYTHONHASHSEED and give the same "
            "value as router.vllm_hash_seed, or use sha256"
        )
