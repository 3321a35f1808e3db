"""A chunk the receiver declines for now (NACK with ``retry_after_ms``: no scratch buffer
free) is resent no sooner than asked, and later each time it is declined again, while the
rest of the request flows on; a NACK without it (bytes wrong) is resent at once.

The receiver here is a script speaking the wire protocol through the sans-IO ``Connection``
over a real socket, so each decline and each resend's arrival are timed exactly; the sender is
the real daemon."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from xdc.transport.engine_client import PrefillClient

from tests.transport_fixtures import PairFactory
from xdc.lab.synthetic import fill_layer
from xdc.protocol import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Begin,
    ChunkHeader,
    Connection,
    Hello,
    Limits,
    Nack,
    Ping,
    Pong,
    chunk_checksum,
)

CHUNK = 64 * 1024
LAYERS = [4 * CHUNK, 4 * CHUNK]
DECLINES = 4  # times the receiver declines the first chunk as busy
RETRY_MS = 50


@dataclass
class ScriptedReceiver:
    """Accepts one sender connection; declines chunk (0, 0) of each request ``declines``
    times (``retry_ms`` > 0: busy, for now; 0: checksum), acks every other verified chunk."""

    declines: int
    retry_ms: int
    listener: socket.socket = field(default_factory=socket.socket)
    arrivals: list[float] = field(default_factory=list)  # of chunk (0, 0), each send
    acked: set[tuple[int, int]] = field(default_factory=set)
    bad: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.listener.settimeout(20)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            s, _ = self.listener.accept()
        except OSError as e:
            self.bad.append(f"no sender connected: {e}")
            return
        with s:
            s.settimeout(20)
            try:
                self._serve(s)
            except Exception as e:  # any failure of the script fails the test
                if not self.done.is_set():
                    self.bad.append(f"scripted receiver: {e!r}")

    def _serve(self, s: socket.socket) -> None:
        conn = Connection("receiver", Limits())
        declined = 0
        hdr: ChunkHeader | None = None
        payload = bytearray()
        total = sum(LAYERS) // CHUNK
        while not self.done.is_set():
            ev = conn.next_event()
            if ev is NEED_DATA or (ev is PAYLOAD and not conn.payload_buffered):
                conn.receive_data(s.recv(1 << 20))
                continue
            if ev is CLOSED:
                return
            if ev is PAYLOAD:
                assert hdr is not None
                buf = bytearray(conn.payload_buffered)
                conn.take_buffered_payload(memoryview(buf))
                payload += buf
                if len(payload) < hdr.length:
                    continue
                cell = (hdr.layer, hdr.offset)
                if cell == (0, 0):
                    self.arrivals.append(time.monotonic())
                if chunk_checksum(payload, hdr.rid, hdr.layer, hdr.offset) != hdr.checksum:
                    self.bad.append(f"chunk {cell} arrived corrupted")
                if cell == (0, 0) and declined < self.declines:
                    declined += 1
                    reason = "receiver busy: no scratch buffer free" if self.retry_ms else "bad"
                    s.sendall(conn.send(Nack(hdr.rid, 0, 0, reason, self.retry_ms)))
                else:
                    self.acked.add(cell)
                    s.sendall(conn.send(Ack(hdr.rid, hdr.layer, hdr.offset)))
                    if len(self.acked) == total:
                        self.done.set()
                hdr, payload = None, bytearray()
            elif isinstance(ev, Hello):
                s.sendall(conn.send(Hello(PROTOCOL_VERSION, "scripted", "receiver", "s1", 0)))
            elif isinstance(ev, Begin):
                s.sendall(conn.send(Accept(ev.rid)))
            elif isinstance(ev, ChunkHeader):
                hdr = ev
            elif isinstance(ev, Ping):
                s.sendall(conn.send(Pong(ev.nonce)))

    def close(self) -> None:
        self.done.set()
        self.listener.close()
        self.thread.join(10)


def _send_through(pair_factory: PairFactory, rx: ScriptedReceiver, rid: str) -> int:
    """Send one request through the real sender to ``rx``; the most chunks its status
    showed deferred meanwhile."""
    p = pair_factory(connections=1, chunk_bytes=CHUNK)
    p.tx_cfg.sender.peer_port = rx.port
    p.start(receiver=False)
    deferred = 0
    with PrefillClient(p.tx_sock) as tx, PrefillClient(p.tx_sock) as watch:
        t = tx.begin(rid, LAYERS)
        for i in range(len(LAYERS)):
            buf = t.layer_buffer(i)
            fill_layer(buf, rid, i)
            del buf
            t.layer_ready(i)
        deadline = time.monotonic() + 20
        while not rx.done.is_set() and time.monotonic() < deadline:
            (peer,) = watch.status()["peers"].values()
            deferred = max(deferred, peer["deferred_chunks"])
            time.sleep(0.02)
        outcome = t.wait(20)
        assert outcome.ok, (outcome, rx.bad, p.logs())
        assert outcome.resent_chunks == rx.declines, outcome
    assert not rx.bad, rx.bad
    return deferred


def test_a_chunk_declined_as_busy_waits_longer_before_each_resend(
    pair_factory: PairFactory,
) -> None:
    rx = ScriptedReceiver(DECLINES, RETRY_MS)
    try:
        deferred = _send_through(pair_factory, rx, "busy")
        assert deferred == 1  # the sender's status shows the chunk while it waits
        assert len(rx.arrivals) == DECLINES + 1, rx.arrivals
        gaps = [b - a for a, b in zip(rx.arrivals, rx.arrivals[1:], strict=False)]
        for i, gap in enumerate(gaps):  # the hint, doubled for each earlier decline
            assert gap >= RETRY_MS / 1e3 * 2**i * 0.95, (i, gaps)
        assert len(rx.acked) == sum(LAYERS) // CHUNK  # every other chunk flowed meanwhile
    finally:
        rx.close()


def test_a_chunk_nacked_for_wrong_bytes_is_resent_at_once(pair_factory: PairFactory) -> None:
    rx = ScriptedReceiver(DECLINES, 0)
    try:
        assert _send_through(pair_factory, rx, "corrupt") == 0
        assert len(rx.arrivals) == DECLINES + 1, rx.arrivals
        gaps = [b - a for a, b in zip(rx.arrivals, rx.arrivals[1:], strict=False)]
        assert max(gaps) < RETRY_MS / 1e3, gaps  # no backoff: the bytes were wrong, not late
    finally:
        rx.close()
