"""Data worker processes (transport/data_workers.py, docs/data_workers.md), forced on with two
workers per daemon on this 2-core machine, over plain TCP and mutual TLS with sealed records:
requests arrive byte-exact with every payload moved by a worker; a worker SIGKILLed mid-transfer
loses only its connections, whose chunks go out on the others, and the request still arrives
intact; stopping a daemon leaves no worker behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import trio
from xdc.transport.data_workers import DataWorkers, StopFlag, WorkerConn, WorkerLost
from xdc.transport.engine_client import DecodeClient, PrefillClient
from xdc.transport.shm import SHM_DIR, Segment, sweep_stale_segments
from xdc.transport.sockio import READ_AHEAD

from tests.tls_fixtures import Pki
from tests.transport_fixtures import (
    Pair,
    PairFactory,
    intact,
    loopback_tcp_pair,
    produce,
    wait_drained,
    wait_live,
    wait_unread,
)
from xdc.config import (
    AUTO_DATA_WORKERS_MAX,
    DATA_WORKERS_MIN_CORES,
    ConfigError,
    data_workers_for,
    load_config,
    to_toml,
)
from xdc.protocol import ChunkHeader, Limits, Ping, chunk_checksum, worker_jobs
from xdc.protocol.aead_records import Opener, Sealer, checksum_sampled, sealed_size
from xdc.protocol.wire.frames import encode, encode_chunk_header
from xdc.protocol.worker_jobs import Done, Failure, Landed, Lease, Recv, Run, Send, SendChunk

MIB = 1 << 20
WORKERS = 2


@pytest.fixture(params=["plain", "tls", "runs", "tls-runs"])
def make(request: pytest.FixtureRequest, pair_factory: PairFactory, pki: Pki) -> PairFactory:
    """``runs``: the receiver's workers read frames and land chunks on their own
    (``receiver.worker_runs``, transport/receive_runs.py); ``tls*``: mutual TLS, sealed
    records."""

    def build(**kw: object) -> Pair:
        p = pair_factory(**kw)
        if request.param.startswith("tls"):
            p.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")
            p.tx_cfg.tls = pki.config("tx", "tx.example", allowed="rx.example")
        p.rx_cfg.receiver.worker_runs = request.param.endswith("runs")
        p.tx_cfg.sender.data_workers = p.rx_cfg.receiver.data_workers = WORKERS
        return p

    return build


def _workers(pid: int) -> list[psutil.Process]:
    return [
        c
        for c in psutil.Process(pid).children()
        if any("xdc.transport.data_worker" in a for a in c.cmdline())
    ]


def _all_dead(procs: list[psutil.Process], timeout: float = 10) -> list[int]:
    """Pids still alive after ``timeout`` (a zombie counts as dead: it runs nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for w in procs:
            try:
                if w.is_running() and w.status() != psutil.STATUS_ZOMBIE:
                    alive.append(w.pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_requests_arrive_byte_exact_with_payloads_moved_by_workers(make: PairFactory) -> None:
    p = make(chunk_bytes=256 * 1024, connections=4).start()
    assert p.tx is not None and p.rx is not None
    assert len(_workers(p.tx.proc.pid)) == WORKERS and len(_workers(p.rx.proc.pid)) == WORKERS
    wait_live(p, 4)
    sizes = {"big": [2 * MIB] * 6, "odd": [MIB + 4321, 7, 300_001], "small": [64 * 1024] * 3}
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        for rid, s in sizes.items():
            produce(tx, rid, s)
        for rid in sizes:
            assert tx.wait(rid, 30).ok, rid
            intact(rx, rid)
        st_tx, st_rx = tx.status(), rx.status()
    for st in (st_tx, st_rx):
        w = st["data_workers"]
        # a sender opens its connections all at once: they are spread over the workers
        # (each was once counted only after its hand-over, and all went to the first)
        w.pop("stop_flags_held")  # runs may still lease the requests just released
        assert w == {
            "workers": WORKERS,
            "alive": WORKERS,
            "lost": 0,
            "connections": 4,
            "per_worker": [4 // WORKERS] * WORKERS,
        }, w
    assert st_rx["checksum_failures"] == 0
    if p.rx_cfg.receiver.worker_runs:  # most chunks landed with no job of their own
        assert st_rx["run_chunks"] > len(sizes) * 4, st_rx
    else:
        assert st_rx["runs"] == st_rx["run_chunks"] == 0, st_rx
    p.assert_clean()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_a_worker_killed_mid_transfer_costs_its_connections_not_the_request(
    make: PairFactory, side: str
) -> None:
    p = make(chunk_bytes=256 * 1024, connections=4).start()
    wait_live(p, 4)
    daemon = p.tx if side == "sender" else p.rx
    assert daemon is not None
    victim = _workers(daemon.proc.pid)[0]
    killed = threading.Event()

    def kill_at(i: int) -> None:
        if i == 4:
            os.kill(victim.pid, signal.SIGKILL)
            killed.set()

    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        produce(tx, "survivor", [2 * MIB] * 16, pause=0.03, on_layer=kill_at)
        o = tx.wait("survivor", 40)
        assert killed.is_set()
        assert o.ok, o
        intact(rx, "survivor")
        st = (tx if side == "sender" else rx).status()["data_workers"]
        assert st["lost"] == 1 and st["alive"] == WORKERS - 1, st
        # the connections it held came back, on the worker that is left
        wait_live(p, 4, timeout=20)
        produce(tx, "after", [MIB] * 6)
        assert tx.wait("after", 30).ok
        intact(rx, "after")
    assert not _all_dead([victim])
    p.assert_clean()


def test_stopping_the_daemons_leaves_no_worker_behind(make: PairFactory) -> None:
    p = make(connections=2).start()
    assert p.tx is not None and p.rx is not None
    workers = _workers(p.tx.proc.pid) + _workers(p.rx.proc.pid)
    assert len(workers) == 2 * WORKERS
    p.stop()
    assert not _all_dead(workers)


def test_a_killed_daemon_takes_its_workers_with_it(make: PairFactory) -> None:
    p = make(connections=2).start()
    assert p.rx is not None
    pid = p.rx.proc.pid
    workers = _workers(pid)
    (left,) = SHM_DIR.glob(f"xdc-rx-{pid}-*")  # its pool
    p.rx.kill()  # SIGKILL: no shutdown of ours runs
    assert not _all_dead(workers)
    # what the killed receiver left in /dev/shm is swept by the next xdc daemon to start; a
    # dead worker's mapping does not hold it (a daemon another test starts meanwhile may
    # have swept it already: only this receiver's pool is looked at)
    swept = sweep_stale_segments(prefix=f"xdc-rx-{pid}")
    assert swept == [left.name] or (not swept and not left.exists()), (swept, left)


@dataclass
class OneWorker:
    """One worker process on a 1 MiB pool, holding the receiving end of a loopback pair."""

    seg: Segment
    workers: DataWorkers
    peer: trio.socket.SocketType  # the sending end, ours
    lent: trio.socket.SocketType  # the receiving end, a copy of it lent to the worker
    wc: WorkerConn


def _with_one_worker(body: Callable[[OneWorker], Awaitable[None]], sealed: bool = False) -> None:
    async def main() -> None:
        seg = Segment.create(1 << 20, prefix="xdc-test-workers")
        try:
            workers = DataWorkers(1, seg, Limits())
            async with trio.open_nursery() as n:
                await n.start(workers.serve)
                a, b = await loopback_tcp_pair()
                wc = await workers.adopt(b, sealed=sealed, idle_timeout=2.0)
                try:
                    await body(OneWorker(seg, workers, a, b, wc))
                finally:
                    a.close()
                    b.close()
                    n.cancel_scope.cancel()
        finally:
            seg.close()

    trio.run(main)


def test_a_job_outside_the_pool_or_for_no_connection_is_refused_and_the_worker_lives() -> None:
    """What a buggy daemon could ask: bytes past the pool's end, a connection the worker does
    not hold. The worker answers BAD_JOB, writes nothing, and takes the next job."""

    async def body(w: OneWorker) -> None:
        wc, cell = w.wc, ("r", 0, 0)
        for job in (
            Recv(wc.next_job(), wc.conn, (1 << 20) - 10, 11, 0, cell, None, None),
            Recv(wc.next_job(), wc.conn, 0, 10, 11, cell, None, None),
            Send(wc.next_job(), wc.conn, (SendChunk("r", 0, 0, 2, (1 << 20) - 1, 0),), None),
            Recv(wc.next_job(), wc.conn + 99, 0, 10, 0, cell, None, None),
        ):
            done = await w.workers.call(wc, job)
            assert done.failure is Failure.BAD_JOB, done
        assert bytes(w.seg.view[:16]) == bytes(16)
        await w.peer.send(b"0123456789")
        done = await wc.run(Recv(wc.next_job(), wc.conn, 0, 10, 0, cell, None, None))
        assert done.failure is Failure.NONE and bytes(w.seg.view[:10]) == b"0123456789"
        assert w.workers.status()["lost"] == 0

    _with_one_worker(body)


def test_a_worker_hands_back_what_it_read_past_the_payload_and_nothing_into_the_pool() -> None:
    """A RECV's last read also takes the next frame's first bytes (``sockio.READ_AHEAD``):
    they come back in the reply for the daemon's parser; the pool gets the payload only."""

    async def body(w: OneWorker) -> None:
        payload, after = os.urandom(100_000), b"NEXT" + os.urandom(READ_AHEAD * 2)
        data, sent = payload + after, 0
        while sent < len(data):
            sent += await w.peer.send(data[sent:])
        await wait_unread(w.lent, len(data))  # all of it there: one read sees past
        job = Recv(w.wc.next_job(), w.wc.conn, 64, len(payload), 0, ("r", 0, 0), None, None)
        done = await w.wc.run(job)
        assert done.failure is Failure.NONE and done.moved == len(payload)
        assert 0 < len(done.ahead) <= READ_AHEAD
        assert after.startswith(done.ahead)
        view = w.seg.view
        assert bytes(view[64 : 64 + len(payload)]) == payload
        assert bytes(view[64 + len(payload) :]) == bytes(len(view) - 64 - len(payload))

    _with_one_worker(body)


async def _stopped_within_a_second(
    w: OneWorker, start: Callable[[], Awaitable[Done]], flag: StopFlag
) -> Done:
    """``start()``'s job, stalled mid-payload (the worker read what there was and waits for
    more): it runs on until ``flag`` is set, then replies within a second."""
    replies: list[Done] = []
    async with trio.open_nursery() as n:

        async def run() -> None:
            replies.append(await start())

        n.start_soon(run)
        await wait_drained(w.lent)
        await trio.sleep(0.3)
        assert not replies, "the job ended before it was told to"
        t0 = trio.current_time()
        flag.set()
    assert trio.current_time() - t0 < 1.0
    (done,) = replies
    return done


def test_a_read_told_to_stop_ends_where_it_is_and_the_next_job_reads_on() -> None:
    """A stalled in-place read whose chunk was resent and verified elsewhere: once the daemon
    sets its stop flag the worker replies within a poll interval, saying how far it got and
    giving no verdict; the slot is the daemon's again and the connection stays usable."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        await w.peer.send(b"x" * 1000)  # of a 5000-byte payload: the rest never comes
        job = Recv(w.wc.next_job(), w.wc.conn, 0, 5000, 0, ("r", 0, 0), None, None, flag.slot)
        done = await _stopped_within_a_second(w, lambda: w.wc.run(job), flag)
        assert (done.failure, done.moved, done.verdict, done.ahead) == (
            Failure.NONE,
            1000,
            None,
            b"",
        )
        flag.release()
        again = w.workers.stop_flag()
        assert again is not None and again.slot == flag.slot and not w.workers._flags[again.slot]
        await w.peer.send(b"0123456789")
        nxt = Recv(w.wc.next_job(), w.wc.conn, 64, 10, 0, ("r", 0, 0), None, None, again.slot)
        assert (await w.wc.run(nxt)).moved == 10
        assert bytes(w.seg.view[64:74]) == b"0123456789"

    _with_one_worker(body)


def _chunk_frame(rid: str, layer: int, offset: int, payload: bytes, copy: bool | None) -> bytes:
    hdr = ChunkHeader(rid, layer, offset, len(payload), chunk_checksum(payload, rid, layer, offset))
    return encode_chunk_header(dataclasses.replace(hdr, copy=copy)) + payload


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    sent = 0
    while sent < len(data):
        sent += await sock.send(data[sent:])


def test_a_run_lands_first_sends_of_leased_requests_and_hands_back_the_first_other_frame() -> None:
    """A run (receive_runs) reads the frames itself: each first send (``copy`` False) of a
    leased request lands at its cell and is reported with its verdict, a bad one with False;
    it ends at the first frame it may not land (here a copy), whose bytes all come back with
    what follows, unparsed, for the daemon; the pool holds exactly the landed payloads."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        grid_a, grid_b = (3 * 1000, 500), (2 * 1000,)
        leases = (Lease("a", 0, grid_a, 1000, flag.slot), Lease("b", 8192, grid_b, 1000, flag.slot))
        pa = [os.urandom(1000) for _ in range(3)] + [os.urandom(500)]
        pb = os.urandom(1000)
        first = _chunk_frame("a", 0, 0, pa[0], False)
        rest = b"".join(
            [
                _chunk_frame("a", 0, 1000, pa[1], False),
                _chunk_frame("b", 0, 1000, pb, False),
                _chunk_frame("a", 0, 2000, pa[2], False)[:-1] + b"\x00",  # corrupted in flight
                _chunk_frame("a", 1, 0, pa[3], False),
            ]
        )
        tail = _chunk_frame("a", 0, 2000, pa[2], True) + encode(Ping(7))
        await _send_all(w.peer, first[10:] + rest + tail)
        reports: list[Landed] = []

        async def on_landed(batch: list[Landed]) -> None:
            reports.extend(batch)

        job = Run(w.wc.next_job(), w.wc.conn, leases, first[:10])
        done = await w.wc.run_frames(job, on_landed)
        cells = [c for r in reports for c in r.cells]
        assert [(c[0], c[1], c[2], c[5]) for c in cells] == [
            ("a", 0, 0, True),
            ("a", 0, 1000, True),
            ("b", 0, 1000, True),
            ("a", 0, 2000, False),
            ("a", 1, 0, True),
        ]
        assert (done.failure, done.moved, done.skip) == (Failure.NONE, 5, 0)
        assert done.ahead == tail[: len(done.ahead)] and len(done.ahead) >= 12
        view = w.seg.view
        assert bytes(view[0:2000]) == pa[0] + pa[1]
        assert bytes(view[3000:3500]) == pa[3]
        assert bytes(view[8192 + 1000 : 8192 + 2000]) == pb
        assert bytes(view[8192 : 8192 + 1000]) == bytes(1000)  # nothing else written
        assert bytes(view[3500:8192]) == bytes(8192 - 3500)

    _with_one_worker(body)


def _sealed(sealer: Sealer, *pieces: bytes) -> bytes:
    """Each piece as one record, in order."""
    out = b""
    for piece in pieces:
        buf = bytearray(sealed_size(len(piece), sealer.tag))
        n = sealer.seal_into(memoryview(piece), memoryview(buf))
        out += bytes(buf[:n])
    return out


async def _next_record(sock: trio.socket.SocketType, opener: Opener, have: bytes) -> bytes:
    """The plaintext of the next record on ``sock`` after ``have`` (ciphertext read already)."""
    data = bytearray(have)
    while len(data) < 4 or len(data) < 4 + opener.plaintext_length(bytes(data[:4])) + opener.tag:
        data += await sock.recv(65536)
    n = opener.plaintext_length(bytes(data[:4]))
    plain = bytearray(n)
    opener.open_into(
        memoryview(data)[:4], memoryview(data)[4 : 4 + n + opener.tag], memoryview(plain)
    )
    return bytes(plain)


def _records_pair() -> tuple[Sealer, Opener, worker_jobs.RecordState]:
    """Both ends of one direction of sealed records, and the receiving end lent to a job."""
    secret = os.urandom(32)
    opener = Opener(secret)
    return Sealer(secret), opener, worker_jobs.RecordState.of(opener)


async def _collect(batch: list[Landed], into: list[tuple[str, int, int, bool | None]]) -> None:
    into.extend((c[0], c[1], c[2], c[5]) for r in batch for c in r.cells)


def test_a_sealed_run_opens_frames_and_payloads_and_gives_the_receiving_direction_back() -> None:
    """Under sealed records a run opens each record itself: a header alone, a payload over
    two records, a small frame joined with its payload, a chunk whose checksum is wrong
    (False: every chunk is hashed without sampled checksums); it ends at the PING, which
    comes back as plaintext, and the record state it gives back opens the next record."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        sealer, _opener, lent = _records_pair()
        pa = [os.urandom(1000) for _ in range(3)]
        f0, f1 = _chunk_frame("a", 0, 0, pa[0], False), _chunk_frame("a", 0, 1000, pa[1], False)
        bad = bytearray(_chunk_frame("a", 0, 2000, pa[2], False))
        bad[-1] ^= 1  # corrupted before it was sealed: the tag vouches, the checksum does not
        h0 = len(f0) - 1000
        stream = _sealed(
            sealer, f0[:h0], f0[h0 : h0 + 600], f0[h0 + 600 :], f1, bytes(bad), encode(Ping(7))
        )
        after = _sealed(sealer, encode(Ping(8)))
        await _send_all(w.peer, stream + after)
        await wait_unread(w.lent, len(stream) + len(after))
        cells: list[tuple[str, int, int, bool | None]] = []
        job = Run(
            w.wc.next_job(), w.wc.conn, (Lease("a", 0, (3000,), 1000, flag.slot),), b"", None, lent
        )
        done = await w.wc.run_frames(job, lambda b: _collect(b, cells))
        assert cells == [("a", 0, 0, True), ("a", 0, 1000, True), ("a", 0, 2000, False)]
        assert (done.failure, done.moved, done.skip) == (Failure.NONE, 3, 0)
        assert done.ahead == encode(Ping(7))
        assert bytes(w.seg.view[0:2000]) == pa[0] + pa[1]
        assert done.records is not None
        resumed = Opener.resumed(done.records.key(), done.records.rekey_bytes)
        assert await _next_record(w.lent, resumed, done.records.buffered) == encode(Ping(8))

    _with_one_worker(body, sealed=True)


def test_a_sealed_run_with_sampled_checksums_hashes_only_the_sampled_chunks() -> None:
    """``sampled``: a chunk that carries no checksum (it is not ``checksum_sampled``) is
    vouched for by its records' tags, whatever its checksum field says; a sampled one is
    hashed, and a wrong checksum there is False."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        sealer, _opener, lent = _records_pair()
        assert checksum_sampled(0, 0) and checksum_sampled(0, 16000)
        assert not checksum_sampled(0, 1000)
        payloads = [os.urandom(1000) for _ in range(3)]
        good = _chunk_frame("a", 0, 0, payloads[0], False)
        unsampled = encode_chunk_header(ChunkHeader("a", 0, 1000, 1000, 0, False)) + payloads[1]
        checksum = chunk_checksum(payloads[2], "a", 0, 16000) ^ 1
        wrong = encode_chunk_header(ChunkHeader("a", 0, 16000, 1000, checksum, False)) + payloads[2]
        stream = _sealed(sealer, good, unsampled, wrong, encode(Ping(1)))
        await _send_all(w.peer, stream)
        await wait_unread(w.lent, len(stream))
        cells: list[tuple[str, int, int, bool | None]] = []
        lease = Lease("a", 0, (64000,), 1000, flag.slot)
        job = Run(w.wc.next_job(), w.wc.conn, (lease,), b"", None, lent, True)
        done = await w.wc.run_frames(job, lambda b: _collect(b, cells))
        assert cells == [("a", 0, 0, True), ("a", 0, 1000, True), ("a", 0, 16000, False)]
        assert done.ahead == encode(Ping(1))

    _with_one_worker(body, sealed=True)


def test_a_sealed_run_told_to_stop_mid_payload_drops_the_rest_and_keeps_the_records() -> None:
    """A lease stopped while its payload's records are still coming: nothing more is written
    into its cell (the rest is opened and dropped in the worker, since a record half read
    could not be handed back), the chunk is reported with no verdict and nothing to skip,
    and the record state given back opens the next record: the connection lives on."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        sealer, _opener, lent = _records_pair()
        payload = os.urandom(1000)
        frame = _chunk_frame("a", 0, 0, payload, False)
        h = len(frame) - 1000
        head = _sealed(sealer, frame[:h], frame[h : h + 500])
        await _send_all(w.peer, head)
        cells: list[tuple[str, int, int, bool | None]] = []
        lease = Lease("a", 0, (1000,), 1000, flag.slot)
        job = Run(w.wc.next_job(), w.wc.conn, (lease,), b"", None, lent)
        async with trio.open_nursery() as nursery:
            done: list[Done] = []

            async def run() -> None:
                done.append(await w.wc.run_frames(job, lambda b: _collect(b, cells)))

            nursery.start_soon(run)
            with trio.fail_after(5):
                while bytes(w.seg.view[0:500]) != payload[:500]:
                    await trio.sleep(0.01)
            flag.set()
            await _send_all(w.peer, _sealed(sealer, frame[h + 500 :], encode(Ping(3))))
        assert cells == [("a", 0, 0, None)]
        assert (done[0].failure, done[0].moved, done[0].skip) == (Failure.NONE, 0, 0)
        assert bytes(w.seg.view[500:1000]) == bytes(500)
        records = done[0].records
        assert records is not None and done[0].ahead == b""
        resumed = Opener.resumed(records.key(), records.rekey_bytes)
        assert await _next_record(w.lent, resumed, records.buffered) == encode(Ping(3))

    _with_one_worker(body, sealed=True)


def test_a_sealed_run_leaves_a_record_of_two_frames_to_the_daemon_and_fails_on_a_forgery() -> None:
    """Records a peer may seal that our sender never does: one holding two whole CHUNK
    frames (80 KB, more than a run's frame buffer takes) ends the run with the record
    unopened, and the state given back opens it; then a record whose tag does not match
    ends the run as a lost connection (SEALED), with nothing written into the pool."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        sealer, _opener, lent = _records_pair()
        pa = [os.urandom(40_000) for _ in range(2)]
        both = _chunk_frame("a", 0, 0, pa[0], False) + _chunk_frame("a", 0, 40_000, pa[1], False)
        big = _sealed(sealer, both)
        await _send_all(w.peer, big)
        cells: list[tuple[str, int, int, bool | None]] = []
        lease = Lease("a", 0, (80_000,), 40_000, flag.slot)
        job = Run(w.wc.next_job(), w.wc.conn, (lease,), b"", None, lent)
        done = await w.wc.run_frames(job, lambda b: _collect(b, cells))
        assert (cells, done.failure, done.moved, done.ahead) == ([], Failure.NONE, 0, b"")
        records = done.records
        assert records is not None
        resumed = Opener.resumed(records.key(), records.rekey_bytes)
        assert await _next_record(w.lent, resumed, records.buffered) == both
        forged = bytearray(_sealed(sealer, _chunk_frame("a", 0, 0, pa[0], False)))
        forged[-1] ^= 1
        await _send_all(w.peer, bytes(forged))
        again = worker_jobs.RecordState.of(resumed)
        job = Run(w.wc.next_job(), w.wc.conn, (lease,), b"", None, again)
        done = await w.wc.run_frames(job, lambda b: _collect(b, cells))
        assert done.failure is Failure.SEALED and not cells
        assert bytes(w.seg.view[0:80_000]) == bytes(80_000)

    _with_one_worker(body, sealed=True)


def test_a_lease_added_to_a_run_under_way_lets_it_land_that_request_too() -> None:
    """A request accepted while a run is under way: the daemon adds its lease to the run
    (before the ACCEPT goes out), and the run lands its first sends instead of ending at the
    first of them; a lease sent for a run that is over is dropped by the next run."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        pa, pb = os.urandom(1000), os.urandom(1000)
        reports: list[Landed] = []

        async def on_landed(batch: list[Landed]) -> None:
            reports.extend(batch)

        stale = w.wc.next_job()  # a run that ended: its late lease must not carry over
        await w.wc.add_lease(stale, Lease("x", 4096, (1000,), 1000, flag.slot))
        job = Run(w.wc.next_job(), w.wc.conn, (Lease("a", 0, (1000,), 1000, flag.slot),), b"")
        await w.wc.add_lease(job.job, Lease("b", 2048, (1000,), 1000, flag.slot))
        data = b"".join(
            [
                _chunk_frame("a", 0, 0, pa, False),
                _chunk_frame("b", 0, 0, pb, False),
                _chunk_frame("x", 0, 0, os.urandom(1000), False),
            ]
        )
        await _send_all(w.peer, data)
        await wait_unread(w.lent, len(data))
        done = await w.wc.run_frames(job, on_landed)
        assert [c[:3] + c[5:] for r in reports for c in r.cells] == [
            ("a", 0, 0, True),
            ("b", 0, 0, True),
        ]
        assert done.moved == 2 and len(done.ahead) > 12  # x's chunk: handed back
        view = w.seg.view
        assert bytes(view[0:1000]) == pa and bytes(view[2048:3048]) == pb
        assert bytes(view[4096:5096]) == bytes(1000)

    _with_one_worker(body)


def test_a_run_waiting_on_a_silent_socket_ends_when_a_lease_added_to_it_is_stopped() -> None:
    """A request accepted while the run waits, whose chunks all come on other connections:
    once it is done and its buffer is to be freed, its stop flag ends this run too, though
    no chunk of it (nor anything else) ever came here: the daemon waits for every run it
    leased the buffer to before giving it back."""

    async def body(w: OneWorker) -> None:
        fa, fb = w.workers.stop_flag(), w.workers.stop_flag()
        assert fa is not None and fb is not None
        pa = os.urandom(1000)
        first = trio.Event()

        async def on_landed(batch: list[Landed]) -> None:
            first.set()

        job = Run(w.wc.next_job(), w.wc.conn, (Lease("a", 0, (2000,), 1000, fa.slot),), b"")
        await w.wc.add_lease(job.job, Lease("b", 4096, (1000,), 1000, fb.slot))
        await _send_all(w.peer, _chunk_frame("a", 0, 0, pa, False))
        async with trio.open_nursery() as nursery:
            done: list[Done] = []

            async def run() -> None:
                done.append(await w.wc.run_frames(job, on_landed))

            nursery.start_soon(run)
            with trio.fail_after(5):
                await first.wait()
            await trio.sleep(0.3)  # the run waits for more on a silent socket
            assert not done
            fb.set()
            with trio.fail_after(2):
                while not done:
                    await trio.sleep(0.02)
        assert done[0].moved == 1 and done[0].ahead == b"" and done[0].skip == 0
        assert bytes(w.seg.view[0:1000]) == pa

    _with_one_worker(body)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(("x", 0, 0, 1000, False), id="not-leased"),
        pytest.param(("a", 0, 500, 1000, False), id="off-the-grid"),
        pytest.param(("a", 1, 0, 1000, False), id="no-such-layer"),
        pytest.param(("a", 0, 0, 1000, None), id="unmarked"),
    ],
)
def test_a_run_leaves_every_chunk_it_may_not_land_to_the_daemon(frame: tuple) -> None:  # type: ignore[type-arg]
    """A chunk of a request it holds no lease for, off its grid, or from a sender that does not
    mark first sends: the run writes nothing and hands the whole frame back."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        rid, layer, offset, n, copy = frame
        data = _chunk_frame(rid, layer, offset, os.urandom(n), copy)
        await _send_all(w.peer, data)
        await wait_unread(w.lent, len(data))
        job = Run(w.wc.next_job(), w.wc.conn, (Lease("a", 0, (2000,), 1000, flag.slot),), b"")
        done = await w.wc.run_frames(job, _nothing)
        assert (done.failure, done.moved) == (Failure.NONE, 0)
        assert data.startswith(done.ahead) and len(done.ahead) >= 12
        assert bytes(w.seg.view[:4096]) == bytes(4096)

    _with_one_worker(body)


async def _nothing(batch: list[Landed]) -> None:
    raise AssertionError(f"nothing was to be landed: {batch}")


def test_a_run_told_to_stop_mid_payload_gives_the_chunk_up_and_says_what_to_skip() -> None:
    """A lease's stop flag set while its chunk is half read (a verified copy waits to go in
    place, or the buffer is to be freed): the run writes no more of it, reports it with no
    verdict, and tells the daemon how many of its bytes are still to come."""

    async def body(w: OneWorker) -> None:
        flag = w.workers.stop_flag()
        assert flag is not None
        data = _chunk_frame("a", 0, 0, os.urandom(5000), False)
        await _send_all(w.peer, data[:1000])  # the rest never comes
        reports: list[Landed] = []

        async def on_landed(batch: list[Landed]) -> None:
            reports.extend(batch)

        job = Run(w.wc.next_job(), w.wc.conn, (Lease("a", 0, (5000,), 5000, flag.slot),), b"")
        done = await _stopped_within_a_second(w, lambda: w.wc.run_frames(job, on_landed), flag)
        hdr_len = len(data) - 5000
        assert (done.failure, done.moved, done.ahead) == (Failure.NONE, 0, b"")
        assert done.skip == 5000 - (1000 - hdr_len)
        assert [c[5] for r in reports for c in r.cells] == [None]

    _with_one_worker(body)


def test_a_frame_to_a_worker_cut_short_by_a_cancel_costs_that_worker() -> None:
    """A hand-off cancelled after part of its frame went out would leave the worker reading
    the next frame from that one's middle: the worker is lost instead (killed; its jobs fail
    as WorkerLost), and a cancel before any byte went costs nothing."""

    async def body(w: OneWorker) -> None:
        proc = w.wc.proc
        os.kill(proc.process.pid, signal.SIGSTOP)  # it drains its channel no more
        with trio.move_on_after(0.5) as cut:
            await w.workers._send_frame(proc, bytes(8 << 20))  # more than the channel holds
        assert cut.cancelled_caught
        assert not proc.alive and w.workers.status()["lost"] == 1
        with pytest.raises(WorkerLost):
            await w.wc.run(Recv(w.wc.next_job(), w.wc.conn, 0, 10, 0, ("r", 0, 0), None, None))

    _with_one_worker(body)


def test_a_hand_off_cancelled_before_its_first_byte_costs_nothing() -> None:
    async def body(w: OneWorker) -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            await w.workers._send_frame(w.wc.proc, bytes(8 << 20))
        assert w.wc.proc.alive and w.workers.status()["lost"] == 0
        await w.peer.send(b"0123456789")
        done = await w.wc.run(Recv(w.wc.next_job(), w.wc.conn, 0, 10, 0, ("r", 0, 0), None, None))
        assert done.failure is Failure.NONE and bytes(w.seg.view[:10]) == b"0123456789"

    _with_one_worker(body)


def test_data_workers_is_a_count_or_auto_from_any_source_and_nothing_else(tmp_path: Path) -> None:
    """TOML gives an int or a string, an env var or --set always a string: "4" is the count
    4, "auto" the word, and anything else is refused naming the field."""
    cfg = load_config(
        env={"XDC_SENDER__DATA_WORKERS": "4"}, overrides={"receiver.data_workers": "auto"}
    )
    assert cfg.sender.data_workers == 4 and cfg.receiver.data_workers == "auto"
    (tmp_path / "x.toml").write_text(to_toml(cfg))
    again = load_config(tmp_path / "x.toml", env={}, overrides={})
    assert (again.sender.data_workers, again.receiver.data_workers) == (4, "auto")
    for bad in ("Auto", "-1", "65", "four", "", "1.5", "true"):
        with pytest.raises(ConfigError, match=r"sender\.data_workers"):
            load_config(env={}, overrides={"sender.data_workers": bad})
    for value in (True, 2.5, [2], None):  # what a TOML file (or a caller) may hand over
        with pytest.raises(ConfigError, match=r"receiver\.data_workers"):
            load_config(env={}, overrides={"receiver.data_workers": value})


def test_auto_starts_workers_only_where_each_has_cores_of_its_own() -> None:
    """On 2 cores forced workers cost a third of plain TCP's goodput (bench/README.md): auto
    starts none until there are spare cores, then one per 4, capped."""
    assert data_workers_for("auto", cores=2) == 0
    assert data_workers_for("auto", cores=DATA_WORKERS_MIN_CORES - 1) == 0
    assert data_workers_for("auto", cores=DATA_WORKERS_MIN_CORES) == 2
    assert data_workers_for("auto", cores=16) == 4
    assert data_workers_for("auto", cores=512) == AUTO_DATA_WORKERS_MAX
    # a count is a count, whatever the cores
    assert data_workers_for(3, cores=1) == 3 and data_workers_for(0, cores=64) == 0


def test_a_daemon_set_to_auto_starts_what_its_cores_allow_and_says_so(
    pair_factory: PairFactory,
) -> None:
    """The daemons resolve auto from the cores they may use (the same as this test's): on
    this 2-core machine none, on 16 cores four each; either way a request arrives intact."""
    want = data_workers_for("auto")
    p = pair_factory(chunk_bytes=256 * 1024, connections=2)
    p.tx_cfg.sender.data_workers = p.rx_cfg.receiver.data_workers = "auto"
    p.start()
    assert p.tx is not None and p.rx is not None
    wait_live(p, 2)
    assert len(_workers(p.tx.proc.pid)) == want and len(_workers(p.rx.proc.pid)) == want
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        produce(tx, "r", [MIB + 17, 3 * MIB])
        assert tx.wait("r", 30).ok
        intact(rx, "r")
        for st in (tx.status(), rx.status()):
            w = st["data_workers"]
            assert (w["workers"] if w else 0) == want, w
    worker_words = f"{want} data worker process" if want else "data worker"
    for d in (p.tx, p.rx):
        assert (worker_words in d.log()) == bool(want), d.log()[-2000:]
    p.assert_clean()


SPAWN_FROM_A_THREAD = r"""
import os, socket, subprocess, sys, threading, time
ctrl, theirs = socket.socketpair()
pool, flags = os.memfd_create("pool"), os.memfd_create("flags")
os.ftruncate(pool, 1 << 16)
os.ftruncate(flags, 1 << 16)
fds = (theirs.fileno(), pool, flags)
started = {}

def spawn():
    for fd in fds:
        os.set_inheritable(fd, True)
    args = ["--ctrl-fd", str(fds[0]), "--pool-fd", str(pool), "--flags-fd", str(flags)]
    started["worker"] = subprocess.Popen(
        [sys.executable, "-m", "xdc.transport.data_worker", *args,
         "--parent-pid", str(os.getpid())],
        pass_fds=fds,
    )

t = threading.Thread(target=spawn)
t.start()
t.join()  # the thread that started the worker is gone, as trio's cached threads go
print(started["worker"].pid, flush=True)
time.sleep(60)
"""


def test_a_worker_outlives_the_thread_that_started_it_and_not_its_daemon() -> None:
    """trio starts processes from a thread of its cache, which ends after 10 idle seconds.
    A worker tied to that thread (PR_SET_PDEATHSIG) was SIGKILLed then, taking its
    connections with it; it must live as long as its daemon process, and no longer."""
    daemon = subprocess.Popen(
        [sys.executable, "-c", SPAWN_FROM_A_THREAD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert daemon.stdout is not None
        worker = psutil.Process(int(daemon.stdout.readline()))
        time.sleep(1.0)
        assert _all_dead([worker], timeout=0) == [worker.pid], "it died with its starting thread"
        daemon.kill()
        daemon.wait(5)
        assert not _all_dead([worker], timeout=5), "the worker outlived its daemon"
    finally:
        daemon.kill()
        daemon.wait(5)
