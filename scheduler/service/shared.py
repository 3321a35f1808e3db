"""Router replicas that share state through Redis.

What is shared is the router's **inputs**, not its state: link reports, node reports, cache
events and the bookings of accepted decisions. Every replica applies every input, its own at
once and the others' as they arrive, through the same ``RouterService.apply_*`` methods with
the timestamp the receiving replica gave it, so every replica holds the same link table, node
queues and prefix index, and the pure policy gives the same decision for the same request.
Link and node inputs are order-independent (a reporter's newer report wins; a node report is a
set), cache events carry per-node sequence numbers, so replicas converge whatever order they
see them in.

Redis layout (``{ns}`` = ``router.redis_namespace``):

* ``{ns}:links`` / ``{ns}:nodes``: hashes holding the latest link report per (link, reporter)
  and the latest report per node: a replica that starts, or comes back, reads them first;
* ``{ns}:reports``, ``{ns}:cache``, ``{ns}:book``: streams every replica tails with one
  blocking ``XREAD``: reports (and the leader's thresholds), cache-event batches (kept to
  ``router.redis_cache_log`` entries: a new replica rebuilds its index from them) and bookings
  (kept for the node-load window);
* ``{ns}:leader``: a lease (``SET NX PX``) naming the replica that runs the threshold
  controller and the long-term planner; ``{ns}:threshold`` is what it concluded (t, the
  recommendation, and the profile-drift factors it plans with). Followers route and price
  requests with it. A dead leader's lease runs out and another replica takes over.

Writes leave through an outbox flushed by one task in pipelined batches (a few ms apart), so
a decision never waits for Redis. Report endpoints wait for their input to be written (bounded
by ``router.redis_timeout_s``), so a replica killed right after answering loses nothing the
others need. When Redis is unreachable the replica keeps routing on what it has, leads itself
(runs its own controller), says so on ``/healthz`` and in ``xdc_router_replication_up``, keeps
its local inputs in the outbox (bounded; the oldest bookings go first) and, once Redis is back,
writes them, re-reads the hashes and resumes the streams where it left off.

Everything the replicas exchange is JSON (orjson) and validated the same way as the HTTP input
it came from was, since a replica trusts Redis no more than the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
from xdc.scheduler.cacheindex import CacheEvent
from xdc.scheduler.drift import factors_from_json
from xdc.scheduler.outages import Failure, failure_of
from xdc.scheduler.service.router import Booking, NodeReport, RouterService
from xdc.scheduler.service.router_metrics import RouterMetrics

from xdc.config import RouterConfig
from xdc.errors import RemoteConnectionError
from xdc.linkreport import LinkReport

try:
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError, ResponseError
except ImportError:  # pragma: no cover - exercised only without the extra installed
    aioredis = None  # type: ignore[assignment]
    RedisError = OSError  # type: ignore[assignment,misc]
    ResponseError = OSError  # type: ignore[assignment,misc]

log = logging.getLogger("xdc.router.shared")

BLOCK_MS = 250  # one XREAD waits at most this long, so shutdown and reconnects stay prompt
FLUSH_EVERY_S = 0.002
MAX_OUTBOX = 200_000
BOOKING_WINDOW_S = 60.0
RETRY_MAX_S = 2.0
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class SharedStateError(RemoteConnectionError, RuntimeError):
    """The shared-state backend cannot be used (e.g. the redis package is missing)."""


def require_redis() -> None:
    """SharedStateError unless the redis client is installed (checked before serving)."""
    if aioredis is None:
        raise SharedStateError(
            "router.shared_state = redis needs the redis client: pip install 'xdc[redis]'"
        )


def replica_name(cfg: RouterConfig, node_id: str) -> str:
    """This replica's id in Redis: configured, else host, node id and pid."""
    if cfg.replica_id:
        return cfg.replica_id
    return f"{socket.gethostname()}:{node_id}:{os.getpid()}"


