"""Fixtures that start real sender/receiver daemon processes talking over loopback TCP."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import tempfile
import termios
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from xdc.transport.engine_client import DecodeClient, PrefillClient
from xdc.transport.launcher import DaemonProcess, local_pair_config
from xdc.transport.sealed_records import SealedRecords
from xdc.transport.shm import SHM_DIR
from xdc.transport.wire import WireConn

from xdc.config import Config
from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest
from xdc.protocol import ChunkHeader, Hello, Limits, chunk_checksum
from xdc.protocol.aead_records import SHARE_BYTES, Cipher, Opener, Sealer, direction_secrets
from xdc.protocol.wire.events import PROTOCOL_VERSION

PairFactory = Callable[..., "Pair"]
"""What ``pair_factory`` hands a test: ``local_pair_config``'s keywords in, a pair out."""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare, mount, prlimit)")


@dataclass
class Pair:
    tx_cfg: Config
    rx_cfg: Config
    workdir: Path
    tx: DaemonProcess | None = None
    rx: DaemonProcess | None = None
    retired: list[DaemonProcess] = field(default_factory=list)  # killed and replaced

    def restart_receiver(self) -> None:
        """SIGKILL the receiver and start a new one on the same port and socket."""
        assert self.rx is not None
        self.rx.kill()
        self.retired.append(self.rx)
        self.rx = DaemonProcess("receiver", self.rx_cfg, self.workdir)
        self.rx.wait_ready()

    def restart_sender(self) -> None:
        """SIGKILL the sender and start a new one (a new session) on the same socket."""
        assert self.tx is not None
        self.tx.kill()
        self.retired.append(self.tx)
        self.tx = DaemonProcess("sender", self.tx_cfg, self.workdir)
        self.tx.wait_ready()

    def start(self, *, sender: bool = True, receiver: bool = True) -> Pair:
        if receiver:
            self.rx = DaemonProcess("receiver", self.rx_cfg, self.workdir)
            self.rx.wait_ready()
        if sender:
            self.tx = DaemonProcess("sender", self.tx_cfg, self.workdir)
            self.tx.wait_ready()
        return self

    @property
    def sender(self) -> DaemonProcess:
        """The sender process now (after ``start``)."""
        assert self.tx is not None, "the pair's sender was never started"
        return self.tx

    @property
    def receiver(self) -> DaemonProcess:
        """The receiver process now (after ``start``)."""
        assert self.rx is not None, "the pair's receiver was never started"
        return self.rx

    @property
    def tx_sock(self) -> str:
        return self.tx_cfg.sender.control_socket

    @property
    def rx_sock(self) -> str:
        return self.rx_cfg.receiver.control_socket

    def fds(self) -> dict[str, int]:
        """Open file descriptors per daemon: sockets that leak show up here."""
        import psutil

        return {
            d.kind: psutil.Process(d.proc.pid).num_fds()
            for d in (self.tx, self.rx)
            if d is not None and d.proc.poll() is None
        }

    def assert_clean(self, baseline_fds: dict[str, int] | None = None, slack: int = 4) -> None:
        """Nothing held after the dust settles: no request, no pool byte, no extra sockets."""
        import time

        from xdc.transport.engine_client import DecodeClient, PrefillClient

        deadline = time.monotonic() + 10
        while True:
            with PrefillClient(self.tx_sock) as tx, DecodeClient(self.rx_sock) as rx:
                st_tx, st_rx = tx.status(), rx.status()
            clean = (
                not st_tx["requests"]
                and st_tx["pool"]["used"] == 0
                and not st_rx["requests"]
                and st_rx["pool"]["used"] == 0
            )
            fds = self.fds()
            grown = {
                k: (baseline_fds[k], v)
                for k, v in fds.items()
                if baseline_fds and k in baseline_fds and v > baseline_fds[k] + slack
            }
            if clean and not grown:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"leaked: tx {st_tx}, rx {st_rx}, fds grown {grown}")
            time.sleep(0.1)

    def logs(self) -> str:
        out = []
        for d in (self.tx, self.rx):
            if d is not None:
                out.append(f"----- {d.kind} log -----\n{d.log()}")
        return "\n".join(out)

    def stop(self) -> None:
        for d in (self.tx, self.rx):
            if d is not None:
                d.stop()


