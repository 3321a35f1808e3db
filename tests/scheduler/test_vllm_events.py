"""vLLM's KV events feed the router's prefix index: parsing the stream (hostile bytes included),
keying prompts the way vLLM hashes blocks, and a real ZMQ publisher (with replay) reaching a
real router app. The same against a real vLLM engine lives in test_vllm_events_engine.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.cacheindex import CacheEvent
from xdc.scheduler.vllm_events import (
    MAX_WINDOW_GROUPS,
    Cleared,
    NodeTranslator,
    Removed,
    Stored,
    VllmKvEventSource,
    decode_batch,
)
from xdc.scheduler.vllm_hash import VllmBlockHash, external_key

from tests.router_rig import RouterRig, ZmqPublisher
from xdc.config import ConfigError, load_config
from xdc.config_entries import Endpoint, parse_endpoints

BLOCK = 16


def stored(
    tokens: list[int], scheme: VllmBlockHash, start: int = 0, **extra: Any
) -> dict[str, Any]:
    """A BlockStored event as vLLM 0.32 encodes it (a tagged map, bytes hashes)."""
    digests = scheme.digests(tokens)
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": digests[start:],
        "parent_block_hash": digests[start - 1] if start else None,
        "token_ids": tokens[start * BLOCK : len(digests) * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    ev.update(extra)
    return ev


def batch(*events: Any) -> bytes:
    return bytes(msgpack.packb([time.time(), list(events)], use_bin_type=True))


# --- configuration --------------------------------------------------------------------------


def test_endpoints_parse_with_optional_replay_socket() -> None:
    eps = parse_endpoints("pd/pd-0=tcp://10.0.0.2:5557, prfaas/p-1=tcp://h:5557|tcp://h:5558")
    assert eps == [
        Endpoint("pd", "pd-0", "tcp://10.0.0.2:5557"),
        Endpoint("prfaas", "p-1", "tcp://h:5557", "tcp://h:5558"),
    ]
    assert parse_endpoints("") == []


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("pd-0=tcp://h:1", "cluster/node="),
        ("pd/pd-0", "cluster/node="),
        ("p d/x=tcp://h:1", "not a cluster name"),
        ("pd/x=http://h:1", "not tcp://host:port"),
        ("pd/x=tcp://h:1|nope", "not tcp://host:port"),
        ("pd/x=tcp://h:1,pd/x=tcp://h:2", "listed twice"),
        ("pd/\x00=tcp://h:1", "printable"),
    ],
)
def test_bad_endpoint_specs_name_the_entry(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_endpoints(spec)


def test_router_config_refuses_bad_vllm_settings_with_field_names() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            overrides={
                "router.vllm_kv_events": "pd=tcp://h:1",
                "router.vllm_hash_algo": "md5",
                "router.vllm_kv_group": "-1",
            },
        )
    text = str(e.value)
    assert "router.vllm_kv_events" in text
    assert "vllm_hash_algo" in text and "md5" in text
    assert "router.vllm_kv_group" in text


def test_xxhash_schemes_need_the_engines_seed() -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        VllmBlockHash(BLOCK, "xxhash")
    assert VllmBlockHash(BLOCK, "xxhash", "42").keys(list(range(BLOCK)))


# --- decoding and translation (pure) --------------------------------------------------------


def test_a_batch_decodes_in_map_and_array_forms() -> None:
    s = VllmBlockHash(BLOCK)
    tokens = list(range(3 * BLOCK))
    keys = tuple(s.keys(tokens))
    legacy = [
        "BlockStored",
        s.digests(tokens)[1:],
        s.digests(tokens)[0],
        tokens[BLOCK:],
        BLOCK,
        None,
        "GPU",
    ]
    events = decode_batch(
        batch(
            stored(tokens, s),
            legacy,
            {"type": "BlockRemoved", "block_hashes": [keys[2]], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew", "x": 1},
        )
    )
    assert events == [
        Stored(keys, None, BLOCK, True, None),
        Stored(keys[1:], keys[0], BLOCK, True, None),
        Removed((keys[2],), None),
        Cleared(),
    ]


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"a": 1}), "event batch"),
        (msgpack.packb([float("nan"), []]), "finite"),
        (msgpack.packb([1.0, [{"type": 3}]]), "string 'type'"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]), "block_hashes"),
        (
            msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]),
            "block hash",
        ),
        (
            msgpack.packb(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "block_size": 4,
                            "token_ids": [1],
                        }
                    ],
                ]
            ),
            "token_ids",
        ),
        (
            msgpack.packb(
                [1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": True}]]
            ),
            "block_size",
        ),
        (
            msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65]}]]),
            "block hash",
        ),
        (
            msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [], "group_idx": -1}]]),
            "group_idx",
        ),
        (msgpack.packb([1.0, [7]]), "map or a tagged array"),
    ],
)
def test_malformed_payloads_are_value_errors_that_say_why(payload: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        decode_batch(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise_anything_but_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode_batch(data)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(st.text(max_size=12) | st.integers(0, 9), c, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "group_idx",
                    "extra_keys",
                ]
            ),
            _json | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
            max_size=7,
        ),
        max_size=4,
    )
)
def test_arbitrary_event_fields_never_raise_anything_but_value_error(events: list[Any]) -> None:
    t = NodeTranslator(Endpoint("pd", "n", "tcp://h:1"), VllmBlockHash(BLOCK))
    try:
        out = t.translate(decode_batch(batch(*events)))
    except ValueError:
        return
    for ev in out:
        ev.check()


def _translator(group: int = 0) -> tuple[NodeTranslator, list[int]]:
    clock = iter(range(100, 10_000))
    t = NodeTranslator(
        Endpoint("pd", "pd-1", "tcp://h:1"),
        VllmBlockHash(BLOCK),
        group=group,
        clock_us=lambda: next(clock),
    )
    return t, VllmBlockHash(BLOCK).keys(list(range(4 * BLOCK)))


def test_stores_removes_and_clear_become_node_events_with_growing_seq() -> None:
    t, k = _translator()
    out = t.translate(
        [
            Stored(tuple(k), None, BLOCK, True, 0),
            Removed((k[3],), 0),
            Cleared(),
        ]
    )
    assert [(e.kind, e.hashes) for e in out] == [
        ("stored", tuple(k)),
        ("evicted", (k[3],)),
        ("evicted", tuple(k[:3])),  # a clear evicts what the node still held
    ]
    assert all(e.cluster == "pd" and e.node == "pd-1" for e in out)
    assert [e.seq for e in out] == sorted({e.seq for e in out})


def test_a_hybrid_engines_state_group_becomes_state_events_and_its_attention_the_prefix() -> None:
    """As vLLM 0.32 publishes a Qwen3-Next-shaped model's cache (seen on the CPU build): group 0
    is the state ("mamba", stored only where a state was kept), group 1 full attention. Before,
    the router read group 0 (its default) as the prefix: hybrid prompts never matched."""
    t, k = _translator()
    out = t.translate(
        [
            Stored((k[2],), k[1], BLOCK, True, 0, "mamba"),
            Stored(tuple(k[:3]), None, BLOCK, True, 1, "full_attention"),
            Removed((k[2],), 0),  # removals name no kind: the group's learned one
            Removed((k[0],), 1),
            Stored(tuple(k), None, BLOCK, True, 2, "cross_attention"),
            Cleared(),
        ]
    )
    assert [(e.kind, e.hashes) for e in out] == [
        ("state_stored", (k[2],)),
        ("stored", tuple(k[:3])),
        ("state_evicted", (k[2],)),
        ("evicted", (k[0],)),
        ("evicted", tuple(k[1:3])),  # a clear evicts the blocks and states still held
    ]
    assert t.dropped == {"other_group": 1}


def test_window_groups_become_window_events_for_blocks_every_window_group_holds() -> None:
    """As vLLM 0.32 publishes a Gemma-3-shaped model's cache: window groups (kind
    "sliding_window", window 64 tokens: 4 blocks of 16 at most before a prefix's end) beside
    one full-attention group. vLLM looks a window block up in every group of the window spec,
    so a block counts once all of them hold it and stops when one lets it go. Before, window
    groups were dropped and the router promised their prefixes whole."""
    t, k = _translator()
    out = t.translate(
        [
            Stored(tuple(k), None, BLOCK, True, 0, "sliding_window", 64),
            Stored(tuple(k[:3]), None, BLOCK, True, 1, "full_attention"),
            Stored(tuple(k[1:]), None, BLOCK, True, 2, "sliding_window", 64),
            Removed((k[3],), 0),  # one window group let go: the block counts no more
            Removed((k[3],), 2),  # the other as well: nothing new to say
            Removed((k[0],), 2),  # never held by both: nothing to say
            Cleared(),
        ]
    )
    assert (
        [(e.kind, e.hashes, e.window) for e in out]
        == [
            ("window_stored", tuple(k), 4),  # group 0 alone is every window group known so far
            ("stored", tuple(k[:3]), 0),
            ("window_evicted", tuple(k), 4),  # group 2 appeared: it holds nothing yet
            ("window_stored", tuple(k[1:]), 4),
            ("window_evicted", (k[3],), 4),
            ("evicted", tuple(k[:3]), 0),
            ("window_evicted", tuple(k[1:3]), 4),
        ]
    )
    for e in out:
        e.check()
    assert t.window_blocks == 4 and not t.dropped


def test_a_block_is_evicted_when_its_last_copy_is() -> None:
    """vLLM caches a second copy of blocks a request computed again (its prefix hit was cut
    short by a window or a state) and reports the store and removal of each copy. Seen on
    the sliding test model: a prompt's 9 shared blocks stored twice, one copy evicted, the
    other still hit. Before, the first removal took the key from the router."""
    t, k = _translator()
    out = t.translate(
        [
            Stored(tuple(k[:2]), None, BLOCK, True, 0),
            Stored(tuple(k[:2]), None, BLOCK, True, 0),  # the second copies
            Stored((k[0],), None, BLOCK, True, 1, "sliding_window", 64),
            Stored((k[0],), None, BLOCK, True, 1, "sliding_window", 64),
            Removed(tuple(k[:2]), 0),  # one copy of each goes: both still held
            Removed((k[0],), 1),
            Removed((k[0],), 0),  # the last copy of k[0]
            Removed((k[0],), 1),
            Removed((k[3],), 0),  # never reported held: evicted (the index may hold it)
        ]
    )
    assert [(e.kind, e.hashes) for e in out] == [
        ("stored", tuple(k[:2])),
        ("stored", tuple(k[:2])),
        ("window_stored", (k[0],)),
        ("evicted", (k[0],)),
        ("window_evicted", (k[0],)),
        ("evicted", (k[3],)),
    ]
    assert dict(t.held) == {k[1]: 1}


def test_a_window_group_naming_no_window_is_dropped_and_a_bad_window_refused() -> None:
    t, k = _translator()
    assert t.translate([Stored(tuple(k), None, BLOCK, True, 1, "sliding_window")]) == []
    assert t.dropped == {"other_group": 1}
    scheme = VllmBlockHash(BLOCK)
    for bad in (0, -1, True, 1 << 30, "64"):
        ev = stored(list(range(BLOCK)), scheme, kv_cache_spec_sliding_window=bad)
        with pytest.raises(ValueError, match="kv_cache_spec_sliding_window"):
            decode_batch(batch(ev))
    ev = stored(list(range(BLOCK)), scheme, kv_cache_spec_kind="sliding_window")
    ev["kv_cache_spec_sliding_window"] = 64
    (got,) = decode_batch(batch(ev))
    assert isinstance(got, Stored) and got.window == 64


def test_window_groups_are_bounded() -> None:
    """A hostile publisher naming many window groups, each storing many blocks, costs the
    router no more than its prefix group may hold."""
    t, _ = _translator()
    t.max_tracked = 16 * 2048
    events = [
        Stored(tuple(range(1, 5000)), None, BLOCK, True, g, "sliding_window", 64)
        for g in range(1, MAX_WINDOW_GROUPS + 5)
    ]
    t.translate(events)
    assert sorted(t.windows) == list(range(1, MAX_WINDOW_GROUPS + 1))
    assert t.dropped == {"other_group": 4}
    assert all(len(held) == 2048 for held in t.window_held.values())
    assert len(t.held_windows) <= t.max_tracked
    # the widest window a publisher may name still makes events the index takes
    t, _ = _translator()
    (out,) = t.translate([Stored((7,), None, BLOCK, True, 1, "sliding_window", 1 << 24)])
    out.check()
    assert out.window == 1 << 20


def test_a_state_store_carries_the_tokens_of_the_whole_prefix_it_ends() -> None:
    """vLLM 0.32 stores a hybrid model's state under the key of the block it ends, with the
    tokens of every block before it; the old decoder dropped such batches as malformed."""
    scheme = VllmBlockHash(BLOCK)
    tokens = list(range(3 * BLOCK))
    state = stored(tokens, scheme, start=2, group_idx=0, kv_cache_spec_kind="mamba")
    state["token_ids"] = tokens  # the whole prefix, one key
    (ev,) = decode_batch(batch(state))
    assert isinstance(ev, Stored) and ev.spec_kind == "mamba" and len(ev.keys) == 1
    state["token_ids"] = tokens[:-1]
    with pytest.raises(ValueError, match="whole blocks"):
        decode_batch(batch(state))


def test_events_without_kinds_keep_the_configured_group() -> None:
    t, _ = _translator(group=1)
    out = t.translate([Stored((1, 2), None, BLOCK, True, 0), Stored((3,), None, BLOCK, True, 1)])
    assert [(e.kind, e.hashes) for e in out] == [("stored", (3,))]


def test_blocks_a_plain_prompt_can_never_match_are_dropped_and_counted() -> None:
    t, k = _translator()
    out = t.translate(
        [
            Stored(tuple(k), None, 2 * BLOCK, True, None),  # another block size
            Stored(tuple(k), None, BLOCK, False, None),  # LoRA / multimodal / salted
            Stored(tuple(k), None, BLOCK, True, 1),  # another KV cache group
            Removed(tuple(k), 1),
        ]
    )
    assert out == []
    assert t.dropped == {"block_size": 1, "extra_keys": 1, "other_group": 2}


def test_tracked_blocks_are_bounded() -> None:
    clock = iter(range(1, 10_000))
    t = NodeTranslator(
        Endpoint("pd", "x", "tcp://h:1"),
        VllmBlockHash(BLOCK),
        max_tracked=2,
        clock_us=lambda: next(clock),
    )
    t.translate([Stored((1, 2, 3), None, BLOCK, True, None)])
    assert list(t.held) == [2, 3]
    out = t.translate([Cleared()])
    assert out == [CacheEvent("evicted", "pd", "x", out[0].seq, (2, 3))]


def test_int_block_hashes_are_the_same_keys_as_bytes() -> None:
    d = VllmBlockHash(BLOCK).digests(list(range(BLOCK)))[0]
    assert external_key(d) == external_key(int.from_bytes(d, "big") & (2**64 - 1))


def test_a_live_batch_a_replay_returned_already_is_a_duplicate_and_other_bytes_a_restart() -> None:
    """At router start a live 0 can follow the replay that returned it: the same number and
    the same bytes are a duplicate (CI counted it as a restart). The same number with other
    bytes, live or replayed, is a new engine process."""
    s = VllmBlockHash(BLOCK)
    tokens = list(range(3000, 3000 + 8 * BLOCK))
    src = VllmKvEventSource(Endpoint("pd", "n", "tcp://h:1", "tcp://h:2"), s)
    got: list[CacheEvent] = []

    def sink(_scheme: str, events: Sequence[CacheEvent]) -> None:
        got.extend(events)

    def frames(seq: int, payload: bytes) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big"), payload]

    b0, b1 = batch(stored(tokens[: 4 * BLOCK], s)), batch(stored(tokens, s, start=4))
    src._frames(frames(0, b0), sink)  # the replay at start
    src._frames(frames(1, b1), sink)
    assert src._frames(frames(0, b0), sink, live=True) is None  # the live queue's copy
    assert src._frames(frames(1, b1), sink, live=True) is None
    assert src.counts["duplicate"] == 2 and src.counts["restarts"] == 0
    assert [e.kind for e in got] == ["stored", "stored"]
    other = batch(stored(list(range(9000, 9000 + 2 * BLOCK)), s))
    assert src._frames(frames(1, other), sink, live=True) == 0  # replay the new engine from 0
    assert src.counts["restarts"] == 1 and got[-1].kind == "evicted"


# --- a real ZMQ publisher and a real router app ---------------------------------------------


@pytest.fixture
def rig() -> Iterator[RouterRig]:
    with RouterRig(block_size=BLOCK) as r:
        yield r


def test_a_published_prefix_routes_requests_to_its_node(rig: RouterRig) -> None:
    s = VllmBlockHash(BLOCK)
    tokens = list(range(7000, 7000 + 40 * BLOCK))
    with ZmqPublisher() as pub:
        rig.start(f"pd/pd-2=tcp://127.0.0.1:{pub.port}")
        pub.publish_until_seen(batch(stored(tokens[: 30 * BLOCK], s)), rig, "pd/pd-2")
        d = rig.route(tokens)
        assert d["target"] == "pd" and d["prefill_node"] == "pd-2", d
        assert d["cached_tokens"] == 30 * BLOCK
        # the engine evicts the tail of that prefix: the router follows
        keys = s.digests(tokens)
        pub.publish(batch({"type": "BlockRemoved", "block_hashes": keys[10:30], "medium": "GPU"}))
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 10 * BLOCK)
        # and garbage on the stream is counted, not fatal
        pub.publish(b"\xc1garbage")
        rig.wait_for(lambda: rig.source_counts("pd/pd-2").get("malformed") == 1)
        assert rig.route(tokens)["cached_tokens"] == 10 * BLOCK
        assert (
            'xdc_router_vllm_events_total{node="pd/pd-2",outcome="malformed"} 1.0' in rig.metrics()
        )


def test_a_router_started_late_learns_the_cache_from_the_replay_socket(rig: RouterRig) -> None:
    s = VllmBlockHash(BLOCK)
    tokens = list(range(100, 100 + 20 * BLOCK))
    with ZmqPublisher(replay=True) as pub:
        pub.publish(batch(stored(tokens[: 12 * BLOCK], s)))  # before any router listens
        rig.start(f"pd/pd-1=tcp://127.0.0.1:{pub.port}|tcp://127.0.0.1:{pub.replay_port}")
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 12 * BLOCK)
        # the replay's events land before its end marker is counted: wait for the count
        rig.wait_for(lambda: rig.source_counts("pd/pd-1").get("replays", 0) >= 1)


def test_a_sequence_gap_is_filled_from_the_replay_socket(rig: RouterRig) -> None:
    s = VllmBlockHash(BLOCK)
    tokens = list(range(900, 900 + 20 * BLOCK))
    with ZmqPublisher(replay=True) as pub:
        rig.start(f"pd/pd-1=tcp://127.0.0.1:{pub.port}|tcp://127.0.0.1:{pub.replay_port}")
        pub.publish_until_seen(batch(stored(tokens[: 4 * BLOCK], s)), rig, "pd/pd-1")
        pub.publish(batch(stored(tokens[: 8 * BLOCK], s, start=4)), live=False)  # lost on the way
        pub.publish(batch(stored(tokens[: 12 * BLOCK], s, start=8)))
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 12 * BLOCK)
        rig.wait_for(lambda: rig.source_counts("pd/pd-1").get("replays", 0) >= 2)
        counts = rig.source_counts("pd/pd-1")
        assert counts.get("missed", 0) == 0, counts


def test_batches_published_while_the_router_was_connecting_are_replayed(rig: RouterRig) -> None:
    """ZMQ's slow joiner: a batch published after the router's replay at start but before its
    SUB socket is connected never reaches it live. The next live batch shows it was missed
    (its sequence number is not the first), and the router replays from the beginning."""
    s = VllmBlockHash(BLOCK)
    tokens = list(range(1200, 1200 + 20 * BLOCK))
    with ZmqPublisher(replay=True) as pub:
        rig.start(f"pd/pd-1=tcp://127.0.0.1:{pub.port}|tcp://127.0.0.1:{pub.replay_port}")
        rig.wait_for(lambda: rig.source_counts("pd/pd-1").get("replays", 0) >= 1)
        pub.publish(batch(stored(tokens[: 4 * BLOCK], s)), live=False)  # before it listened
        pub.publish_until_seen(batch(stored(tokens[: 8 * BLOCK], s, start=4)), rig, "pd/pd-1")
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 8 * BLOCK)
        assert rig.source_counts("pd/pd-1").get("replays", 0) >= 2


def test_a_lone_batch_lost_while_the_router_was_connecting_is_replayed_when_all_is_quiet(
    rig: RouterRig, caplog: pytest.LogCaptureFixture
) -> None:
    """The slow joiner again, but no batch follows the lost one to show a gap (CI: the router
    saw no event from a real engine in 20 s). After a quiet spell the router asks the replay
    socket for anything newer than what it holds. When that happens twice and nothing ever
    came live, the engine is not publishing to the router (a vLLM given tcp://HOST:PORT
    connects instead of binding): the router says so."""
    s = VllmBlockHash(BLOCK)
    tokens = list(range(1500, 1500 + 20 * BLOCK))
    with ZmqPublisher(replay=True) as pub:
        rig.start(f"pd/pd-1=tcp://127.0.0.1:{pub.port}|tcp://127.0.0.1:{pub.replay_port}")
        rig.wait_for(lambda: rig.source_counts("pd/pd-1").get("replays", 0) >= 1)
        pub.publish(batch(stored(tokens[: 4 * BLOCK], s)), live=False)
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 4 * BLOCK, timeout=15)
        assert rig.source_counts("pd/pd-1")["replayed_only"] == 1
        assert "arrive only by replay" not in caplog.text  # once is a lost batch
        pub.publish(batch(stored(tokens[: 6 * BLOCK], s, start=4)), live=False)
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 6 * BLOCK, timeout=15)
        assert rig.source_counts("pd/pd-1")["replayed_only"] == 2
        assert "arrive only by replay, none live" in caplog.text


def test_a_restarted_engine_is_seen_even_when_its_first_batch_was_lost(rig: RouterRig) -> None:
    """A new engine process numbers from 0; its 0 lost, its 1 is at or below what the old one
    reached. A PUB socket never repeats a number, so that is a restart, not a duplicate: the
    old blocks are forgotten and the new ones replayed."""
    s = VllmBlockHash(BLOCK)
    old = list(range(2000, 2000 + 10 * BLOCK))
    new = list(range(5000, 5000 + 10 * BLOCK))
    with ZmqPublisher(replay=True) as pub:
        rig.start(f"pd/pd-1=tcp://127.0.0.1:{pub.port}|tcp://127.0.0.1:{pub.replay_port}")
        pub.publish_until_seen(batch(stored(old[: 5 * BLOCK], s)), rig, "pd/pd-1")
        pub.publish(batch(stored(old, s, start=5)))
        rig.wait_for(lambda: rig.route(old)["cached_tokens"] == 10 * BLOCK)
        pub.restart()
        pub.publish(batch(stored(new[: 2 * BLOCK], s)), live=False)  # 0, lost on the way
        pub.publish(batch(stored(new[: 3 * BLOCK], s, start=2)))  # 1
        rig.wait_for(lambda: rig.route(new)["cached_tokens"] == 3 * BLOCK)
        assert rig.route(old)["cached_tokens"] == 0
        assert rig.source_counts("pd/pd-1")["restarts"] == 1


def test_an_engine_restart_forgets_what_it_held(rig: RouterRig) -> None:
    s = VllmBlockHash(BLOCK)
    tokens = list(range(300, 300 + 10 * BLOCK))
    with ZmqPublisher() as pub:
        rig.start(f"pd/pd-3=tcp://127.0.0.1:{pub.port}")
        pub.publish_until_seen(batch(stored(tokens, s)), rig, "pd/pd-3")
        pub.publish(batch(stored(tokens[: 5 * BLOCK], s)))
        rig.wait_for(lambda: rig.source_counts("pd/pd-3").get("batches", 0) >= 2)
        pub.seq = 0  # a new engine process numbers its batches from 0 again
        pub.publish(batch(stored(tokens[: 2 * BLOCK], s)))
        rig.wait_for(lambda: rig.route(tokens)["cached_tokens"] == 2 * BLOCK)
        assert rig.source_counts("pd/pd-3")["restarts"] == 1
