"""Resource limits a careless operator or a hostile peer hits, with real processes: the daemon
stays up, says why, and keeps serving (issue 13 class 5)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient
from xdc.transport.launcher import local_pair_config

from tests.paths import REPO
from tests.tls_fixtures import Pki
from tests.transport_fixtures import (
    Pair,
    PairFactory,
    engine_socket_ready,
    intact,
    needs_root,
    produce,
    transfer_and_verify,
    wait_live,
)
from xdc.config import to_toml
from xdc.errors import TransferError
from xdc.lab.raw_peer import RawSender
from xdc.protocol import Keep, Ping, Pong
from xdc.protocol.aead_records import RECORD_MAX

CHUNK = 64 * 1024


# running out of descriptors: tests/transport/test_daemon_hostile_load.py (issue 26, finding 1)


def test_idle_connections_cost_no_chunk_sized_buffer_each(pair_factory: PairFactory) -> None:
    """1,000 idle connections took the receiver from 32 MiB to 3.9 GiB (a 4 MiB scratch
    buffer each); now a scratch buffer is made only when a duplicate chunk needs one."""
    p = pair_factory().start()
    assert p.rx is not None
    proc = psutil.Process(p.rx.proc.pid)
    transfer_and_verify(p.tx_sock, p.rx_sock, "warm", [CHUNK])
    before = proc.memory_info().rss
    idle = [RawSender(p.rx_cfg.receiver.listen_port, f"idle-{i}") for i in range(300)]
    try:
        grown = proc.memory_info().rss - before
        assert grown < 100 * 2**20, f"300 idle connections cost {grown / 2**20:.0f} MiB"
        transfer_and_verify(p.tx_sock, p.rx_sock, "with-idle", [CHUNK, 2 * CHUNK])
    finally:
        for c in idle:
            c.close()


def _mutual_tls_pair(
    pair_factory: PairFactory,
    pki: Pki,
    idle_timeout_s: float | None = None,
    record_layer: str = "sealed",
) -> tuple[Pair, psutil.Process]:
    """A daemon pair on mutual TLS (sealed records unless ``record_layer`` says "tls"),
    warmed by one transfer, and the receiver's process to measure."""
    p = pair_factory()
    p.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")
    p.tx_cfg.tls = pki.config("tx", "tx.example", allowed="rx.example")
    p.rx_cfg.tls.record_layer = p.tx_cfg.tls.record_layer = record_layer
    if idle_timeout_s is not None:
        p.rx_cfg.receiver.idle_timeout_s = idle_timeout_s
    p.start()
    assert p.rx is not None
    transfer_and_verify(p.tx_sock, p.rx_sock, "warm", [CHUNK])
    return p, psutil.Process(p.rx.proc.pid)


@contextlib.contextmanager
def _peers_held(
    proc: psutil.Process, count: int, open_one: Callable[[int], RawSender]
) -> Iterator[tuple[list[RawSender], int]]:
    """``count`` raw peers opened by ``open_one(i)`` and held open, with how much the
    receiver ``proc`` grew (RSS bytes) once all were open; all closed after, also on failure."""
    before = proc.memory_info().rss
    peers: list[RawSender] = []
    try:
        for i in range(count):
            peers.append(open_one(i))
        yield peers, proc.memory_info().rss - before
    finally:
        for c in peers:
            c.close()


@pytest.mark.parametrize("record_layer", ["sealed", "tls"])
def test_idle_mutual_tls_connections_cost_no_record_sized_buffer_each(
    pair_factory: PairFactory, pki: Pki, record_layer: str
) -> None:
    """Under mutual TLS each connection has a buffer to receive records into: one whole
    sealed record (1 MiB of plaintext), or 256 KiB of TLS records. 300 idle connections of
    an authenticated peer must not cost it each: they get pages only when records come
    (sealed: +421 MiB before that; TLS records: +90 MiB)."""
    p, proc = _mutual_tls_pair(pair_factory, pki, record_layer=record_layer)

    def idle(i: int) -> RawSender:
        return RawSender(p.rx_cfg.receiver.listen_port, f"idle-{i}", tls=p.tx_cfg.tls)

    with _peers_held(proc, 300, idle) as (peers, grown):
        assert all(c.records is not None and c.records.record_layer == record_layer for c in peers)
        print(f"300 idle connections, {record_layer} records: receiver RSS +{grown >> 20} MiB")
        assert grown < 50 * 2**20, f"300 idle {record_layer} connections cost {grown >> 20} MiB"
        transfer_and_verify(p.tx_sock, p.rx_sock, "with-idle", [CHUNK, 2 * CHUNK])