@pytest.fixture
def pair_factory(request: pytest.FixtureRequest) -> Iterator[PairFactory]:
    """Build daemon pairs with custom configs; everything is stopped and checked for leaked
    shared-memory segments afterwards, also when the test fails."""
    made: list[Pair] = []
    shm_before = {p.name for p in SHM_DIR.glob("xdc-*")}
    dirs: list[Path] = []

    def make(**kw: object) -> Pair:
        wd = Path(tempfile.mkdtemp(prefix="xdc-test-"))
        dirs.append(wd)
        tx, rx, _ = local_pair_config(wd, **kw)  # type: ignore[arg-type]
        tx.sender.idle_timeout_s = 2.0
        rx.receiver.idle_timeout_s = 5.0
        p = Pair(tx, rx, wd)
        made.append(p)
        return p

    yield make
    failed = getattr(request.node, "rep_call", None)
    for p in made:
        if failed is not None and failed.failed:
            print(p.logs())
        p.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    # only segments named after our own daemons' pids: other test runs may share /dev/shm
    ours = {str(d.proc.pid) for p in made for d in (p.tx, p.rx, *p.retired) if d is not None}
    leaked = {
        n for n in {p.name for p in SHM_DIR.glob("xdc-*")} - shm_before if n.split("-")[2] in ours
    }
    assert not leaked, f"daemons leaked shared-memory segments: {leaked}"


