"""Mutual TLS between real sender and receiver daemon processes on loopback.

Each bad setup is refused at the handshake with the reason in the log of the side that
refused it (and a metric labelled by it); replacing the bad end with a correct one then
carries a request intact, so a refusal never poisons the daemon that refused."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient
from xdc.transport.launcher import DaemonProcess, free_port

from tests.tls_fixtures import Pki
from tests.transport_fixtures import Pair, transfer_and_verify
from xdc.config import TlsConfig
from xdc.protocol import PROTOCOL_VERSION, Connection, Hello, Limits

OFF = TlsConfig(mode="off")


def _wait_log(d: DaemonProcess, needle: str, timeout: float = 8.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = d.log()
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{d.kind} never logged {needle!r}:\n{d.log()}")


def _transfer_intact(p: Pair, rid: str, sizes: list[int]) -> None:
    transfer_and_verify(p.tx_sock, p.rx_sock, rid, sizes, timeout=15)


def _swap_sender(p: Pair, tls: TlsConfig) -> None:
    assert p.tx is not None
    p.tx.stop()
    p.retired.append(p.tx)
    p.tx_cfg.tls = tls
    p.tx = DaemonProcess("sender", p.tx_cfg, p.workdir)
    p.tx.wait_ready()


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_mutual_tls_pair_transfers_intact(pair_factory: Callable[..., Pair], pki: Pki) -> None:
    p = pair_factory(connections=4, chunk_bytes=256 * 1024)
    p.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")
    p.tx_cfg.tls = pki.config("tx", "tx.example", allowed="rx.example")
    p.start()
    sizes = {"tls-a": [3 * 1024 * 1024 + 5] * 4, "tls-b": [5000, 0, 700_000], "tls-c": [1 << 20]}
    for rid, s in sizes.items():
        _transfer_intact(p, rid, s)
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        st, rst = tx.status(), rx.status()
        assert st["tls"] == "mutual" and rst["tls"] == "mutual"
        peer = next(iter(st["peers"].values()))
        assert peer["live_connections"] == 4
        # both ends have PyNaCl: the default negotiates AEGIS-128L sealed records (v3)
        assert peer["records"] == {"sealed/aegis-128l": 4}, peer
        assert rst["records"] == {"sealed/aegis-128l": 4}, rst
    assert p.rx is not None and "mutual TLS 1.3" in p.rx.log()


@dataclass
class Case:
    rx: Callable[[Pki], TlsConfig]
    bad_tx: Callable[[Pki], TlsConfig]
    good_tx: Callable[[Pki], TlsConfig]
    rx_reason: str  # what the receiver logs ("" = nothing TLS-specific to log)
    tx_reason: str  # what the sender logs


def _rx(k: Pki) -> TlsConfig:
    return k.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")


def _tx(k: Pki) -> TlsConfig:
    return k.config("tx-good", "tx.example")


CASES = {
    "wrong_ca": Case(
        _rx, lambda k: k.foreign_config("tx", "tx.example"), _tx, "wrong_ca", "peer_rejected_ca"
    ),
    "expired": Case(
        _rx,
        lambda k: k.config("tx", "tx.example", expired=True),
        _tx,
        "expired",
        "peer_rejected_expired",
    ),
    "not_allowed": Case(
        _rx, lambda k: k.config("tx", "intruder.example"), _tx, "not_allowed", "closed"
    ),
    "wrong_name": Case(
        _rx,
        lambda k: k.config("tx", "tx.example", server_name="xdc-rx.other-dc.example"),
        _tx,
        "peer_rejected",
        "wrong_name",
    ),
    "plain_sender_to_tls_port": Case(_rx, lambda k: OFF, _tx, "plain_tcp", ""),
    "tls_sender_to_plain_port": Case(lambda k: OFF, _tx, lambda k: OFF, "", "plain_tcp"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_peer_refused_with_reason_then_good_peer_works(
    pair_factory: Callable[..., Pair],
    pki: Pki,
    name: str,
) -> None:
    case = CASES[name]
    p = pair_factory(connections=2, chunk_bytes=256 * 1024)
    p.rx_cfg.tls = case.rx(pki)
    p.tx_cfg.tls = case.bad_tx(pki)
    status_port = p.rx_cfg.receiver.status_port = free_port()
    p.start()
    assert p.rx is not None and p.tx is not None
    if case.rx_reason:
        _wait_log(p.rx, f"refused at the TLS handshake ({case.rx_reason})")
        assert f'reason="tls_{case.rx_reason}"' in _metrics(status_port)
    if case.tx_reason:
        _wait_log(p.tx, f"refused at the TLS handshake ({case.tx_reason})")
    with PrefillClient(p.tx_sock) as tx:
        assert next(iter(tx.status()["peers"].values()))["live_connections"] == 0
    _swap_sender(p, case.good_tx(pki))
    _transfer_intact(p, f"after-{name}", [600_000, 1 << 20])


def test_plain_tcp_client_to_tls_port(pair_factory: Callable[..., Pair], pki: Pki) -> None:
    """A raw TCP client speaking the xdc protocol in the clear gets nothing but a close."""
    p = pair_factory()
    p.rx_cfg.tls = _rx(pki)
    p.start(sender=False)
    assert p.rx is not None
    with socket.create_connection(("127.0.0.1", p.rx_cfg.receiver.listen_port), timeout=5) as s:
        s.sendall(
            Connection("sender", Limits()).send(Hello(PROTOCOL_VERSION, "x", "sender", "s", 0))
        )
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
    assert not got.startswith(b"XD"), "the TLS port answered in plain xdc framing"
    _wait_log(p.rx, "refused at the TLS handshake (plain_tcp)")


def test_sealed_v2_receiver_checks_sampled_checksums_and_lets_aead_cover_the_rest(
    pair_factory: Callable[..., Pair],
    pki: Pki,
) -> None:
    """A hand-driven TLS sender against the real receiver: under ``xdc-sealed/2`` a chunk the
    sample does not pick lands with checksum 0 (its record's tag authenticated it), a sampled
    chunk with a wrong checksum is refused and asked for again, and the request completes
    intact once it is resent right."""
    import os

    import trio
    from xdc.transport.sealed_records import SealedRecords
    from xdc.transport.tls import client_handshake, load_policy
    from xdc.transport.wire import WireConn

    from xdc.protocol import Accept, Ack, Begin, ChunkHeader, Complete, Nack, chunk_checksum
    from xdc.protocol.aead_records import checksum_sampled

    p = pair_factory(connections=1, chunk_bytes=64 * 1024)
    p.rx_cfg.tls = _rx(pki)
    p.start(sender=False)
    layers = 32
    size = 64 * 1024
    sampled = [layer for layer in range(layers) if checksum_sampled(layer, 0)]
    assert sampled and len(sampled) < layers
    data = [os.urandom(size) for _ in range(layers)]
    policy = load_policy(pki.config("tx", "tx.example", allowed="rx.example"), server=False)
    assert policy is not None
    seen: list[object] = []

    async def sender() -> None:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", p.rx_cfg.receiver.listen_port))
        records = await client_handshake(sock, policy, "127.0.0.1")
        assert isinstance(records, SealedRecords) and records.sampled_checksums
        wire = WireConn(sock, "sender", Limits(), tls=records)
        try:
            await wire.send(Hello(PROTOCOL_VERSION, "hand", "sender", "hand-1", 0))
            assert isinstance(await wire.next_event(), Hello)
            await wire.send(Begin("v2", (size,) * layers, size, (), 0, 20_000))
            assert isinstance(await wire.next_event(), Accept)
            for layer in range(layers):
                view = memoryview(data[layer])
                digest = chunk_checksum(view, "v2", layer, 0) if layer in sampled else 0
                if layer == sampled[0]:
                    digest ^= 1  # wrong: must be refused
                await wire.send_chunk(ChunkHeader("v2", layer, 0, size, digest), view)
            while True:
                ev = await wire.next_event()
                seen.append(ev)
                if isinstance(ev, Nack):
                    view = memoryview(data[ev.layer])
                    good = chunk_checksum(view, "v2", ev.layer, 0)
                    await wire.send_chunk(ChunkHeader("v2", ev.layer, 0, size, good), view)
                if isinstance(ev, Complete):
                    return
        finally:
            wire.close()

    async def main() -> None:
        with trio.fail_after(20):
            await sender()

    trio.run(main)
    nacks = [ev for ev in seen if isinstance(ev, Nack)]
    assert [(n.layer, n.offset) for n in nacks] == [(sampled[0], 0)], seen
    acked = {ev.layer for ev in seen if isinstance(ev, Ack)}
    assert acked == set(range(layers))
    with DecodeClient(p.rx_sock) as rx:
        req = rx.await_request("v2", timeout=10)
        for layer in range(layers):
            assert bytes(req.layer(layer)) == data[layer], layer
        req.release()


def test_a_session_id_is_no_key_for_a_peer_with_another_certificate(
    pair_factory: Callable[..., Pair],
    pki: Pki,
) -> None:
    """Issue 26 finding 6: under mutual TLS a session is bound to the certificate names of
    its first connection. Another sender the CA vouches for (allowed too) that presents the
    real sender's session id is refused with SESSION_OWNER; the real sender carries on."""
    import trio
    from xdc.transport.tls import client_handshake, load_policy
    from xdc.transport.wire import WireConn

    from xdc.errors import ErrorCode
    from xdc.protocol import Error

    p = pair_factory(connections=2, chunk_bytes=256 * 1024)
    p.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example,tx2.example")
    p.tx_cfg.tls = pki.config("tx", "tx.example", allowed="rx.example")
    p.start()
    _transfer_intact(p, "before", [600_000])
    with PrefillClient(p.tx_sock) as tx:
        session = str(tx.status()["session"])
    other = load_policy(pki.config("tx2", "tx2.example", allowed="rx.example"), server=False)
    assert other is not None

    async def hijack() -> object:
        sock = trio.socket.socket()
        try:
            await sock.connect(("127.0.0.1", p.rx_cfg.receiver.listen_port))
            records = await client_handshake(sock, other, "127.0.0.1")
            wire = WireConn(sock, "sender", Limits(), tls=records)
            await wire.send(Hello(PROTOCOL_VERSION, "tx2", "sender", session, 0))
            with trio.fail_after(5):
                return await wire.next_event()
        finally:
            sock.close()

    answer = trio.run(hijack)
    assert isinstance(answer, Error) and answer.code == ErrorCode.SESSION_OWNER, answer
    assert "tls:tx.example" in answer.message and "tls:tx2.example" in answer.message
    _transfer_intact(p, "after", [600_000, 1 << 20])


def test_a_second_receiver_must_carry_the_tls_name_allowed_peers_gives_it(
    pair_factory: Callable[..., Pair],
    pki: Pki,
) -> None:
    """Issue 28: a request may name another decode node's receiver, and under mutual TLS that
    receiver's certificate must carry the name ``sender.allowed_peers`` gives it. Receiver b's
    certificate names only rx-b.example: allowed as ``host:port=rx-b.example`` the transfer
    lands there; allowed by address alone the sender refuses it at the handshake."""
    b = pair_factory(connections=2, chunk_bytes=256 * 1024)
    b.rx_cfg.tls = pki.config("rx-b", "rx-b.example", allowed="tx.example")
    a = pair_factory(connections=2, chunk_bytes=256 * 1024)
    a.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")
    a.tx_cfg.tls = pki.config("tx", "tx.example")
    b_addr = f"127.0.0.1:{b.rx_cfg.receiver.listen_port}"
    a.tx_cfg.sender.allowed_peers = (f"{b_addr}=rx-b.example",)
    b.start(sender=False)
    a.start()
    transfer_and_verify(a.tx_sock, b.rx_sock, "tls-to-b", [600_000, 5_000], peer=b_addr)
    transfer_and_verify(a.tx_sock, a.rx_sock, "tls-to-a", [70_000])
    a.tx_cfg.sender.allowed_peers = (b_addr,)  # no name: the sender expects 127.0.0.1
    _swap_sender(a, a.tx_cfg.tls)
    assert a.tx is not None
    with PrefillClient(a.tx_sock) as tx:
        tx.begin("tls-to-b-unnamed", [1_000], peer=b_addr)
    _wait_log(a.tx, "refused at the TLS handshake (wrong_name)")
