"""Prefix-cache index: chained hashes, event ordering, eviction bound, prefix matching."""

from __future__ import annotations

import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.cacheindex import CacheEvent, PrefixIndex, chain_hashes


def ev(kind: str, cluster: str, node: str, seq: int, hashes: list[int]) -> CacheEvent:
    return CacheEvent(kind, cluster, node, seq, tuple(hashes))  # type: ignore[arg-type]


# --- chain_hashes -----------------------------------------------------------------------------


def test_chain_hashes_format_is_xxh3_over_previous_key_and_uint32_tokens() -> None:
    tokens = list(range(10))
    keys = chain_hashes(tokens, 4, seed=7)
    assert len(keys) == 2  # 10 tokens, block 4: two full blocks, the partial one has no key
    b0 = b"".join(t.to_bytes(4, "little") for t in tokens[:4])
    b1 = b"".join(t.to_bytes(4, "little") for t in tokens[4:8])
    k0 = xxhash.xxh3_64_intdigest(b0, 7)
    k1 = xxhash.xxh3_64_intdigest(k0.to_bytes(8, "little") + b1, 7)
    assert keys == [k0, k1]


def test_chain_hashes_equal_keys_mean_equal_prefixes() -> None:
    rnd = random.Random(3)
    a = [rnd.randrange(1 << 32) for _ in range(64)]
    b = list(a)
    b[20] ^= 1  # differ inside block 2 (block size 8)
    ka, kb = chain_hashes(a, 8), chain_hashes(b, 8)
    assert ka[:2] == kb[:2]
    # chaining: every later key differs although blocks 3..7 hold identical tokens
    assert all(x != y for x, y in zip(ka[2:], kb[2:], strict=True))
    assert chain_hashes(a, 8, seed=1) != ka
    assert chain_hashes(a[:7], 8) == []