@dataclass
class _Outbox:
    """Writes not yet in Redis, oldest first. Each is (kind, args) for ``_write``."""

    ops: deque[tuple[int, str, tuple[Any, ...]]] = field(default_factory=deque)  # (n, kind, args)
    dropped: int = 0
    waiters: list[tuple[int, asyncio.Future[bool]]] = field(default_factory=list)
    written: int = 0  # number of the last op written (waiters wait for a number)
    queued: int = 0  # number of the last op queued


class RedisSync:
    """Replication of a RouterService's inputs through Redis; see the module docstring.

    ``start()`` connects, reads the snapshot and starts the three owned tasks (writer, reader,
    leader lease); ``close()`` cancels them and closes the connections. Both are called by the
    app's cleanup context.
    """

    def __init__(
        self,
        svc: RouterService,
        cfg: RouterConfig,
        metrics: RouterMetrics,
        replica: str,
    ) -> None:
        require_redis()
        self.svc = svc
        self.cfg = cfg
        self.metrics = metrics
        self.replica = replica
        ns = cfg.redis_namespace
        self.k_links = f"{ns}:links"
        self.k_nodes = f"{ns}:nodes"
        self.k_reports = f"{ns}:reports"
        self.k_cache = f"{ns}:cache"
        self.k_book = f"{ns}:book"
        self.k_leader = f"{ns}:leader"
        self.k_threshold = f"{ns}:threshold"
        timeout = cfg.redis_timeout_s
        self.r = aioredis.Redis.from_url(
            cfg.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        # the blocking reader has a connection of its own, with room for its BLOCK
        self.rd = aioredis.Redis.from_url(
            cfg.redis_url,
            socket_timeout=timeout + BLOCK_MS / 1000.0,
            socket_connect_timeout=timeout,
        )
        self.out = _Outbox()
        self._kick = asyncio.Event()
        self.up = False
        self._ever_up = False
        self.down_since: float | None = time.time()
        self.is_leader = False
        self.last_error = ""
        self.cache_gaps = 0
        self._ids = {self.k_reports: "0-0", self.k_cache: "0-0", self.k_book: "0-0"}
        self._synced = asyncio.Event()  # set after a snapshot has been read
        self._tasks: list[asyncio.Task[None]] = []
        self._published_t: tuple[float, float, tuple[tuple[str, float], ...]] | None = None
        self.remote_recommendation: dict[str, Any] | None = None
        svc.sync = self
        metrics.replication_up.set(0)

    # -- Sync: called by RouterService after it applied a local input

    def link_report(self, report: LinkReport, received_at: float) -> None:
        payload = orjson.dumps({"r": report.to_json(), "at": received_at})
        field_ = f"{report.from_cluster}->{report.to_cluster}|{report.reporter}"
        self._queue("link", (field_, payload))

    def node_reports(self, reports: Sequence[NodeReport], received_at: float) -> None:
        for rep in reports:
            payload = orjson.dumps({"n": rep.to_json(), "at": received_at})
            self._queue("node", (f"{rep.cluster}|{rep.name}", payload))

    def cache_events(self, scheme: str, events: Sequence[CacheEvent]) -> None:
        body = [cache_row(e) for e in events]
        self._queue("cache", (scheme, orjson.dumps(body)))

    def booking(self, booking: Booking) -> None:
        b = booking
        row = [b.at, b.target, b.prefill_node, b.decode_node, b.prefill_s]
        self._queue("book", (orjson.dumps([*row, b.uncached_tokens, b.rejected]),))

    def failure(self, failure: Failure, received_at: float) -> None:
        f = failure
        row = [f.cluster, f.decode_node, f.reason, f.stage, received_at]
        self._queue("failure", (orjson.dumps(row),))

    def _queue(self, kind: str, args: tuple[Any, ...]) -> None:
        out = self.out
        if len(out.ops) >= MAX_OUTBOX:
            # Redis has been gone a long time: bookings are the least valuable (soft load
            # estimates that node reports overwrite), so they go first
            for i, (_, k, _) in enumerate(out.ops):
                if k == "book":
                    del out.ops[i]
                    break
            else:
                out.ops.popleft()
            out.dropped += 1
        out.queued += 1
        out.ops.append((out.queued, kind, args))
        self.metrics.replication_lag.set(len(out.ops))
        self._kick.set()

    async def written(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is in Redis; False on timeout (or down)."""
        target = self.out.queued
        if self.out.written >= target:
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.out.waiters.append((target, fut))
        self._kick.set()
        try:
            return await asyncio.wait_for(
                asyncio.shield(fut), timeout if timeout is not None else self.cfg.redis_timeout_s
            )
        except TimeoutError:
            return False

    # -- lifecycle

    async def start(self) -> None:
        """Start the owned tasks; the first snapshot is read by the reader (bounded wait)."""
        self._tasks = [
            asyncio.create_task(self._writer(), name="redis-writer"),
            asyncio.create_task(self._reader(), name="redis-reader"),
            asyncio.create_task(self._leader(), name="redis-leader"),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), self.cfg.redis_timeout_s * 3)
        if not self.up:
            log.warning(
                "shared state at %s not reachable at start (%s): routing on local state",
                self.cfg.redis_url,
                self.last_error or "timeout",
            )

    async def close(self) -> None:
        # give queued writes a last, bounded chance
        if self.up and self.out.ops:
            await self.written(self.cfg.redis_timeout_s)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.is_leader:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await asyncio.wait_for(self._release_lease(), self.cfg.redis_timeout_s)
        for client in (self.r, self.rd):
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await asyncio.wait_for(client.aclose(), self.cfg.redis_timeout_s)

    def status(self) -> dict[str, Any]:
        return {
            "backend": "redis",
            "replica": self.replica,
            "up": self.up,
            "degraded": not self.up,
            "down_since": self.down_since,
            "leader": self.is_leader,
            "controls_threshold": self.svc.leads,
            "outbox": len(self.out.ops),
            "outbox_dropped": self.out.dropped,
            "cache_gaps": self.cache_gaps,
            "last_error": self.last_error or None,
        }

    # -- health bookkeeping

    def _ok(self) -> None:
        if not self.up:
            if self._ever_up:
                log.warning("shared state at %s reachable again", self.cfg.redis_url)
            else:
                log.info("shared state at %s connected as %s", self.cfg.redis_url, self.replica)
            self._ever_up = True
            self.up = True
            self.down_since = None
            self.metrics.replication_up.set(1)
        self._set_leads()

    def _failed(self, e: BaseException) -> None:
        self.metrics.replication_errors.inc()
        self.last_error = f"{type(e).__name__}: {e}"[:300]
        if self.up:
            log.warning(
                "shared state at %s unreachable (%s): routing on the last state",
                self.cfg.redis_url,
                self.last_error,
            )
            self.up = False
            self.down_since = time.time()
            self.metrics.replication_up.set(0)
            self._synced.clear()
        self._set_leads()

    def _set_leads(self) -> None:
        # cut off from the others, a replica runs its own controller rather than freeze t
        self.svc.leads = self.is_leader or not self.up
        self.metrics.replication_leader.set(1 if self.svc.leads else 0)

    async def _retry_pause(self, attempt: int) -> None:
        await asyncio.sleep(min(RETRY_MAX_S, 0.05 * 2 ** min(attempt, 6)))

    # -- writer

    async def _writer(self) -> None:
        attempt = 0
        while True:
            if not self.out.ops:
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), 1.0)
                continue
            await asyncio.sleep(FLUSH_EVERY_S)  # let a burst collect into one pipeline
            batch = list(self.out.ops)
            try:
                await asyncio.wait_for(self._write(batch), self.cfg.redis_timeout_s)
            except ResponseError:
                # Redis refused the batch (e.g. a key of another type under our namespace):
                # retrying cannot help, and keeping it would wedge every later write
                log.exception("dropping %d shared-state writes Redis refused", len(batch))
                self.metrics.replication_errors.inc()
                self.out.dropped += len(batch)
            except (RedisError, OSError, TimeoutError) as e:
                self._failed(e)
                attempt += 1
                await self._retry_pause(attempt)
                continue
            except Exception:
                log.exception("dropping %d shared-state writes that failed", len(batch))
                self.metrics.replication_errors.inc()
                self.out.dropped += len(batch)
            attempt = 0
            last = batch[-1][0]
            while self.out.ops and self.out.ops[0][0] <= last:
                self.out.ops.popleft()
            self.out.written = last
            self.metrics.replication_lag.set(len(self.out.ops))
            self._ok()
            done = self.out.written
            keep: list[tuple[int, asyncio.Future[bool]]] = []
            for target, fut in self.out.waiters:
                if target <= done:
                    if not fut.done():
                        fut.set_result(True)
                else:
                    keep.append((target, fut))
            self.out.waiters = keep

    async def _write(self, batch: list[tuple[int, str, tuple[Any, ...]]]) -> None:
        me = self.replica
        pipe = self.r.pipeline(transaction=False)
        books: list[bytes] = []
        for _, kind, args in batch:
            if kind == "link":
                f, payload = args
                pipe.hset(self.k_links, f, payload)
                pipe.xadd(self.k_reports, {"r": me, "k": "link", "d": payload}, maxlen=10_000)
            elif kind == "node":
                f, payload = args
                pipe.hset(self.k_nodes, f, payload)
                pipe.xadd(self.k_reports, {"r": me, "k": "node", "d": payload}, maxlen=10_000)
            elif kind == "cache":
                scheme, payload = args
                pipe.xadd(
                    self.k_cache,
                    {"r": me, "s": scheme, "d": payload},
                    maxlen=self.cfg.redis_cache_log,
                    approximate=True,
                )
            elif kind == "book":
                books.append(args[0])
            elif kind == "failure":
                (payload,) = args
                pipe.xadd(self.k_reports, {"r": me, "k": "failure", "d": payload}, maxlen=10_000)
            elif kind == "threshold":
                (payload,) = args
                pipe.set(self.k_threshold, payload)
                pipe.xadd(
                    self.k_reports,
                    {"r": me, "k": "t", "d": payload},
                    maxlen=10_000,
                    approximate=True,
                )
        if books:
            pipe.xadd(self.k_book, {"r": me, "d": b"[" + b",".join(books) + b"]"})
            cutoff_ms = int((time.time() - BOOKING_WINDOW_S) * 1000)
            pipe.xtrim(self.k_book, minid=f"{cutoff_ms}-0", approximate=True)
        await pipe.execute()

    # -- reader

    async def _snapshot(self) -> None:
        """Read the hashes and the retained logs; resume the streams where we left off."""
        r = self.r
        # redis-py types its replies loosely (bytes | str | ...); these are bytes
        last_reports: Any = await r.xrevrange(self.k_reports, count=1)
        links: dict[bytes, bytes] = cast(Any, await r.hgetall(self.k_links))
        nodes: dict[bytes, bytes] = cast(Any, await r.hgetall(self.k_nodes))
        threshold: bytes | None = cast(Any, await r.get(self.k_threshold))
        for raw in links.values():
            self._guarded("links", self._apply_link, raw)
        for raw in nodes.values():
            self._guarded("nodes", self._apply_node, raw)
        if threshold is not None:
            self._guarded("threshold", self._apply_threshold, threshold)
        if self._ids[self.k_reports] == "0-0" and last_reports:
            self._ids[self.k_reports] = _sid(last_reports[0][0])
        if self._ids[self.k_book] == "0-0":
            self._ids[self.k_book] = f"{int((time.time() - BOOKING_WINDOW_S) * 1000)}-0"
        # a cache log trimmed past where we were: events were missed (index is soft state)
        first: Any = await r.xrange(self.k_cache, count=1)
        mine = self._ids[self.k_cache]
        if first and mine != "0-0" and _older(mine, _sid(first[0][0])):
            self.cache_gaps += 1
            log.warning("cache event log was trimmed past this replica's position: gap")

    async def _reader(self) -> None:
        attempt = 0
        while True:
            try:
                if not self._synced.is_set():
                    await asyncio.wait_for(self._snapshot(), self.cfg.redis_timeout_s * 5)
                    self._synced.set()
                    self._ok()
                streams: Any = dict(self._ids)
                got: Any = await self.rd.xread(streams, count=2000, block=BLOCK_MS)
            except (RedisError, OSError, TimeoutError) as e:
                self._failed(e)
                attempt += 1
                await self._retry_pause(attempt)
                continue
            attempt = 0
            self._ok()
            for key, entries in got or ():
                k = key.decode() if isinstance(key, bytes) else str(key)
                for eid, fields in entries:
                    self._ids[k] = _sid(eid)
                    try:
                        self._apply_entry(k, fields)
                    except Exception:  # a bug must not stop replication for good
                        log.exception("applying shared-state entry %s on %s failed", eid, k)
                        self.metrics.replication_errors.inc()

    def _guarded(self, where: str, apply: Callable[[bytes], None], raw: bytes) -> None:
        """Apply one shared input; a bad one is logged and skipped, never fatal."""
        try:
            apply(raw)
        except (ValueError, TypeError, KeyError, orjson.JSONDecodeError) as e:
            log.warning("skipping malformed shared-state entry in %s: %s", where, e)
            self.metrics.replication_errors.inc()

    def _apply_entry(self, stream: str, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"r", b"").decode(errors="replace") == self.replica:
            return  # our own input: applied when it arrived
        data = fields.get(b"d", b"")
        try:
            if stream == self.k_book:
                for row in orjson.loads(data):
                    self._apply_booking(row)
            elif stream == self.k_cache:
                scheme = fields.get(b"s", b"").decode()
                events = [cache_event(row) for row in orjson.loads(data)]
                self.svc.apply_events(events, scheme, local=False)
                self.metrics.replication_applied.labels("cache").inc()
            else:
                kind = fields.get(b"k", b"").decode()
                if kind == "link":
                    self._apply_link(data)
                elif kind == "node":
                    self._apply_node(data)
                elif kind == "t":
                    self._apply_threshold(data)
                elif kind == "failure":
                    self._apply_failure(data)
        except (ValueError, TypeError, KeyError, orjson.JSONDecodeError) as e:
            # another replica's bad input (or a foreign writer): skip it, never crash
            log.warning("skipping malformed shared-state entry on %s: %s", stream, e)
            self.metrics.replication_errors.inc()

    def _apply_link(self, raw: bytes) -> None:
        obj = orjson.loads(raw)
        report = LinkReport.from_json(obj["r"])
        at = float(obj["at"])
        if not math.isfinite(at):
            raise ValueError("received_at must be finite")
        self.svc.update_link(report, at, local=False)
        self.metrics.replication_applied.labels("link").inc()

    def _apply_failure(self, raw: bytes) -> None:
        cluster, decode, reason, stage, at = orjson.loads(raw)
        f = failure_of(cluster, decode, reason, stage)
        at = float(at)
        if not math.isfinite(at):
            raise ValueError("received_at must be finite")
        self.svc.apply_failure(f, at, local=False)
        self.metrics.replication_applied.labels("failure").inc()

    def _apply_node(self, raw: bytes) -> None:
        obj = orjson.loads(raw)
        rep = NodeReport.from_json(obj["n"])
        self.svc.apply_node_reports([rep], float(obj["at"]), local=False)
        self.metrics.replication_applied.labels("node").inc()

    def _apply_booking(self, row: list[Any]) -> None:
        at, target, prefill, decode, prefill_s, uncached, rejected = row
        self.svc.apply_booking(
            Booking(
                float(at),
                str(target),
                None if prefill is None else str(prefill),
                None if decode is None else str(decode),
                float(prefill_s),
                int(uncached),
                bool(rejected),
            )
        )
        self.metrics.replication_applied.labels("booking").inc()

    def _apply_threshold(self, raw: bytes) -> None:
        obj = orjson.loads(raw)
        if obj.get("by") == self.replica or self.svc.leads:
            return
        base = _num(obj["base_t"])
        t = _num(obj["t"])
        # an older leader publishes no drift: the follower keeps what it applies
        self.svc.adopt_threshold(base, t, factors_from_json(obj.get("drift")))
        rec = obj.get("rec")
        self.remote_recommendation = rec if isinstance(rec, dict) else None
        self.metrics.replication_applied.labels("threshold").inc()

    # -- leader

    async def _leader(self) -> None:
        lease_ms = int(self.cfg.redis_leader_lease_s * 1000)
        renew_every = self.cfg.redis_leader_lease_s / 3
        attempt = 0
        while True:
            try:
                await asyncio.wait_for(self._lease(lease_ms), self.cfg.redis_timeout_s)
                attempt = 0
            except (RedisError, OSError, TimeoutError) as e:
                self.is_leader = False
                self._failed(e)
                attempt += 1
                await self._retry_pause(attempt)
                continue
            self._set_leads()
            if self.is_leader:
                self.svc.tick_threshold()
                self.publish_threshold()
            await asyncio.sleep(min(renew_every, 0.1) if self.is_leader else renew_every)

    async def _lease(self, lease_ms: int) -> None:
        if self.is_leader:
            renewed = await self.r.eval(_RENEW, 1, self.k_leader, self.replica, lease_ms)
            if not renewed:
                log.warning("lost the leader lease")
                self.is_leader = False
        if not self.is_leader:
            got = await self.r.set(self.k_leader, self.replica, nx=True, px=lease_ms)
            if got:
                log.info("leading: this replica runs the threshold controller and the planner")
                self.is_leader = True
                self._published_t = None

    async def _release_lease(self) -> None:
        await self.r.eval(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
            "end return 0",
            1,
            self.k_leader,
            self.replica,
        )

    def publish_threshold(self) -> None:
        """The leader's current thresholds and recommendation, when they changed."""
        th = self.svc.threshold
        drift = {k: round(f, 4) for k, f in self.svc.drift_applied.items()}
        key = (th.base_t, round(th.t, 1), tuple(sorted(drift.items())))
        if key == self._published_t:
            return
        self._published_t = key
        rec = self.svc.recommendation
        payload = orjson.dumps(
            {
                "by": self.replica,
                "base_t": _enc(th.base_t),
                "t": _enc(th.t),
                "at": time.time(),
                "rec": None if rec is None else rec.to_json(),
                "drift": drift,
            }
        )
        self._queue("threshold", (payload,))


def _enc(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def _num(x: object) -> float:
    if x == "inf":
        return math.inf
    if isinstance(x, bool) or not isinstance(x, int | float) or not x >= 0:
        raise ValueError(f"threshold: expected a number >= 0, got {x!r}")
    return float(x)


def cache_row(e: CacheEvent) -> list[Any]:
    """A cache event as replicas share it (``cache_event`` reads it back)."""
    return [e.kind, e.cluster, e.node, e.seq, list(e.hashes), e.window]


def cache_event(row: Any) -> CacheEvent:
    """A replicated cache event: ``[kind, cluster, node, seq, hashes, window]`` (a replica
    older than window events writes the first five). ``apply`` checks the values."""
    if not isinstance(row, list) or len(row) not in (5, 6):
        raise ValueError("cache event: expected [kind, cluster, node, seq, hashes, window]")
    kind, cluster, node, seq, hashes = row[:5]
    window = row[5] if len(row) == 6 else 0
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (seq, window)):
        raise ValueError("cache event: seq and window must be integers")
    return CacheEvent(kind, cluster, node, seq, tuple(int(h) for h in hashes), window)


def _sid(eid: bytes | str) -> str:
    return eid.decode() if isinstance(eid, bytes) else str(eid)


def _older(a: str, b: str) -> bool:
    """Stream id a is before b."""
    am, _, aseq = a.partition("-")
    bm, _, bseq = b.partition("-")
    return (int(am), int(aseq or 0)) < (int(bm), int(bseq or 0))


async def wait_written(sync: object, timeout: float) -> bool | None:
    """For report endpoints: wait until the input just applied is in Redis (None: no Redis)."""
    if isinstance(sync, RedisSync):
        return await sync.written(timeout)
    return None


__all__ = ["RedisSync", "SharedStateError", "replica_name", "require_redis", "wait_written"]
