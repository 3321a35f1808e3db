"""Global prefix-cache index: which cluster and node holds which KV block.

Blocks are named by Mooncake-style chained hashes, so "block i matches" implies "blocks 0..i
match" and a prefix lookup is a walk along the request's keys. The index is fed by cache events
that arrive over HTTP from many engines, so it must tolerate duplicates and reordering: every
event carries a per-node sequence number, and each (node, block) entry remembers the sequence
number that last touched it. Memory is bounded by an LRU over (node, block) entries plus a
smaller LRU of tombstones that stops a late "stored" from resurrecting a block evicted later.

A hybrid model's engine (linear attention or SSM beside full attention) can reuse a cached
prefix only where it also kept the running state at that block's end: vLLM keeps a state at
the last full block of each prefill, not at every block, so a prompt that shares 700 tokens
of a 1,000-token prompt cached at 256-token blocks hits nothing there (its prefix ends inside
the stretch whose state was not kept), though its first two attention blocks are cached.
Such an engine reports its states too ("state_stored" / "state_evicted", keyed like the block
they end); a node that ever did is matched only up to its last block with a state, and so is a
cluster of such nodes.

A sliding-window model's engine (Gemma-3, gpt-oss, MiMo-V2-Flash: window layers beside full
attention) frees a window layer's blocks once they fall out of the window, and its prefix
cache evicts those first, while the full-attention blocks of the same prompt stay. vLLM
resumes a prefix of ``l`` blocks only if its window layers still hold the last ``min(l, w)``
of them (``w`` = ceil((window - 1) / block_size)). Such an engine reports its window layers'
blocks ("window_stored" / "window_evicted", with ``w`` in ``window``); a node that ever did
is matched only up to an end whose trailing window it holds. A node with both kinds is cut
by both until neither moves the end (vLLM's hybrid coordinator does the same).

The router keeps this index in its own process; it is pure state, with no I/O.
"""

from __future__ import annotations

import array
import operator
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice
from typing import Any, Final, Literal, cast

import xxhash

# A cluster name: "pd" or a PrfaaS cluster's (the router checks names against its profile).
Cluster = str
EventKind = Literal[
    "stored", "evicted", "state_stored", "state_evicted", "window_stored", "window_evicted"
]

CLUSTERS: Final[tuple[str, str]] = ("prfaas", "pd")  # the single-PrfaaS deployment's names
CLUSTER_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
EVENT_KINDS: Final[tuple[EventKind, ...]] = (
    "stored",
    "evicted",
    "state_stored",
    "state_evicted",
    "window_stored",
    "window_evicted",
)
WINDOW_KINDS: Final = frozenset({"window_stored", "window_evicted"})
MAX_WINDOW_BLOCKS: Final = 1 << 20
HASH_LIMIT: Final = 1 << 64
TOKEN_LIMIT: Final = 1 << 32
MAX_NODES: Final = 4096
MAX_NODE_NAME: Final = 128

_U32 = "I" if array.array("I").itemsize == 4 else "L"


def chain_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Chained 64-bit block keys for the full blocks of ``token_ids``.

    Key i = xxh3_64(seed, key[i-1] as 8 bytes little-endian + tokens of block i as uint32
    little-endian); block 0 hashes its tokens alone. Chaining makes equal keys mean equal
    prefixes, so the index never has to compare tokens. A trailing partial block gets no key
    because engines do not cache partial blocks. Token ids must be in [0, 2**32).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    try:
        arr = array.array(_U32, token_ids[: n_full * block_size])
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if sys.byteorder != "little":
        arr.byteswap()
    data = memoryview(arr).cast("B")
    step = block_size * 4
    out: list[int] = []
    prev = b""
    for i in range(n_full):
        key = xxhash.xxh3_64_intdigest(prev + data[i * step : (i + 1) * step], seed)
        out.append(key)
        prev = key.to_bytes(8, "little")
    return out


def _bits(mask: int) -> Iterator[int]:
    """The index of every set bit of mask, lowest first."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1


def _bits_to(out: dict[int, int], mask: int, value: int) -> None:
    """out[n] = value for every set bit n of mask."""
    for n in _bits(mask):
        out[n] = value


def _mark(marks: dict[int, int], keys: list[int]) -> None:
    """Set each packed key's node bit on its block key."""
    for key in keys:
        h = key & (HASH_LIMIT - 1)
        marks[h] = marks.get(h, 0) | 1 << (key >> 64)


