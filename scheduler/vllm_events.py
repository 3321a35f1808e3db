"""vLLM's KV-cache events as a router cache-event source.

A vLLM instance started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``
publishes, on a ZMQ PUB socket, frames ``(topic, seq as 8 bytes big-endian, payload)`` where the
payload is a msgpack ``EventBatch`` ``[ts, [event, ...], dp_rank?]`` and each event is a tagged
map (``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
[...], "block_size": n, ...}``, ``BlockRemoved``, ``AllBlocksCleared``; older versions send
the same fields as arrays, tag first). Its block hashes are vLLM's own, so they are stored in the
``vllm`` key scheme (``vllm_hash.VllmBlockHash``) where a prompt keyed the engine's way finds
them.

The pure part (``decode_batch``, ``NodeTranslator``) turns bytes into typed events and typed
events into ``CacheEvent``s; everything a hostile or buggy publisher can send ends as a
``ValueError`` counted by reason, never an exception out of the source. ``VllmKvEventSource``
is the I/O shell: a SUB socket per engine, a replay request (if the engine has a replay
endpoint) when it starts, whenever a sequence gap shows that events were missed, and after
``quiet_replay_s`` with nothing live (a lone batch lost while the SUB socket was connecting
leaves no gap to see); every wait bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from xdc.scheduler.cacheindex import MAX_WINDOW_BLOCKS, WINDOW_KINDS, CacheEvent, EventKind
from xdc.scheduler.cacheintake import EventSink
from xdc.scheduler.vllm_hash import VllmBlockHash, external_key

from xdc.config_entries import Endpoint, parse_endpoints
from xdc.logs import safe

log = logging.getLogger("xdc.router.vllm_events")

MAX_PAYLOAD = 64 * 1024 * 1024
MAX_BLOCKS_PER_EVENT = 1 << 20
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# the KV cache group kinds (vLLM's KVCacheSpecKind) whose blocks key a prompt's prefix, and
# the one that keeps a hybrid model's running state
PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})
STATE_KIND = "mamba"
WINDOW_SPEC_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAX_WINDOW_TOKENS = 1 << 24
MAX_GROUPS = 64
# window groups tracked per engine (Gemma-3-27B has 6), each holding at most a 16th of what
# the prefix group may: a hostile publisher's groups cost no more than its prefix does
MAX_WINDOW_GROUPS = 16


@dataclass(frozen=True, slots=True)
class Stored:
    keys: tuple[int, ...]
    parent: int | None
    block_size: int
    plain: bool  # no LoRA, multimodal, salt or embedding keys: a plain token prompt's blocks
    group: int | None
    spec_kind: str | None = None  # the group's kind, where vLLM names it ("full_attention"...)
    window: int | None = None  # a sliding-window group's window in tokens, where vLLM names it


@dataclass(frozen=True, slots=True)
class Removed:
    keys: tuple[int, ...]
    group: int | None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


VllmEvent = Stored | Removed | Cleared


# --- decoding (pure) ------------------------------------------------------------------------

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


def _hash(v: Any, what: str) -> int:
    if isinstance(v, bytes) and 1 <= len(v) <= 64:
        return external_key(v)
    if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 64):
        return external_key(v)
    raise ValueError(f"{what}: expected a block hash (bytes or int), got {type(v).__name__}")


def _hashes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_BLOCKS_PER_EVENT:
        raise ValueError("block_hashes: expected a list of at most 2**20 hashes")
    return tuple(_hash(h, "block_hashes") for h in v)


def _opt_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 31):
        return v
    raise ValueError(f"{what}: expected a small non-negative integer or nil")


def _window(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WINDOW_TOKENS:
        return v
    raise ValueError(f"kv_cache_spec_sliding_window: expected an integer in 1..{MAX_WINDOW_TOKENS}")


def _fields(ev: Any) -> tuple[str, dict[str, Any]]:
    """(tag, fields) of one event, from the map form (vLLM >= 0.11) or the array form."""
    if isinstance(ev, dict):
        tag = ev.get("type")
        if not isinstance(tag, str):
            raise ValueError("event: a map without a string 'type'")
        if not all(isinstance(k, str) for k in ev):
            raise ValueError("event: non-string key")
        return tag, ev
    if isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag = ev[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium")}
        return tag, dict(zip(names.get(tag, ()), ev[1:], strict=False))
    raise ValueError(f"event: expected a map or a tagged array, got {type(ev).__name__}")


def decode_event(ev: Any) -> VllmEvent | None:
    """One event, or None for a kind this router does not use."""
    tag, f = _fields(ev)
    if tag == "BlockStored":
        keys = _hashes(f.get("block_hashes"))
        parent = f.get("parent_block_hash")
        bs = f.get("block_size")
        if not isinstance(bs, int) or isinstance(bs, bool) or not 1 <= bs <= 1 << 20:
            raise ValueError("block_size: expected an integer in 1..2**20")
        kind = f.get("kv_cache_spec_kind")
        if kind is not None and (not isinstance(kind, str) or len(kind) > 64):
            raise ValueError("kv_cache_spec_kind: expected a short string or nil")
        tokens = f.get("token_ids")
        if kind == STATE_KIND:
            # a state is stored for the whole prefix it ends: its tokens, one key
            if not isinstance(tokens, list) or not tokens or len(tokens) % bs:
                raise ValueError("token_ids: expected whole blocks of tokens before a state")
        elif kind in WINDOW_SPEC_KINDS:
            # vLLM 0.32 stores a window group's blocks still in its window at the end of the
            # step, with the tokens of every block the step cached (and no parent): seen as
            # 2 keys over 576 tokens at 32-token blocks
            if not isinstance(tokens, list) or len(tokens) % bs or len(tokens) < len(keys) * bs:
                raise ValueError("token_ids: expected whole blocks of tokens, ending in its own")
        elif not isinstance(tokens, list) or len(tokens) != len(keys) * bs:
            # a store of a partial block or a token list that does not match its blocks
            raise ValueError("token_ids: expected block_size tokens per stored block")
        extra = f.get("extra_keys")
        plain = (
            f.get("lora_id") is None
            and f.get("lora_name") is None
            and (extra is None or (isinstance(extra, list) and all(e is None for e in extra)))
        )
        return Stored(
            keys,
            None if parent is None else _hash(parent, "parent_block_hash"),
            bs,
            plain,
            _opt_int(f.get("group_idx"), "group_idx"),
            kind,
            _window(f.get("kv_cache_spec_sliding_window")),
        )
    if tag == "BlockRemoved":
        return Removed(_hashes(f.get("block_hashes")), _opt_int(f.get("group_idx"), "group_idx"))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> list[VllmEvent]:
    """A publisher's payload as typed events. ValueError for anything not an event batch."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload: {len(payload)} bytes is over {MAX_PAYLOAD}")
    try:
        batch = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, max_bin_len=MAX_PAYLOAD, use_list=True
        )
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise ValueError(f"payload: not msgpack ({type(e).__name__})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("payload: expected an event batch [ts, [events...], ...]")
    ts = batch[0]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise ValueError("payload: ts is not a finite number")
    out: list[VllmEvent] = []
    for ev in batch[1]:
        decoded = decode_event(ev)
        if decoded is not None:
            out.append(decoded)
    return out


# --- translation (pure) ---------------------------------------------------------------------


class NodeTranslator:
    """One engine's events as ``CacheEvent``s of its (cluster, node).

    Keeps the keys the engine holds (bounded, oldest forgotten first) so that
    ``AllBlocksCleared`` can evict them, and numbers events with a sequence that only grows,
    across engine restarts too (from the wall clock, in microseconds), since the index orders a
    node's events by it and replicas compare them.

    Which group's blocks are the prefix: where vLLM names each group's kind (0.32 does, on
    stored blocks), the lowest full-attention (or MLA) group, whatever ``group`` says: a hybrid
    model's group 0 is often its state group. A state group's stores and removals become
    ``state_stored`` / ``state_evicted`` (``cacheindex``: a hybrid engine reuses a prefix only
    up to a block whose state it kept; counting its attention blocks alone promised hits
    vLLM did not give). Sliding-window groups' become ``window_stored`` / ``window_evicted``
    for a block every window group holds (vLLM looks a window block up in all groups of one
    window spec), with the blocks the widest window needs. Events that name no kind keep the
    old rule: ``group`` only.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        scheme: VllmBlockHash,
        group: int = 0,
        max_tracked: int = 1_000_000,
        clock_us: Any = None,
    ) -> None:
        self.cluster, self.node = endpoint.cluster, endpoint.node
        self.block_size = scheme.block_size
        self.group = group
        self.max_tracked = max_tracked
        # key -> copies the engine holds: vLLM caches a second copy of a block a request
        # computed again (its prefix hit was cut short) and reports each copy's store and
        # removal, so a key is gone when its last copy is
        self.held: OrderedDict[int, int] = OrderedDict()
        self.held_states: OrderedDict[int, int] = OrderedDict()
        self.kinds: dict[int, str] = {}  # group -> its kind, as the engine named it
        # sliding-window groups: each one's window (tokens) and blocks; the blocks all of them
        # hold, as reported to the index
        self.windows: dict[int, int] = {}
        self.window_held: dict[int, OrderedDict[int, int]] = {}
        self.held_windows: OrderedDict[int, int] = OrderedDict()
        self.dropped: Counter[str] = Counter()
        self._seq = 0
        self._clock_us = clock_us or (lambda: time.time_ns() // 1000)

    def _next_seq(self) -> int:
        self._seq = max(self._seq + 1, int(self._clock_us()))
        return self._seq

    @property
    def window_blocks(self) -> int:
        """Trailing blocks of a prefix the engine's window groups must hold to resume it
        (vLLM's ``cdiv(sliding_window - 1, block_size)``, at least one)."""
        need = (-(-(w - 1) // self.block_size) for w in self.windows.values())
        return min(max(1, *need), MAX_WINDOW_BLOCKS) if self.windows else 0

    def _event(self, kind: EventKind, keys: tuple[int, ...]) -> CacheEvent:
        window = self.window_blocks if kind in WINDOW_KINDS else 0
        return CacheEvent(kind, self.cluster, self.node, self._next_seq(), keys, window)

    def _role(self, group: int | None, kind: str | None) -> str | None:
        """ "prefix", "state", "window", or None (a group the router does not use)."""
        kind = kind or (None if group is None else self.kinds.get(group))
        if kind == STATE_KIND:
            return "state"
        if kind in WINDOW_SPEC_KINDS:
            return "window" if group in self.windows else None
        if kind is None or kind in PREFIX_KINDS:
            prefix = min(
                (g for g, k in self.kinds.items() if k in PREFIX_KINDS), default=self.group
            )
            return "prefix" if group in (None, prefix) else None
        return None

    def _learn(self, ev: Stored, out: list[CacheEvent]) -> None:
        """Note the group's kind (and window); a window group first seen holds nothing yet, so
        no block is held by every window group any more."""
        g = ev.group
        if ev.spec_kind is None or g is None:
            return
        if g not in self.kinds and len(self.kinds) >= MAX_GROUPS:
            return
        self.kinds[g] = ev.spec_kind
        if ev.spec_kind not in WINDOW_SPEC_KINDS or ev.window is None:
            return
        if g not in self.windows and len(self.windows) >= MAX_WINDOW_GROUPS:
            return  # its events are dropped as a group the router does not use
        if g not in self.windows and self.held_windows:
            out.append(self._event("window_evicted", tuple(self.held_windows)))
            self.held_windows.clear()
        self.windows[g] = ev.window
        self.window_held.setdefault(g, OrderedDict())

    def translate(self, events: Sequence[VllmEvent]) -> list[CacheEvent]:
        out: list[CacheEvent] = []
        for ev in events:
            if isinstance(ev, Cleared):
                self._clear(out)
                continue
            if isinstance(ev, Stored):
                self._learn(ev, out)
            role = self._role(ev.group, ev.spec_kind if isinstance(ev, Stored) else None)
            if role is None:
                self.dropped["other_group"] += 1  # e.g. a cross-attention group
                continue
            if isinstance(ev, Removed):
                self._removed(role, ev, out)
                continue
            if ev.block_size != self.block_size:
                self.dropped["block_size"] += 1
                continue
            if not ev.plain:
                self.dropped["extra_keys"] += 1  # LoRA/multimodal/salted: never a plain prompt's
                continue
            self._stored(role, ev, out)
        return out

    def _clear(self, out: list[CacheEvent]) -> None:
        for held in self.window_held.values():
            held.clear()
        cleared: tuple[tuple[EventKind, OrderedDict[int, int]], ...] = (
            ("evicted", self.held),
            ("state_evicted", self.held_states),
            ("window_evicted", self.held_windows),
        )
        for gone, held in cleared:
            keys = tuple(held)
            held.clear()
            if keys:
                out.append(self._event(gone, keys))

    def _removed(self, role: str, ev: Removed, out: list[CacheEvent]) -> None:
        if role == "window":
            assert ev.group is not None
            held = self.window_held[ev.group]
            _release(held, ev.keys)
            # what the index was told every window group holds, and this one no longer does
            gone = tuple(k for k in ev.keys if k in self.held_windows and k not in held)
            for k in gone:
                del self.held_windows[k]
            if gone:
                out.append(self._event("window_evicted", gone))
            return
        gone = _release(self.held if role == "prefix" else self.held_states, ev.keys)
        if gone:
            out.append(self._event("evicted" if role == "prefix" else "state_evicted", gone))

    def _stored(self, role: str, ev: Stored, out: list[CacheEvent]) -> None:
        if role == "window":
            assert ev.group is not None
            most = max(1024, self.max_tracked // MAX_WINDOW_GROUPS)
            _hold(self.window_held[ev.group], ev.keys, most)
            groups = self.window_held.values()
            new = tuple(
                k
                for k in ev.keys
                if k not in self.held_windows and all(k in held for held in groups)
            )
            _hold(self.held_windows, new, self.max_tracked)
            if new:
                out.append(self._event("window_stored", new))
            return
        _hold(self.held if role == "prefix" else self.held_states, ev.keys, self.max_tracked)
        if ev.keys:
            out.append(self._event("stored" if role == "prefix" else "state_stored", ev.keys))


def _hold(held: OrderedDict[int, int], keys: tuple[int, ...], most: int) -> None:
    """Note a copy of each key as held, newest last; the oldest keys are forgotten beyond
    ``most``."""
    for k in keys:
        held[k] = held.get(k, 0) + 1
        held.move_to_end(k)
    while len(held) > most:
        held.popitem(last=False)


def _release(held: OrderedDict[int, int], keys: tuple[int, ...]) -> tuple[int, ...]:
    """Let a copy of each key go; the keys now gone: their last copy, or a key not held
    (forgotten, or stored before this router listened: the index may still hold it)."""
    gone = []
    for k in keys:
        left = held.get(k, 0) - 1
        if left > 0:
            held[k] = left
        else:
            held.pop(k, None)
            gone.append(k)
    return tuple(gone)


# --- the I/O shell --------------------------------------------------------------------------


class VllmKvEventSource:
    """Subscribes to one vLLM instance's KV events; a ``cacheintake.EventSource``."""

    def __init__(
        self,
        endpoint: Endpoint,
        scheme: VllmBlockHash,
        *,
        group: int = 0,
        max_tracked: int = 1_000_000,
        replay_timeout_s: float = 2.0,
        quiet_replay_s: float = 5.0,
    ) -> None:
        self.endpoint = endpoint
        self.scheme = scheme
        self.translator = NodeTranslator(endpoint, scheme, group, max_tracked)
        self.replay_timeout_s = replay_timeout_s
        self.quiet_replay_s = quiet_replay_s
        self.last_seq: int | None = None  # the last batch applied, live or replayed
        self.live_last: int | None = None  # the last batch the SUB socket delivered
        # digests of the batches applied lately, by sequence number: the same number with
        # the same bytes is a duplicate, with other bytes a new engine process
        self._applied: OrderedDict[int, bytes] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.connected = asyncio.Event()

    def _label(self) -> str:
        return f"{self.endpoint.cluster}/{safe(self.endpoint.node)}"

    def _frames(
        self, frames: Sequence[bytes], sink: EventSink, *, live: bool = False
    ) -> int | None:
        """Apply one (topic, seq, payload) message unless it was applied already. ``live``:
        it came from the SUB socket (not a replay), and a message that shows earlier ones
        were missed is not applied: the first missing sequence number is returned so that
        the caller can replay from there.

        A sequence number at or below the last applied one is a replay overlap (the live
        queue held it while a replay returned it too), or a restarted engine numbering from 0
        again. Same number and same bytes as the batch applied under it: a duplicate; other
        bytes (a batch carries its time): a restart. A number no longer remembered is a
        restart when it came live at or below the last live one (a PUB socket never repeats
        nor reorders) or is a 0."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["malformed"] += 1
            return None
        seq = int.from_bytes(frames[1], "big", signed=True)
        digest = hashlib.blake2b(frames[2], digest_size=16).digest()
        last = self.last_seq
        if last is not None and seq <= last:
            known = self._applied.get(seq)
            if known is not None:
                restarted = known != digest
            else:
                repeated = live and self.live_last is not None and seq <= self.live_last
                restarted = seq == 0 or repeated
            if not restarted:
                self.counts["duplicate"] += 1
                return None
            # numbering began again: the engine restarted with an empty cache
            self.counts["restarts"] += 1
            log.info("vLLM events from %s: the engine restarted", self._label())
            self._sink(self.translator.translate([Cleared()]), sink)
            last = self.last_seq = None
            self._applied.clear()
        if last is None and seq > 0 and live and self.endpoint.replay is not None:
            # the first batch seen live (of this engine process), and earlier ones exist that
            # no replay returned: they went out while the SUB socket was still connecting
            return 0
        if last is not None and seq > last + 1:
            if live and self.endpoint.replay is not None:
                return last + 1
            self.counts["gaps"] += 1
            self.counts["missed"] += seq - last - 1
        self.last_seq = seq
        self._applied[seq] = digest
        while len(self._applied) > 256:
            self._applied.popitem(last=False)
        try:
            events = decode_batch(frames[2])
        except ValueError as e:
            self.counts["malformed"] += 1
            log.warning("vLLM events from %s: dropped a batch: %s", self._label(), e)
            return None
        self.counts["batches"] += 1
        self._sink(self.translator.translate(events), sink)
        return None

    def _sink(self, events: list[CacheEvent], sink: EventSink) -> None:
        if events:
            sink(self.scheme.name, events)
            self.counts["events"] += len(events)

    async def _replay(self, ctx: Any, start: int, sink: EventSink) -> None:
        """Ask the engine's replay endpoint for everything from ``start`` (bounded in time)."""
        import zmq

        if self.endpoint.replay is None:
            return
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not await sock.poll(int(left * 1000) + 1):
                    break
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) >= 2 and frames[1] == END_SEQ:
                    self.counts["replays"] += 1
                    return
                self._frames(frames, sink)
            self.counts["replay_timeouts"] += 1
        finally:
            sock.close(0)

    def _replayed_only(self) -> None:
        """A quiet spell's replay brought batches, and none ever came live. Once is a lone
        batch lost while the SUB socket connected; twice, the engine is not publishing to
        it: vLLM binds its endpoint only when it is a wildcard (``tcp://*:port``) or
        ``ipc://`` and connects to any other, and this router connects too, so its cache
        is known only every ``quiet_replay_s``."""
        self.counts["replayed_only"] += 1
        if self.counts["replayed_only"] == 2:
            log.warning(
                "vLLM events from %s arrive only by replay, none live: give the engine's "
                "kv-events endpoint as tcp://*:PORT (or ipc://); with tcp://HOST:PORT vLLM "
                "connects instead of binding, and the router connects to %s too",
                self._label(),
                safe(self.endpoint.endpoint),
            )

    async def run(self, sink: EventSink) -> None:
        try:
            import zmq
            import zmq.asyncio
        except ImportError:
            log.error("router.vllm_kv_events needs pyzmq (pip install 'xdc[vllm-events]')")
            raise
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD + 1024)
        try:
            sub.connect(self.endpoint.endpoint)
            log.info("vLLM KV events: %s from %s", self._label(), self.endpoint.endpoint)
            await self._replay(ctx, 0, sink)  # what the engine cached before we listened
            self.connected.set()
            heard = time.monotonic()
            while True:
                if not await sub.poll(1000):
                    if time.monotonic() - heard >= self.quiet_replay_s:
                        # nothing live for a while: ask for anything newer than what we
                        # hold (an empty answer when nothing was missed)
                        last = self.last_seq
                        await self._replay(ctx, 0 if last is None else last + 1, sink)
                        heard = time.monotonic()
                        if self.live_last is None and self.last_seq != last:
                            self._replayed_only()
                    continue
                heard = time.monotonic()
                frames = await sub.recv_multipart()
                gap = self._frames(frames, sink, live=True)
                if gap is not None:
                    # events were missed: replay from the first missing one (live messages
                    # wait in the SUB queue meanwhile), then this one unless replay had it
                    await self._replay(ctx, gap, sink)
                    self._frames(frames, sink)
                if len(frames) == 3 and len(frames[1]) == 8:
                    self.live_last = int.from_bytes(frames[1], "big", signed=True)
        finally:
            sub.close(0)
            ctx.term()


def add_vllm_sources(intake: Any, cfg: Any) -> list[VllmKvEventSource]:
    """Register the ``vllm`` key scheme and one source per ``router.vllm_kv_events`` entry
    with a ``CacheIntake`` (none when the field is empty)."""
    endpoints = parse_endpoints(cfg.vllm_kv_events)
    if not endpoints:
        return []
    scheme = VllmBlockHash(cfg.block_size, cfg.vllm_hash_algo, cfg.vllm_hash_seed)
    intake.add_scheme(scheme)
    sources = [
        VllmKvEventSource(e, scheme, group=cfg.vllm_kv_group, max_tracked=cfg.cache_capacity_blocks)
        for e in endpoints
    ]
    for s in sources:
        intake.add_source(s)
    return sources
