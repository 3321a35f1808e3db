"""Where the prefix-cache index's events come from, and how prompts are keyed to match them.

A prefix hit needs the router and the engine that cached the prefix to name blocks the same
way. xdc's own engines report blocks keyed by ``chain_hashes`` (``POST /v1/cache/events``);
another engine family publishes its own events with its own block hash (vLLM: its KV-event
stream and its block hashing, same seed and block size as the engine). Each such family is a
**key scheme**, and each scheme has its own ``PrefixIndex``: keys of two schemes never meet,
so one index per scheme keeps them from colliding and lets each be matched on its own.

To add an event source (e.g. an engine's event stream):

1. implement ``KeyScheme`` for the engine's block hash (``name``, ``block_size`` - which must
   equal ``router.block_size``, since matches are counted in blocks of that size - and
   ``keys(token_ids)`` giving the engine's key for every full block, chained as the engine
   chains them);
2. implement ``EventSource``: ``scheme`` plus ``async run(sink)``, which receives the engine's
   events, translates each into ``CacheEvent`` (kind, cluster, node, a per-node ``seq`` that
   increases with every event, and the block keys in the scheme) and calls
   ``sink(scheme.name, events)``; it runs until cancelled and must bound every wait;
3. register both: ``CacheIntake.add_scheme(scheme)`` and ``CacheIntake.add_source(source)``
   (``RouterService.cache``, before the app starts). The router service starts every
   registered source with the app and cancels it on shutdown, and in replicated mode the
   events it applies travel to the other replicas like those of ``/v1/cache/events``.

A request is then matched in every scheme that has a way to key it: with ``token_ids`` each
scheme hashes the tokens its own way; with ``block_hashes`` (keys the gateway computed) only
the default scheme (xdc's) can use them. Per cluster and node the longest prefix found in any
scheme wins.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from xdc.scheduler.cacheindex import CacheEvent, PrefixIndex, PrefixMatch, chain_hashes

EventSink = Callable[[str, Sequence[CacheEvent]], object]


class KeyScheme(Protocol):
    """How one engine family names KV blocks."""

    @property
    def name(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """The block key of every full block of ``token_ids``, chained from block 0."""
        ...

    def describe(self) -> dict[str, object]:
        """The scheme as ``GET /v1/schemes`` publishes it, so a gateway can compute the same
        keys (``scheme_from``) and send them instead of every token id."""
        ...


class EventSource(Protocol):
    """A feed of cache events in one key scheme; ``run`` lasts until cancelled."""

    @property
    def scheme(self) -> KeyScheme: ...

    def run(self, sink: EventSink) -> Awaitable[None]: ...


@dataclass(frozen=True, slots=True)
class XdcChainHash:
    """xdc's own scheme: xxh3-64 chained over uint32 token ids (``chain_hashes``)."""

    block_size: int
    seed: int = 0
    name: str = "xdc"

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        return chain_hashes(token_ids, self.block_size, self.seed)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "kind": "xdc", "block_size": self.block_size, "seed": self.seed}