def _unmark(marks: dict[int, int], keys: list[int]) -> None:
    for key in keys:
        h = key & (HASH_LIMIT - 1)
        mask = marks[h] & ~(1 << (key >> 64))
        if mask:
            marks[h] = mask
        else:
            del marks[h]


def _window_end(held: list[int], length: int, mask: int, need: int) -> int:
    """The longest prefix of at most ``length`` blocks whose last ``min(l, need)`` blocks
    ``mask`` holds in ``held`` (vLLM's SlidingWindowManager.find_longest_cache_hit). A missing
    block j rules out every end in (j, j + need], so the search jumps below it: each block
    is looked at once."""
    while length:
        j = length - 1
        low = max(0, length - need)
        while j >= low and held[j] & mask:
            j -= 1
        if j < low:
            return length
        length = j
    return 0


def _first(values: list[Any], value: object) -> int:
    """Index of the first element equal to ``value``, or the length."""
    try:
        return values.index(value)
    except ValueError:
        return len(values)


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """One engine report: ``node`` of ``cluster`` stored or evicted these blocks.

    ``seq`` increases per (cluster, node) with every event that node emits; it is what lets
    the index tell a stale report from a fresh one.
    """

    kind: EventKind
    cluster: Cluster
    node: str
    seq: int
    hashes: tuple[int, ...]
    # window_* only: how many trailing blocks of a prefix the node's window layers must hold
    window: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first thing wrong with this event."""
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(EVENT_KINDS)}")
        if self.kind in WINDOW_KINDS:
            if not 1 <= self.window <= MAX_WINDOW_BLOCKS:
                raise ValueError(f"window: must be in 1..{MAX_WINDOW_BLOCKS} for {self.kind}")
        elif self.window:
            raise ValueError(f"window: only window events carry one, not {self.kind}")
        if not CLUSTER_NAME.match(self.cluster):
            raise ValueError(f"cluster: {self.cluster[:80]!r} is not a cluster name")
        if not self.node or len(self.node) > MAX_NODE_NAME:
            raise ValueError(f"node: must be 1..{MAX_NODE_NAME} characters")
        if self.seq < 0:
            raise ValueError("seq: must be >= 0")
        for h in self.hashes:
            if not 0 <= h < HASH_LIMIT:
                raise ValueError(f"hashes: {h} is outside [0, 2**64)")


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest cached prefix of one request, per cluster and per node.

    ``blocks[c]`` counts leading blocks each held by *some* node of cluster ``c`` (a cluster
    shares its cache pool over RDMA); ``node_blocks[c][n]`` is node n's own contiguous prefix,
    which the router uses for cache affinity; ``best_node[c]`` is the node with the longest one.
    """

    blocks: dict[str, int]
    node_blocks: dict[str, dict[str, int]]
    best_node: dict[str, str | None]

    @staticmethod
    def empty() -> PrefixMatch:
        """No cached prefix anywhere (read with ``.get(cluster, 0)`` / ``.get(cluster)``)."""
        return PrefixMatch(blocks={}, node_blocks={}, best_node={})


@dataclass(slots=True)
class _Node:
    cluster: str
    name: str
    blocks: int = 0
    window: int = 0  # trailing blocks its window layers must hold (0: it has none)


@dataclass(slots=True)
class IndexStats:
    entries: int
    capacity: int
    tombstones: int
    distinct_blocks: int
    capacity_evictions: int
    stale_ignored: int
    per_node: dict[str, dict[str, int]] = field(default_factory=dict)