@pytest.mark.parametrize("bad", [[-1], [1 << 32]])
def test_chain_hashes_rejects_out_of_range_tokens(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        chain_hashes(bad * 4, 4)


def test_chain_hashes_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        chain_hashes([1, 2, 3], 0)


# --- events -----------------------------------------------------------------------------------


def test_match_reports_cluster_union_and_best_node() -> None:
    idx = PrefixIndex(1000)
    idx.apply(ev("stored", "pd", "p0", 1, [10, 11]))
    idx.apply(ev("stored", "pd", "p1", 1, [10, 11, 12, 13]))
    idx.apply(ev("stored", "pd", "p2", 1, [14]))  # not a prefix by itself
    idx.apply(ev("stored", "prfaas", "f0", 1, [10, 11, 12, 13, 14, 15]))
    m = idx.match([10, 11, 12, 13, 14, 15, 16])
    assert m.blocks == {"prfaas": 6, "pd": 5}  # pd: 10..13 on p1, 14 on p2
    assert m.node_blocks["pd"] == {"p0": 2, "p1": 4}
    assert m.best_node == {"prfaas": "f0", "pd": "p1"}
    assert idx.match([99, 10]).blocks == {"prfaas": 0, "pd": 0}
    assert idx.match([]).best_node == {"prfaas": None, "pd": None}


def test_same_node_name_in_two_clusters_is_two_nodes() -> None:
    idx = PrefixIndex(100)
    idx.apply(ev("stored", "pd", "n", 1, [1, 2]))
    idx.apply(ev("stored", "prfaas", "n", 1, [1]))
    assert idx.match([1, 2]).blocks == {"prfaas": 1, "pd": 2}
    assert len(idx) == 3


def test_duplicate_events_are_idempotent() -> None:
    idx = PrefixIndex(100)
    e = ev("stored", "pd", "p0", 5, [1, 2, 3])
    assert idx.apply(e) is True
    assert idx.apply(e) is False
    assert len(idx) == 3
    x = ev("evicted", "pd", "p0", 6, [3])
    assert idx.apply(x) is True
    assert idx.apply(x) is False
    assert idx.match([1, 2, 3]).blocks["pd"] == 2


def test_stale_evict_cannot_delete_newer_store() -> None:
    idx = PrefixIndex(100)
    idx.apply(ev("stored", "pd", "p0", 9, [1, 2]))
    assert idx.apply(ev("evicted", "pd", "p0", 4, [1, 2])) is False  # delayed, older
    assert idx.match([1, 2]).blocks["pd"] == 2


def test_late_store_cannot_resurrect_a_newer_evict() -> None:
    idx = PrefixIndex(100)
    # evict(seq 5) overtakes the store(seq 3) it undoes
    idx.apply(ev("evicted", "pd", "p0", 5, [1]))
    assert idx.apply(ev("stored", "pd", "p0", 3, [1])) is False
    assert idx.match([1]).blocks["pd"] == 0
    # a genuinely newer store brings it back
    assert idx.apply(ev("stored", "pd", "p0", 7, [1])) is True
    assert idx.match([1]).blocks["pd"] == 1


def test_sequence_numbers_are_per_node() -> None:
    idx = PrefixIndex(100)
    idx.apply(ev("stored", "pd", "p0", 100, [1]))
    # p1's counter is independent; its low seq is not stale
    assert idx.apply(ev("stored", "pd", "p1", 1, [1])) is True
    assert idx.apply(ev("evicted", "pd", "p1", 2, [1])) is True
    assert idx.match([1]).node_blocks["pd"] == {"p0": 1}


def test_capacity_bound_evicts_least_recently_stored() -> None:
    idx = PrefixIndex(100)
    for i in range(250):
        idx.apply(ev("stored", "pd", f"p{i % 3}", i + 1, [i]))
        assert len(idx) <= 100
    assert len(idx) == 100
    assert idx.stats().capacity_evictions == 150
    assert idx.match([249]).blocks["pd"] == 1
    assert idx.match([149]).blocks["pd"] == 0  # the 151st-newest entry is gone
    assert idx.match([150]).blocks["pd"] == 1
    per_node = idx.stats().per_node["pd"]
    assert sum(per_node.values()) == 100


def test_touch_keeps_used_blocks_over_capacity_pressure() -> None:
    idx = PrefixIndex(10)
    idx.apply(ev("stored", "pd", "p0", 1, list(range(10))))
    idx.touch("pd", "p0", [0, 1])
    idx.apply(ev("stored", "pd", "p0", 2, [100, 101]))
    assert idx.match([0, 1]).blocks["pd"] == 2
    assert idx.match([2]).blocks["pd"] == 0 and idx.match([3]).blocks["pd"] == 0


def test_tombstones_are_bounded() -> None:
    idx = PrefixIndex(10, tombstone_capacity=16)
    idx.apply(ev("evicted", "pd", "p0", 1, list(range(1000))))
    assert idx.stats().tombstones == 16


def test_invalid_events_are_rejected() -> None:
    idx = PrefixIndex(10)
    for bad in (
        ev("stored", "pd", "p0", 1, [1 << 64]),
        ev("stored", "pd", "p0", 1, [-1]),
        ev("stored", "pd", "", 1, [1]),
        ev("stored", "cloud", "p0", 1, [1]),
        ev("flushed", "pd", "p0", 1, [1]),
        ev("stored", "pd", "p0", -1, [1]),
    ):
        with pytest.raises(ValueError):
            idx.apply(bad)
    assert len(idx) == 0


# --- any delivery order gives the in-order result -------------------------------------------

_event = st.tuples(
    st.sampled_from(["stored", "evicted"]),
    st.sampled_from([("pd", "a"), ("pd", "b"), ("prfaas", "a")]),
    st.lists(st.integers(0, 7), min_size=1, max_size=4),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_event, min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_any_order_with_duplicates_converges_to_in_order_state(
    raw: list[tuple[str, tuple[str, str], list[int]]], rnd: random.Random
) -> None:
    seqs: dict[tuple[str, str], int] = {}
    events: list[CacheEvent] = []
    for kind, (cluster, node), hashes in raw:
        seqs[(cluster, node)] = seqs.get((cluster, node), 0) + 1
        events.append(ev(kind, cluster, node, seqs[(cluster, node)], hashes))
    in_order = PrefixIndex(10_000)
    for e in events:
        in_order.apply(e)
    shuffled = events + rnd.sample(events, k=len(events) // 2)  # with duplicates
    rnd.shuffle(shuffled)
    other = PrefixIndex(10_000)
    for e in shuffled:
        other.apply(e)
    assert len(other) == len(in_order)
    for h in range(8):
        assert other.match([h]) == in_order.match([h])


def _reference_match(
    held: dict[tuple[str, str], set[int]], hashes: list[int]
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Brute force: walk every node and every cluster separately."""
    blocks: dict[str, int] = {}
    for c in ("prfaas", "pd"):
        k = 0
        while k < len(hashes) and any(hashes[k] in s for (cc, _), s in held.items() if cc == c):
            k += 1
        blocks[c] = k
    nodes: dict[str, dict[str, int]] = {"prfaas": {}, "pd": {}}
    for (c, n), have in held.items():
        k = 0
        while k < len(hashes) and hashes[k] in have:
            k += 1
        if k:
            nodes[c][n] = k
    return blocks, nodes


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.tuples(st.sampled_from(["prfaas", "pd"]), st.sampled_from(["a", "b", "c"])),
        st.sets(st.integers(0, 9), max_size=10),
        max_size=6,
    ),
    st.lists(st.integers(0, 9), max_size=12),
)
def test_match_agrees_with_brute_force(
    held: dict[tuple[str, str], set[int]], hashes: list[int]
) -> None:
    idx = PrefixIndex(1000)
    for (c, n), have in held.items():
        idx.apply(ev("stored", c, n, 1, sorted(have)))
    m = idx.match(hashes)
    want_blocks, nodes = _reference_match(held, hashes)
    assert m.blocks == want_blocks
    assert m.node_blocks == nodes
    for c in ("prfaas", "pd"):
        if nodes[c]:
            top = max(nodes[c].values())
            assert m.best_node[c] == min(n for n, k in nodes[c].items() if k == top)
        else:
            assert m.best_node[c] is None


# --- hybrid engines: a prefix is reused only up to a block whose state was kept ---------------


def _hybrid(idx: PrefixIndex, node: str, keys: list[int], states: list[int], seq: int = 1) -> None:
    idx.apply(ev("stored", "pd", node, seq, keys))
    idx.apply(ev("state_stored", "pd", node, seq + 1, states))


def test_a_hybrid_node_matches_only_up_to_its_last_block_with_a_state() -> None:
    """As vLLM answered for the hybrid test model at 256-token blocks: a 1,000-token prompt
    cached (attention blocks 0-2, its state at the end of block 2) hits 768 tokens again, and
    a prompt sharing its first 700 tokens hits nothing (no state at the end of block 0 or 1),
    though two of its attention blocks are cached."""
    a = [11, 12, 13]
    b = [11, 12, 99]
    idx = PrefixIndex(100)
    _hybrid(idx, "pd-1", a, [13])
    assert idx.match(a).node_blocks["pd"] == {"pd-1": 3}
    assert idx.match(a).blocks["pd"] == 3
    m = idx.match(b)
    assert m.node_blocks["pd"] == {} and m.blocks["pd"] == 0 and m.best_node["pd"] is None
    # a state kept at the end of block 1 as well (a chunk boundary) makes 2 blocks reusable
    idx.apply(ev("state_stored", "pd", "pd-1", 5, [12]))
    assert idx.match(b).node_blocks["pd"] == {"pd-1": 2}


def test_a_state_evicted_takes_its_prefix_back_and_a_late_state_store_does_not_return() -> None:
    idx = PrefixIndex(100)
    _hybrid(idx, "pd-1", [1, 2, 3], [2, 3])
    assert idx.apply(ev("state_evicted", "pd", "pd-1", 10, [3]))
    assert idx.match([1, 2, 3]).node_blocks["pd"] == {"pd-1": 2}
    assert not idx.apply(ev("state_stored", "pd", "pd-1", 9, [3]))  # older than the eviction
    assert idx.match([1, 2, 3]).node_blocks["pd"] == {"pd-1": 2}
    # an eviction of a state the node never reported changes nothing (it leaves a tombstone)
    assert not idx.apply(ev("state_evicted", "pd", "pd-1", 12, [1]))
    assert not idx.apply(ev("state_stored", "pd", "pd-1", 11, [1]))
    assert idx.stats().stale_ignored == 2
    # an attention block gone cuts as before: 1 block left, and no state at its end
    idx.apply(ev("evicted", "pd", "pd-1", 11, [2]))
    assert idx.match([1, 2, 3]).node_blocks["pd"] == {}


def test_dense_nodes_keep_whole_prefixes_beside_hybrid_ones() -> None:
    idx = PrefixIndex(100)
    _hybrid(idx, "pd-1", [1, 2, 3], [1])
    idx.apply(ev("stored", "pd", "pd-2", 1, [1, 2]))  # a dense engine: never reports states
    idx.apply(ev("stored", "prfaas", "p-1", 1, [1, 2, 3]))
    m = idx.match([1, 2, 3])
    assert m.node_blocks["pd"] == {"pd-1": 1, "pd-2": 2}
    assert m.blocks["pd"] == 2 and m.best_node["pd"] == "pd-2"
    assert m.blocks["prfaas"] == 3 and m.node_blocks["prfaas"] == {"p-1": 3}


def test_states_are_bounded() -> None:
    idx = PrefixIndex(10)
    assert idx.state_capacity == 1024
    idx.apply(ev("state_stored", "pd", "pd-1", 1, list(range(1, 2000))))
    assert len(idx._state_entries.entries) == 1024 and len(idx._states) == 1024
    # the oldest states were forgotten: evicting one is no change, a kept one is
    assert not idx.apply(ev("state_evicted", "pd", "pd-1", 2, [1]))
    assert idx.apply(ev("state_evicted", "pd", "pd-1", 3, [1999]))
    assert len(idx._state_entries.entries) == 1023 and 1999 not in idx._states


# --- sliding-window engines: a prefix is reused only where its trailing window is held --------


def _windowed(idx: PrefixIndex, node: str, keys: list[int], window: list[int], need: int) -> None:
    idx.apply(ev("stored", "pd", node, 1, keys))
    idx.apply(CacheEvent("window_stored", "pd", node, 2, tuple(window), need))


def test_a_windowed_node_matches_only_up_to_an_end_whose_trailing_window_it_holds() -> None:
    """A 10-block prompt cached; its window layers' blocks before the last window were freed
    and evicted (vLLM frees them as the prompt moves past them), so the whole prompt hits 10
    blocks again but a prompt sharing its first 6 hits nothing."""
    a = list(range(1, 11))
    b = [*a[:6], 99]
    idx = PrefixIndex(100)
    _windowed(idx, "pd-1", a, a[7:], need=3)
    assert idx.match(a).node_blocks["pd"] == {"pd-1": 10}
    m = idx.match(b)
    assert m.node_blocks["pd"] == {} and m.blocks["pd"] == 0 and m.best_node["pd"] is None
    # blocks 0 and 1 of the window layers held as well: a prefix shorter than the window
    # needs only what it has (vLLM's leading run), so b resumes after 2 blocks
    idx.apply(CacheEvent("window_stored", "pd", "pd-1", 3, (1, 2), 3))
    assert idx.match(b).node_blocks["pd"] == {"pd-1": 2}
    # and a window ending at block 5 held makes 6 reusable
    idx.apply(CacheEvent("window_stored", "pd", "pd-1", 4, (4, 5, 6), 3))
    assert idx.match(b).node_blocks["pd"] == {"pd-1": 6}
    assert idx.match(b).blocks["pd"] == 6
    # a window block evicted takes its ends back; a late store older than the eviction does
    # not return it
    # (block 4 gone: no window of 3 ends at 6, 5 or 4 blocks; blocks 0-1 remain)
    assert idx.apply(CacheEvent("window_evicted", "pd", "pd-1", 9, (5,), 3))
    assert idx.match(b).node_blocks["pd"] == {"pd-1": 2}
    assert not idx.apply(CacheEvent("window_stored", "pd", "pd-1", 8, (5,), 3))
    assert idx.match(b).node_blocks["pd"] == {"pd-1": 2}


def test_a_node_with_states_and_windows_ends_where_both_allow() -> None:
    """Cut by one kind, then the other, until neither moves the end (vLLM's coordinator)."""
    keys = list(range(1, 9))
    idx = PrefixIndex(100)
    _windowed(idx, "pd-1", keys, [1, 2, 3, 5, 6, 7], need=2)
    idx.apply(ev("state_stored", "pd", "pd-1", 5, [4, 8]))  # states at the ends of 4 and 8
    # 8 blocks: no window at 7-8 (8 missing) -> 7; no state at 7 -> 4; window 3-4 missing
    # block 4 -> 3; no state at 3 -> 0
    assert idx.match(keys).node_blocks["pd"] == {}
    idx.apply(CacheEvent("window_stored", "pd", "pd-1", 6, (4,), 2))
    assert idx.match(keys).node_blocks["pd"] == {"pd-1": 4}
    idx.apply(CacheEvent("window_stored", "pd", "pd-1", 7, (8,), 2))
    assert idx.match(keys).node_blocks["pd"] == {"pd-1": 8}


def _vllm_window_hit(held: set[int], length: int, need: int) -> int:
    """vLLM 0.32's SlidingWindowManager.find_longest_cache_hit over block positions: from
    the right, the first run of ``need`` held blocks ends the hit; else the run from 0."""
    run = 0
    for i in range(length - 1, -1, -1):
        if i in held:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 15)), st.integers(0, 16), st.integers(1, 6))
def test_the_window_cut_agrees_with_vllms_own_search(
    held: set[int], length: int, need: int
) -> None:
    keys = list(range(100, 116))
    idx = PrefixIndex(100)
    _windowed(idx, "pd-1", keys[:length], [keys[i] for i in held], need)
    got = idx.match(keys[:length]).node_blocks["pd"].get("pd-1", 0)
    assert got == _vllm_window_hit(held, length, need)


def test_window_events_carry_a_window_and_others_do_not() -> None:
    with pytest.raises(ValueError, match="window: must be in"):
        CacheEvent("window_stored", "pd", "n", 1, (1,)).check()
    with pytest.raises(ValueError, match="only window events"):
        CacheEvent("stored", "pd", "n", 1, (1,), 4).check()
    CacheEvent("window_evicted", "pd", "n", 1, (1,), 4).check()