def scheme_from(d: Any) -> KeyScheme:
    """A key scheme from its published description; ValueError for one this version cannot
    compute (the caller then sends what it can)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"a key scheme is a JSON object, not {type(d).__name__}")
    kind, name, bs = d.get("kind"), d.get("name"), d.get("block_size")
    if not isinstance(name, str) or not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"bad key scheme description {str(d)[:200]}")
    if kind == "xdc":
        seed = d.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
            raise ValueError(f"key scheme {name}: bad seed")
        return XdcChainHash(bs, seed, name)
    if kind == "vllm":
        from xdc.scheduler.vllm_hash import VllmBlockHash

        algo, seed = d.get("algo"), d.get("seed", "")
        if not isinstance(algo, str) or not isinstance(seed, str):
            raise ValueError(f"key scheme {name}: bad algo or seed")
        return VllmBlockHash(bs, algo, seed, name)
    raise ValueError(f"key scheme {name}: unknown kind {kind!r:.40}")


class CacheIntake:
    """One ``PrefixIndex`` per key scheme, the event sources that feed them, and matching.

    The first scheme is the default: ``/v1/cache/events`` and ``block_hashes`` use it.
    """

    def __init__(
        self, capacity_blocks: int, clusters: Iterable[str], schemes: Sequence[KeyScheme]
    ) -> None:
        if not schemes:
            raise ValueError("need at least one key scheme")
        names = [s.name for s in schemes]
        if len(set(names)) != len(names):
            raise ValueError(f"key scheme names must be unique, got {names}")
        sizes = {s.block_size for s in schemes}
        if len(sizes) != 1:
            raise ValueError(f"every key scheme must use one block size, got {sorted(sizes)}")
        self.clusters = tuple(clusters)
        self.schemes: dict[str, KeyScheme] = {s.name: s for s in schemes}
        self.default = schemes[0].name
        self.indexes: dict[str, PrefixIndex] = {
            s.name: PrefixIndex(capacity_blocks, clusters=self.clusters) for s in schemes
        }
        self.sources: list[EventSource] = []

    @property
    def index(self) -> PrefixIndex:
        """The default scheme's index."""
        return self.indexes[self.default]

    def add_scheme(self, scheme: KeyScheme, capacity_blocks: int | None = None) -> None:
        """Register another key scheme (with its own index) before its source starts."""
        if scheme.name in self.schemes:
            raise ValueError(f"key scheme {scheme.name!r} is already registered")
        if scheme.block_size != self.schemes[self.default].block_size:
            raise ValueError(
                f"key scheme {scheme.name!r}: block size {scheme.block_size} differs from "
                f"{self.schemes[self.default].block_size} (router.block_size)"
            )
        self.schemes[scheme.name] = scheme
        self.indexes[scheme.name] = PrefixIndex(
            capacity_blocks or self.index.capacity, clusters=self.clusters
        )

    def add_source(self, source: EventSource) -> None:
        name = source.scheme.name
        if name not in self.schemes:
            raise ValueError(f"event source uses key scheme {name!r}, not registered")
        self.sources.append(source)

    def apply(self, scheme: str, events: Iterable[CacheEvent]) -> tuple[int, int]:
        """Apply events keyed in ``scheme``; (applied, changed). ValueError names a bad one."""
        idx = self.indexes.get(scheme)
        if idx is None:
            raise ValueError(f"unknown key scheme {scheme!r}")
        applied = changed = 0
        for e in events:
            applied += 1
            changed += idx.apply(e)
        return applied, changed

    def match(
        self, *, hashes: Sequence[int] = (), token_ids: Sequence[int] | None = None
    ) -> tuple[PrefixMatch, tuple[int, ...]]:
        """The longest cached prefix over every scheme, and the default scheme's keys of the
        request (for booking touches)."""
        default_keys: tuple[int, ...] = tuple(hashes)
        if token_ids is not None:
            default_keys = tuple(self.schemes[self.default].keys(token_ids))
        best = self.index.match(default_keys) if default_keys else PrefixMatch.empty()
        if token_ids is None or len(self.indexes) == 1:
            return best, default_keys
        for name, idx in self.indexes.items():
            if name == self.default or not len(idx):
                continue
            best = merge_matches(best, idx.match(self.schemes[name].keys(token_ids)))
        return best, default_keys

    def match_keys(self, keys: Mapping[str, Sequence[int]]) -> tuple[PrefixMatch, tuple[int, ...]]:
        """``match`` for keys a gateway computed per scheme (``scheme_keys``); schemes this
        router does not have are ignored (a gateway's list may be a moment old)."""
        default_keys = tuple(keys.get(self.default, ()))
        best = self.index.match(default_keys) if default_keys else PrefixMatch.empty()
        for name, ks in keys.items():
            idx = self.indexes.get(name)
            if name == self.default or idx is None or not len(idx) or not ks:
                continue
            best = merge_matches(best, idx.match(ks))
        return best, default_keys

    def describe(self) -> list[dict[str, object]]:
        return [s.describe() for s in self.schemes.values()]

    def __len__(self) -> int:
        return sum(len(i) for i in self.indexes.values())


def merge_matches(a: PrefixMatch, b: PrefixMatch) -> PrefixMatch:
    """Per cluster and node, the longer prefix of the two."""
    blocks = dict(a.blocks)
    for c, n in b.blocks.items():
        blocks[c] = max(blocks.get(c, 0), n)
    node_blocks = {c: dict(v) for c, v in a.node_blocks.items()}
    for c, per in b.node_blocks.items():
        mine = node_blocks.setdefault(c, {})
        for node, k in per.items():
            mine[node] = max(mine.get(node, 0), k)
    best: dict[str, str | None] = {}
    for c, per in node_blocks.items():
        best[c] = min(per, key=lambda n: (-per[n], n)) if per else None
    return PrefixMatch(blocks=blocks, node_blocks=node_blocks, best_node=best)


__all__ = [
    "CacheIntake",
    "EventSink",
    "EventSource",
    "KeyScheme",
    "XdcChainHash",
    "merge_matches",
    "scheme_from",
]