class _Ledger:
    """The (node, key) entries of one kind (blocks, or hybrid engines' states) with the seq of
    the event that last stored each, oldest first and bounded, and tombstones of recent
    evictions: the ordering rules every kind follows. Duplicates are no-ops; a "stored" older
    than the entry's seq, or than a remembered eviction, is ignored; an "evicted" removes only
    an entry stored earlier. A packed key is ``node index << 64 | block key``; ``added`` and
    ``dropped`` keep the caller's holder maps in step with the entries: each is called once
    per event with the packed keys it added or removed (not per key: this is the router's
    cache-event intake, where a call per block cost 10-20%)."""

    __slots__ = (
        "added",
        "capacity",
        "dropped",
        "entries",
        "overflowed",
        "stale",
        "tombs",
        "tombs_max",
    )

    def __init__(
        self,
        capacity: int,
        tomb_capacity: int,
        added: Callable[[list[int]], None],
        dropped: Callable[[list[int]], None],
    ) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, int] = OrderedDict()  # packed key -> seq, oldest first
        self.tombs: OrderedDict[int, int] = OrderedDict()  # packed key -> seq of its eviction
        self.tombs_max = tomb_capacity
        self.added = added
        self.dropped = dropped
        self.stale = 0  # reports ignored as older than what the entry already says
        self.overflowed = 0  # entries forgotten to stay within capacity

    def store(self, base: int, seq: int, keys: Iterable[int]) -> bool:
        """True if any entry changed."""
        changed = False
        entries, tombs = self.entries, self.tombs
        added: list[int] = []
        for h in keys:
            key = base | h
            cur = entries.get(key)
            if cur is not None:
                if cur >= seq:
                    self.stale += cur > seq
                    continue
                entries[key] = seq
                entries.move_to_end(key)
                changed = True
                continue
            tomb = tombs.get(key)
            if tomb is not None:
                if tomb >= seq:
                    self.stale += 1
                    continue
                del tombs[key]
            added.append(key)
            entries[key] = seq
            changed = True
        if added:
            self.added(added)
        excess = len(entries) - self.capacity
        if excess > 0:
            self.dropped([entries.popitem(last=False)[0] for _ in range(excess)])
            self.overflowed += excess
        return changed

    def evict(self, base: int, seq: int, keys: Iterable[int]) -> bool:
        """True if an entry was removed (a tombstone alone changes no answer)."""
        entries, tombs = self.entries, self.tombs
        gone: list[int] = []
        for h in keys:
            key = base | h
            cur = entries.get(key)
            if cur is not None:
                if cur >= seq:
                    self.stale += 1
                    continue
                del entries[key]
                gone.append(key)
            prev = tombs.get(key)
            if prev is None or prev < seq:
                tombs[key] = seq
                tombs.move_to_end(key)
        while len(tombs) > self.tombs_max:
            tombs.popitem(last=False)
        if gone:
            self.dropped(gone)
        return bool(gone)