def test_a_sealed_connection_gives_back_the_pages_of_a_large_record_once_it_is_read(
    pair_factory: PairFactory, pki: Pki
) -> None:
    """A real sender seals at most 256 KiB per record (small frames joined: 64 KiB); an
    authenticated peer may seal up to 1 MiB of frames into one. Each connection that had
    read one kept 2 MiB of record buffers resident until it closed (40 connections: +80 MiB
    here); now the pages beyond what a real sender's records need go back once it is read."""
    p, proc = _mutual_tls_pair(pair_factory, pki, idle_timeout_s=60.0)  # all 40 stay open

    def one_large_record(i: int) -> RawSender:
        peer = RawSender(p.rx_cfg.receiver.listen_port, f"big-{i}", tls=p.tx_cfg.tls)
        try:
            # KEEPs of a request it never began: nothing to answer, and 128-character rids
            # make few frames to parse (PONGs, 43,000 a record, took 22 s for the 40)
            keep = peer.conn.send(Keep(f"{i:03d}" + "k" * 125))
            peer.write_record(keep * ((RECORD_MAX - 64) // len(keep)))
            peer.send(Ping(i))  # answered once the record before it was read
            assert peer.next_event(timeout=10) == Pong(i)
        except BaseException:
            peer.close()
            raise
        return peer

    with _peers_held(proc, 40, one_large_record) as (_peers, grown):
        print(f"40 sealed connections that read a 1 MiB record each: RSS +{grown / 2**20:.0f} MiB")
        assert grown < 40 * 2**20, f"40 connections hold {grown / 2**20:.0f} MiB after 1 MiB each"
        transfer_and_verify(p.tx_sock, p.rx_sock, "after", [CHUNK, 2 * CHUNK])


def test_connections_beyond_the_cap_are_closed_and_the_rest_keep_working(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(connections=2)
    p.rx_cfg.receiver.max_connections = 20
    p.start()
    transfer_and_verify(p.tx_sock, p.rx_sock, "first", [CHUNK])
    extra = []
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", p.rx_cfg.receiver.listen_port), timeout=2)
            extra.append(s)
        for s in extra:
            s.setblocking(False)
        shut: set[int] = set()  # the receiver closes those over the cap as it accepts them
        deadline = time.monotonic() + 10
        while len(shut) < 20 and time.monotonic() < deadline:
            for i, s in enumerate(extra):
                if i in shut:
                    continue
                try:
                    if s.recv(1) == b"":
                        shut.add(i)
                except BlockingIOError:
                    pass
                except OSError:
                    shut.add(i)
            time.sleep(0.02)
        assert len(shut) >= 20, f"only {len(shut)} of 40 connections over the cap were closed"
        transfer_and_verify(p.tx_sock, p.rx_sock, "second", [CHUNK])
        assert p.rx is not None and "receiver.max_connections" in p.rx.log()
    finally:
        for s in extra:
            s.close()


@pytest.fixture
def small_shm() -> Iterator[tuple[list[str], Path]]:
    """A private mount namespace whose /dev/shm is a 64 MiB tmpfs (Docker's default size):
    the command prefix that runs a process inside it, and a work directory."""
    holder = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=64m tmpfs /dev/shm && echo ready && exec sleep 600",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
    work = Path(tempfile.mkdtemp(prefix="xdc-smallshm-"))
    try:
        yield ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt"], work
    finally:
        holder.kill()
        holder.wait()
        shutil.rmtree(work, ignore_errors=True)


@needs_root
def test_a_pool_larger_than_shared_memory_is_refused_at_start_with_a_clear_error(
    small_shm: tuple[list[str], Path],
) -> None:
    """It used to start and die of SIGBUS on first use, with no log line."""
    enter, work = small_shm
    _tx, rx, _ = local_pair_config(work, recv_pool=256 << 20)
    cfg = work / "rx.toml"
    cfg.write_text(to_toml(rx))
    out = subprocess.run(
        [*enter, sys.executable, "-m", "xdc", "receiver", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out
    assert "256 MiB does not fit /dev/shm (64 MiB free)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "shm-size" in out.stderr


@needs_root
def test_a_pool_that_fit_at_start_keeps_its_memory_when_shm_fills_up(
    small_shm: tuple[list[str], Path],
) -> None:
    """The pages are reserved at start: another process filling /dev/shm afterwards cannot
    make a transfer die of SIGBUS."""
    enter, work = small_shm
    tx, rx, _ = local_pair_config(
        work, chunk_bytes=CHUNK, connections=2, send_pool=8 << 20, recv_pool=40 << 20
    )
    (work / "tx.toml").write_text(to_toml(tx))
    (work / "rx.toml").write_text(to_toml(rx))
    procs = [
        subprocess.Popen(
            [*enter, sys.executable, "-m", "xdc", kind, "--config", str(work / f"{short}.toml")],
            stdout=open(work / f"{kind}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        for kind, short in (("receiver", "rx"), ("sender", "tx"))
    ]
    try:
        for path in (rx.receiver.control_socket, tx.sender.control_socket):
            engine_socket_ready(path, 20)
        # someone else takes every byte of shared memory that is left
        fill = subprocess.run(
            [
                *enter,
                "sh",
                "-c",
                "dd if=/dev/zero of=/dev/shm/hog bs=1M count=64 2>&1; df -m /dev/shm",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "No space left" in fill.stdout, fill.stdout
        engine = textwrap.dedent(
            f"""
            from tests.transport_fixtures import transfer_and_verify
            transfer_and_verify({tx.sender.control_socket!r}, {rx.receiver.control_socket!r},
                      "after-fill", [{8 * CHUNK}] * 8)
            print("ok")
            """
        )
        out = subprocess.run(
            [*enter, sys.executable, "-c", engine],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert out.stdout.strip() == "ok", out.stdout + out.stderr
        assert all(proc.poll() is None for proc in procs)  # nobody died of SIGBUS
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_taken_port_is_a_one_line_error(pair_factory: PairFactory) -> None:
    p = pair_factory().start()
    rx = copy.deepcopy(p.rx_cfg)
    rx.receiver.control_socket = str(p.workdir / "rx2.sock")  # only the data port clashes
    cfg = p.workdir / "rx-second.toml"
    cfg.write_text(to_toml(rx))
    out = subprocess.run(
        [sys.executable, "-m", "xdc", "receiver", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out
    assert "cannot listen on" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not os.path.exists(rx.receiver.control_socket)  # it cleaned up what it took
    transfer_and_verify(p.tx_sock, p.rx_sock, "first-receiver-fine", [CHUNK])


def test_payloads_stalled_on_many_connections_hold_data_threads_only_until_the_idle_timeout(
    pair_factory: PairFactory,
) -> None:
    """With data threads, a peer that starts 30 chunk payloads and stops half way parks one
    receiver thread per connection in poll(). The daemon keeps serving meanwhile, the idle
    timeout ends those connections, and the threads go away: a hostile peer can hold at most
    one thread per connection it keeps open, and only for as long as it keeps them open."""
    from xdc.protocol import Accept, Begin

    p = pair_factory(chunk_bytes=CHUNK)
    p.rx_cfg.receiver.data_threads = "on"
    p.rx_cfg.receiver.idle_timeout_s = 1.0
    p.start()
    assert p.rx is not None
    proc = psutil.Process(p.rx.proc.pid)
    transfer_and_verify(p.tx_sock, p.rx_sock, "warm", [CHUNK])
    threads_before = proc.num_threads()
    n = 30
    hogs = [RawSender(p.rx_cfg.receiver.listen_port, "hog-session") for _ in range(n)]
    try:
        hogs[0].send(Begin("hog", tuple([CHUNK] * n), CHUNK, (), 0, 30_000))
        hogs[0].events_until(lambda ev: isinstance(ev, Accept))
        for i, h in enumerate(hogs):  # a header and half a payload each, then silence
            h.send_chunk("hog", i, 0, os.urandom(CHUNK), upto=CHUNK // 2)
        deadline = time.monotonic() + 5
        while proc.num_threads() < threads_before + n // 2:
            assert time.monotonic() < deadline, (threads_before, proc.num_threads())
            time.sleep(0.05)
        parked = proc.num_threads()
        transfer_and_verify(p.tx_sock, p.rx_sock, "beside-the-hogs", [CHUNK, 3 * CHUNK])
        # idle timeout (1 s) closes the hogs' connections; trio's thread cache lets an idle
        # worker go after 10 s
        deadline = time.monotonic() + 20
        while proc.num_threads() > threads_before + 4:
            assert time.monotonic() < deadline, (threads_before, parked, proc.num_threads())
            time.sleep(0.25)
        print(f"receiver threads: {threads_before} before, {parked} with the hogs parked")
        assert p.rx.log().count("(idle timeout)") >= n // 2
    finally:
        for h in hogs:
            h.close()
    transfer_and_verify(p.tx_sock, p.rx_sock, "after-the-hogs", [CHUNK])


def test_a_begin_over_the_senders_own_header_limit_fails_its_request_not_the_daemon(
    pair_factory: PairFactory,
) -> None:
    """``limits.max_header_bytes`` may be as low as 256, and an engine may name up to
    ``max_block_hashes`` prefix blocks: a BEGIN whose header the sender's own encoder refuses
    once ended the daemon's nursery (every request on it failed SHUTDOWN). It fails that
    request with LIMIT; the next request goes through."""
    p = pair_factory(connections=2)
    for cfg in (p.tx_cfg, p.rx_cfg):
        cfg.limits.max_header_bytes = 256
    p.start()
    wait_live(p, 2)
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("long", [64 * 1024] * 2, block_hashes=[2**63 + i for i in range(40)])
        try:  # the request fails as soon as its BEGIN is framed: its layers may be refused
            for i in range(2):
                t.layer_buffer(i)
                t.layer_ready(i)
        except TransferError as e:
            assert e.code == "LIMIT", e
        out = tx.wait("long", 20)
        assert not out.ok and out.code == "LIMIT", out
        assert "BEGIN header 390 bytes > limit 256" in out.error, out.error
        produce(tx, "short", [64 * 1024] * 2)
        assert tx.wait("short", 20).ok
        intact(rx, "short")
    assert p.sender.proc.poll() is None
    p.assert_clean()