def engine_socket_ready(path: str, timeout: float = 15.0) -> str:
    """Wait until a daemon serves its engine socket; returns ``path``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return path
        except OSError:
            assert time.monotonic() < deadline, f"nothing serves {path}"
            time.sleep(0.05)
        finally:
            s.close()


class LimitedReceiver:
    """The pair's receiver as a process of its own under ``prlimit --nofile=N:N`` (root),
    its log in the pair's work directory; a context manager that stops it."""

    def __init__(self, pair: Pair, nofile: int) -> None:
        import subprocess
        import sys

        from xdc.config import to_toml

        cfg = pair.workdir / "rx-limited.toml"
        cfg.write_text(to_toml(pair.rx_cfg))
        self.log_path = pair.workdir / "rx-limited.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in __exit__
        argv = [sys.executable, "-m", "xdc", "receiver", "--config", str(cfg)]
        self.proc = subprocess.Popen(
            ["prlimit", f"--nofile={nofile}:{nofile}", *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def __enter__(self) -> LimitedReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


def transfer_and_verify(
    tx_sock: str,
    rx_sock: str,
    rid: str,
    sizes: list[int],
    timeout: float = 30.0,
    *,
    peer: str | None = None,
) -> None:
    """One request through the daemons with reproducible bytes, checked layer by layer at
    the decode side and released: 'the daemons still serve a correct transfer'. ``peer``:
    the receiver the request names (default: the sender's own)."""
    from xdc.transport.engine_client import DecodeClient, PrefillClient

    from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest

    with PrefillClient(tx_sock) as tx, DecodeClient(rx_sock) as rx:
        t = tx.begin(rid, sizes, peer=peer)
        for i in range(len(sizes)):
            buf = t.layer_buffer(i)
            fill_layer(buf, rid, i)
            del buf
            t.layer_ready(i)
        outcome = t.wait(timeout)
        assert outcome.ok, outcome
        req = rx.await_request(rid, timeout=timeout)
        for i, size in enumerate(sizes):
            assert layer_digest(req.layer(i)) == expected_digest(rid, i, size), (rid, i)
        req.release()


async def loopback_tcp_pair(
    *, sndbuf: int = 0, rcvbuf: int = 0
) -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    """A connected (client, server) pair of trio TCP sockets on 127.0.0.1, for tests that drive
    the data path's socket layers directly. ``sndbuf`` is set on the client before it connects,
    ``rcvbuf`` on the server once accepted; the caller closes both."""
    listener = trio.socket.socket()
    client = trio.socket.socket()
    try:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        if sndbuf:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        await client.connect(listener.getsockname())
        server, _ = await listener.accept()
    except BaseException:
        client.close()
        raise
    finally:
        listener.close()
    if rcvbuf:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return client, server


def _sealed_end(
    sock: trio.socket.SocketType, sends: bytes, opens: bytes, cipher: Cipher
) -> SealedRecords:
    """One end's sealed records: sealing with one direction's secret, opening the other's."""
    return SealedRecords(
        sock,
        Sealer(sends, cipher=cipher),
        Opener(opens, cipher=cipher),
        "TLSv1.3",
        sampled_checksums=True,
    )


async def wire_pair(
    body: Callable[[WireConn, WireConn], Awaitable[None]],
    *,
    threaded: bool = False,
    rcvbuf: int = 0,
    sndbuf: int = 0,
    sealed: Cipher | None = None,
) -> None:
    """A connected sender/receiver WireConn pair over loopback TCP, HELLOs exchanged, closed
    after ``body``; ``threaded`` moves both ends' chunk payloads in data threads; ``sealed``
    carries it in sealed records with that cipher (sampled checksums, keys as an upgrade would
    derive them from two fresh shares; the TLS handshake before it is tested in test_tls_*)."""
    client, server = await loopback_tcp_pair(sndbuf=sndbuf, rcvbuf=rcvbuf)
    limits = Limits()
    tx_tls = rx_tls = None
    if sealed is not None:
        c2s, s2c = direction_secrets(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
        tx_tls = _sealed_end(client, c2s, s2c, sealed)
        rx_tls = _sealed_end(server, s2c, c2s, sealed)
    tx = WireConn(client, "sender", limits, tls=tx_tls, threaded=threaded)
    rx = WireConn(server, "receiver", limits, tls=rx_tls, threaded=threaded)
    try:
        await tx.send(Hello(PROTOCOL_VERSION, "tx", "sender", "s1", 0))
        assert isinstance(await rx.next_event(), Hello)
        await rx.send(Hello(PROTOCOL_VERSION, "rx", "receiver", "s2", 0))
        assert isinstance(await tx.next_event(), Hello)
        await body(tx, rx)
    finally:
        tx.close()
        rx.close()


def produce(
    tx: PrefillClient,
    rid: str,
    sizes: list[int],
    pause: float = 0.0,
    on_layer: object = None,
    **kw: object,
) -> None:
    """Begin ``rid`` and hand over its layers, each filled with its known pattern (``pause``
    before each, ``on_layer(i)`` after each)."""
    t = tx.begin(rid, sizes, **kw)  # type: ignore[arg-type]
    for i in range(len(sizes)):
        if pause:
            time.sleep(pause)
        buf = t.layer_buffer(i)
        fill_layer(buf, rid, i)
        del buf
        t.layer_ready(i)
        if callable(on_layer):
            on_layer(i)


def wait_live(p: Pair, n: int, timeout: float = 10) -> None:
    """Until the sender holds ``n`` live connections to its peer."""
    with PrefillClient(p.tx_sock) as tx:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            peers = tx.status()["peers"]
            if peers and next(iter(peers.values()))["live_connections"] == n:
                return
            time.sleep(0.05)
    raise AssertionError("sender never connected")


def intact(rx: DecodeClient, rid: str, timeout: float = 20) -> None:
    """``rid`` arrives, every layer holding the pattern its producer wrote."""
    req = rx.await_request(rid, timeout=timeout)
    for i, size in enumerate(req.layer_sizes):
        assert layer_digest(req.layer(i)) == expected_digest(rid, i, size), (rid, i)
    req.release()


def _unread(sock: trio.socket.SocketType) -> int:
    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    n: int = struct.unpack("i", raw)[0]
    return n


async def wait_unread(sock: trio.socket.SocketType, nbytes: int, timeout: float = 5) -> None:
    """Wait until ``nbytes`` sit unread in ``sock``'s receive queue (FIONREAD), so that one
    read can see past what it was asked for."""
    with trio.fail_after(timeout):
        while _unread(sock) < nbytes:
            await trio.sleep(0.005)


async def wait_drained(sock: trio.socket.SocketType, timeout: float = 10) -> None:
    """Wait until nothing sits unread in ``sock``'s receive queue: whoever reads it (a copy
    of the socket in another process, say) has taken every byte."""
    with trio.fail_after(timeout):
        while _unread(sock):
            await trio.sleep(0.005)


def chunk_header(payload: bytes, offset: int = 0) -> ChunkHeader:
    """The header of a CHUNK of request "r", layer 0, carrying ``payload`` at ``offset``,
    with its checksum."""
    return ChunkHeader("r", 0, offset, len(payload), chunk_checksum(payload, "r", 0, offset))