class PrefixIndex:
    """Bounded, reorder-tolerant map from block key to the nodes that hold it.

    Layout, chosen for a cheap ``match``: ``_holders`` maps a block key to a bitmask of the
    node indexes holding it (equal masks share one int object, so a walk over 256 blocks
    touches few cache lines), cluster coverage is a mask test, and the per-(node, block)
    sequence numbers live as the values of the LRU itself.
    """

    def __init__(
        self,
        capacity_blocks: int,
        tombstone_capacity: int | None = None,
        clusters: Iterable[str] = CLUSTERS,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        clusters = tuple(clusters)
        self.clusters = frozenset(clusters)
        self.capacity = capacity_blocks
        self.tombstone_capacity = (
            max(1024, capacity_blocks // 4) if tombstone_capacity is None else tombstone_capacity
        )
        self._holders: dict[int, int] = {}  # block key -> bitmask of node indexes
        self._masks: dict[int, int] = {}  # intern table for those bitmasks
        self._cluster_mask: dict[str, int] = dict.fromkeys(clusters, 0)  # node bits per cluster
        self._node_ids: dict[tuple[str, str], int] = {}
        self._nodes: list[_Node] = []
        self._blocks = _Ledger(
            capacity_blocks, self.tombstone_capacity, self._add_blocks, self._drop_blocks
        )
        # hybrid engines' states: block key -> bitmask of the nodes keeping a state at its end,
        # and the nodes that ever reported one (matched only up to a block with a state)
        self._states: dict[int, int] = {}
        self.state_capacity = max(1024, capacity_blocks // 4)
        self._state_entries = _Ledger(
            self.state_capacity, self.tombstone_capacity, self._add_states, self._drop_states
        )
        self._stateful = 0
        # sliding-window engines' window-layer blocks, alike (matched only up to an end whose
        # trailing window the node holds)
        self._windows: dict[int, int] = {}
        self._window_entries = _Ledger(
            self.state_capacity, self.tombstone_capacity, self._add_windows, self._drop_windows
        )
        self._windowed = 0

    @property
    def capacity_evictions(self) -> int:
        """Blocks forgotten to stay within capacity (the oldest stored first)."""
        return self._blocks.overflowed

    @property
    def stale_ignored(self) -> int:
        """Reports (blocks and states) ignored as older than what the index already holds."""
        return self._blocks.stale + self._state_entries.stale + self._window_entries.stale

    def __len__(self) -> int:
        return len(self._blocks.entries)

    def _node(self, cluster: str, name: str) -> int:
        idx = self._node_ids.get((cluster, name))
        if idx is None:
            if len(self._nodes) >= MAX_NODES:
                raise ValueError(f"node: index already tracks {MAX_NODES} nodes")
            idx = len(self._nodes)
            self._node_ids[(cluster, name)] = idx
            self._nodes.append(_Node(cluster, name))
            self._cluster_mask[cluster] = self._cluster_mask.get(cluster, 0) | 1 << idx
        return idx

    def _intern(self, mask: int) -> int:
        if len(self._masks) > 65_536:
            self._masks.clear()  # rare (many distinct holder sets): just start sharing afresh
        return self._masks.setdefault(mask, mask)

    def apply(self, event: CacheEvent) -> bool:
        """Apply one event; True if any entry changed.

        Duplicates are no-ops; a "stored" older than the entry's current seq, or older than a
        remembered eviction, is ignored; an "evicted" only removes an entry stored earlier.
        """
        event.check()
        if event.cluster not in self.clusters:
            known = ", ".join(sorted(self.clusters))
            raise ValueError(f"cluster: {event.cluster!r} is not one of {known}")
        idx = self._node(event.cluster, event.node)
        base = idx << 64
        if event.kind == "stored":
            return self._blocks.store(base, event.seq, event.hashes)
        if event.kind == "evicted":
            return self._blocks.evict(base, event.seq, event.hashes)
        if event.kind in WINDOW_KINDS:
            self._windowed |= 1 << idx
            changed = self._nodes[idx].window != event.window
            self._nodes[idx].window = event.window
            if event.kind == "window_stored":
                return self._window_entries.store(base, event.seq, event.hashes) or changed
            return self._window_entries.evict(base, event.seq, event.hashes) or changed
        self._stateful |= 1 << idx
        if event.kind == "state_stored":
            return self._state_entries.store(base, event.seq, event.hashes)
        return self._state_entries.evict(base, event.seq, event.hashes)

    def _add_blocks(self, keys: list[int]) -> None:
        holders, intern, nodes = self._holders, self._intern, self._nodes
        for key in keys:
            idx, h = key >> 64, key & (HASH_LIMIT - 1)
            holders[h] = intern(holders.get(h, 0) | 1 << idx)
            nodes[idx].blocks += 1

    def _drop_blocks(self, keys: list[int]) -> None:
        holders, intern, nodes = self._holders, self._intern, self._nodes
        for key in keys:
            idx, h = key >> 64, key & (HASH_LIMIT - 1)
            mask = holders[h] & ~(1 << idx)
            if mask:
                holders[h] = intern(mask)
            else:
                del holders[h]
            nodes[idx].blocks -= 1

    def _add_states(self, keys: list[int]) -> None:
        _mark(self._states, keys)

    def _drop_states(self, keys: list[int]) -> None:
        _unmark(self._states, keys)

    def _add_windows(self, keys: list[int]) -> None:
        _mark(self._windows, keys)

    def _drop_windows(self, keys: list[int]) -> None:
        _unmark(self._windows, keys)

    def touch(self, cluster: str, node: str, hashes: Sequence[int]) -> None:
        """Mark a node's blocks as just used, so capacity eviction forgets them last."""
        idx = self._node_ids.get((cluster, node))
        if idx is None:
            return
        base = idx << 64
        lru = self._blocks.entries
        for h in hashes:
            key = base | h
            if key not in lru:
                break
            lru.move_to_end(key)

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``hashes`` per cluster and per node; does not mutate.

        C-level passes look every key up and cut at the first miss; Python work is per run of
        identical holder sets, which ends each cluster's and each block-0 holder's prefix.
        """
        holders = self._holders
        gone: dict[int, int] = {}
        lens: dict[str, int] = dict.fromkeys(self._cluster_mask, 0)
        if hashes and hashes[0] in holders:
            masks = list(map(holders.get, hashes))
            del masks[_first(masks, None) :]
            k = len(masks)
            # Holder sets come in runs (a prefix stored by the same nodes); interned masks make
            # "same set as the previous block" an identity test, so one C-level pass finds the
            # run starts and the Python loop below runs once per run, not once per block.
            starts = compress(range(1, k), map(operator.is_not, islice(masks, 1, None), masks))
            first = cast(int, masks[0])
            alive = first
            # clusters whose prefix is still running, with their node masks
            open_ = [(c, cm) for c, cm in self._cluster_mask.items() if first & cm]
            for start in starts:
                mask = cast(int, masks[start])
                if open_ and not all(mask & cm for _, cm in open_):
                    still = []
                    for c, cm in open_:
                        if mask & cm:
                            still.append((c, cm))
                        else:
                            lens[c] = start
                    open_ = still
                dead = alive & ~mask
                if dead:
                    _bits_to(gone, dead, start)
                    alive &= mask
                if not (alive or open_):
                    break
            for c, _ in open_:
                lens[c] = k
            _bits_to(gone, alive, k)
            if self._stateful or self._windowed:
                self._to_ends(hashes, lens, gone)
        nodes = self._nodes
        node_blocks: dict[str, dict[str, int]] = {c: {} for c in lens}
        best: dict[str, str | None] = dict.fromkeys(lens)
        best_len: dict[str, int] = {}
        for n, length in gone.items():
            nd = nodes[n]
            c = nd.cluster
            node_blocks[c][nd.name] = length
            cur = best.get(c)
            top = best_len.get(c, 0)
            if length > top or (length == top and cur is not None and nd.name < cur):
                best_len[c] = length
                best[c] = nd.name
        return PrefixMatch(blocks=lens, node_blocks=node_blocks, best_node=best)

    def _to_ends(self, hashes: Sequence[int], lens: dict[str, int], gone: dict[int, int]) -> None:
        """Cut hybrid nodes' prefixes (and their clusters') back to an end their engines can
        resume from: a block with a state, a trailing window held (module docstring)."""
        top = max(max(lens.values(), default=0), max(gone.values(), default=0))
        stateful, windowed, nodes = self._stateful, self._windowed, self._nodes
        states = [m or 0 for m in map(self._states.get, islice(hashes, top))] if stateful else []
        windows = [m or 0 for m in map(self._windows.get, islice(hashes, top))] if windowed else []

        def cut(length: int, state_mask: int, window_mask: int, need: int) -> int:
            while True:
                start = length
                while state_mask and length and not states[length - 1] & state_mask:
                    length -= 1
                if window_mask:
                    length = _window_end(windows, length, window_mask, need)
                if length == start:
                    return length

        hybrid = stateful | windowed
        for n, length in list(gone.items()):
            bit = 1 << n
            if hybrid & bit:
                gone[n] = cut(length, stateful & bit, windowed & bit, nodes[n].window)
                if not gone[n]:
                    del gone[n]  # as a node holding none of the prefix
        for c, length in lens.items():
            members = self._cluster_mask[c]
            if members & hybrid:
                # a dense node of the same cluster (if any) still reuses its own prefix whole
                dense = [
                    v for n, v in gone.items() if not hybrid >> n & 1 and nodes[n].cluster == c
                ]
                need = max((nodes[n].window for n in _bits(members & windowed)), default=0)
                lens[c] = max([cut(length, members & stateful, members & windowed, need), *dense])

    def stats(self) -> IndexStats:
        per_node: dict[str, dict[str, int]] = {c: {} for c in CLUSTERS}
        for nd in self._nodes:
            per_node.setdefault(nd.cluster, {})[nd.name] = nd.blocks
        return IndexStats(
            entries=len(self._blocks.entries),
            capacity=self.capacity,
            tombstones=len(self._blocks.tombs),
            distinct_blocks=len(self._holders),
            capacity_evictions=self.capacity_evictions,
            stale_ignored=self.stale_ignored,
            per_node=per_node,
        )
