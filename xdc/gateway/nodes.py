"""``gateway.nodes``: which engine URL serves each router node name; ``gateway.receivers``:
which xdc receiver each decode node loads its KV from."""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_URL = re.compile(r"^https?://[^\s/?#]+(:\d{1,5})?/?$")


def parse_nodes(spec: str) -> dict[str, str]:
    """``name=http://host:port,...`` -> {name: base URL without a trailing slash}. Several
    names may share a URL (one instance that both prefills and decodes); one name twice is
    an error, since a silent last-wins would send requests to the wrong engine."""
    out: dict[str, str] = {}
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
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


def parse_receivers(spec: str) -> dict[str, str]:
    """``name=host:port,...`` -> {decode node name: the data address of its xdc receiver, as
    the prefill side's sender reaches it}. A remote prefill for a request the router sends to
    that node ships its KV there (the sender must allow it: ``sender.allowed_peers``)."""
    out: dict[str, str] = {}
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        name, sep, addr = (x.strip() for x in raw.partition("="))
        host, _, port = addr.rpartition(":")
        where = f"gateway.receivers entry {raw[:120]!r}"
        if not sep or not _NAME.match(name):
            raise ValueError(f"{where}: expected name=host:port (name: letters, digits, ._-)")
        if not host or any(c.isspace() for c in host) or not port.isdigit():
            raise ValueError(f"{where}: {addr[:100]!r} is not host:port")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"{where}: port {port} is not 1..65535")
        if name in out:
            raise ValueError(f"{where}: node {name!r} is listed twice")
        out[name] = addr
    return out
