"""Mutual TLS: config validation, identity checks, and real TLS 1.3 handshakes between real
loopback sockets in one process (certificates from trustme CAs). Each refusal must carry the
reason an operator needs; a correct pair must carry frames and payloads intact."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from xdc.transport.sealed_records import SealedRecords
from xdc.transport.tls import (
    DataRecords,
    RefusalLog,
    TlsPolicy,
    TlsRefused,
    check_allowed,
    classify,
    client_handshake,
    load_policy,
    peer_identities,
    server_handshake,
)
from xdc.transport.tls_records import TlsRecords
from xdc.transport.wire import PeerClosed, WireConn

from tests.tls_fixtures import Pki
from xdc.config import ConfigError, TlsConfig, load_config
from xdc.protocol import PROTOCOL_VERSION, ChunkHeader, Hello, Limits, chunk_checksum
from xdc.protocol.aead_records import HEADER as SEALED_HEADER
from xdc.protocol.aead_records import Cipher, SealedError, checksum_sampled

# --- a deployment's PKI, made with trustme ------------------------------------------------


# --- config --------------------------------------------------------------------------------


def test_mutual_is_the_default_and_missing_files_name_their_fields(tmp_path: Path) -> None:
    cfg = load_config(None, env={})  # processes without data links still load a config
    assert cfg.tls.mode == "mutual"
    with pytest.raises(ConfigError) as e:
        load_policy(cfg.tls, server=True)
    text = "\n".join(e.value.problems)
    for name in ("tls.ca_file", "tls.cert_file", "tls.key_file"):
        assert name in text, text
    # naming some files but not all, or files that do not exist, fails at load time already
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            env={},
            overrides={"tls.ca_file": str(tmp_path / "nope.pem"), "tls.mode": "mutual"},
        )
    text = "\n".join(e.value.problems)
    assert "tls.ca_file" in text and "no such file" in text
    assert "tls.cert_file" in text and "tls.key_file" in text
    with pytest.raises(ConfigError) as e:
        load_config(None, env={}, overrides={"tls.mode": "optional"})
    assert "tls.mode" in str(e.value)
    assert (
        load_policy(load_config(None, env={}, overrides={"tls.mode": "off"}).tls, server=True)
        is None
    )


def test_daemon_refuses_to_start_without_tls_files(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "receiver", "--control-socket", str(tmp_path / "rx.sock")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2, r
    assert "tls.ca_file" in r.stderr and 'tls.mode = "off"' in r.stderr, r.stderr
    assert not (tmp_path / "rx.sock").exists()


def test_key_that_does_not_match_the_certificate(pki: Pki) -> None:
    cert_a, _ = pki.leaf("a", "a.example")
    _, key_b = pki.leaf("b", "b.example")
    with pytest.raises(ConfigError) as e:
        load_policy(TlsConfig("mutual", pki.ca_file, cert_a, key_b), server=False)
    assert "tls.cert_file/tls.key_file" in str(e.value)


def test_policy_is_tls13_only_and_requires_certificates(pki: Pki) -> None:
    for server in (True, False):
        policy = load_policy(pki.config("x", "x.example"), server=server)
        assert policy is not None
        assert policy.context.minimum_version is ssl.TLSVersion.TLSv1_3
        assert policy.context.verify_mode is ssl.CERT_REQUIRED
        assert policy.context.check_hostname is not server


# --- identities (pure) ---------------------------------------------------------------------


def test_identities_from_san_and_cn() -> None:
    cert = {
        "subject": ((("organizationName", "xdc"),), (("commonName", "rx-cn"),)),
        "subjectAltName": (("DNS", "rx.example"), ("IP Address", "10.0.0.1")),
    }
    assert peer_identities(cert) == {"rx-cn", "rx.example"}
    check_allowed(cert, frozenset())  # empty list: anyone the CA vouches for
    check_allowed(cert, frozenset({"other", "rx.example"}))
    check_allowed(cert, frozenset({"rx-cn"}))
    with pytest.raises(TlsRefused) as e:
        check_allowed(cert, frozenset({"tx.example"}))
    assert e.value.reason == "not_allowed" and "rx.example" in str(e.value)
    with pytest.raises(TlsRefused):
        check_allowed(None, frozenset({"10.0.0.1"}))  # IP SANs are not identities here


def test_refusal_log_keeps_retries_from_flooding_the_log() -> None:
    rl = RefusalLog(interval_s=30.0, max_keys=2)
    assert rl.admit("10.0.0.1", "wrong_ca", 0.0) == 0  # first: logged
    assert rl.admit("10.0.0.1", "wrong_ca", 1.0) is None  # retries: quiet
    assert rl.admit("10.0.0.1", "wrong_ca", 2.0) is None
    assert rl.admit("10.0.0.1", "expired", 2.0) == 0  # another reason is news
    assert rl.admit("10.0.0.1", "wrong_ca", 31.0) == 2  # logged again, with the count
    assert rl.admit("10.0.0.2", "wrong_ca", 31.0) == 0  # bounded: evicts the oldest key
    assert len(rl._last) == 2


# --- real handshakes between two loopback sockets ------------------------------------------


@dataclass
class Outcome:
    server: DataRecords | TlsRefused | None = None
    client: DataRecords | trio.SSLStream[trio.SocketStream] | TlsRefused | None = None
    server_wire: WireConn | None = None
    client_wire: WireConn | None = None
    first_read: TlsRefused | None = None  # the client's view of a late server refusal

    def client_refusal(self) -> TlsRefused | None:
        """How the client learnt it was refused: with sealed records at the handshake (it
        reads the receiver's key share), with TLS records on its first read."""
        if isinstance(self.client, TlsRefused):
            return self.client
        return self.first_read


async def _handshake_pair(
    server: TlsPolicy,
    client: TlsPolicy | ssl.SSLContext | bytes,
    host: str = "127.0.0.1",
    then: object = None,
) -> Outcome:
    """Run server_handshake and client_handshake on a real TCP connection. ``client`` may
    be a raw SSLContext (a misbehaving client) or bytes (a plain-TCP client)."""
    out = Outcome()
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    csock = trio.socket.socket()

    async def serve() -> None:
        sock, _ = await listener.accept()
        try:
            out.server = await server_handshake(sock, server)
            out.server_wire = WireConn(sock, "receiver", Limits(), tls=out.server)
        except TlsRefused as e:
            out.server = e
            sock.close()

    async def connect() -> None:
        await csock.connect(listener.getsockname())
        if isinstance(client, bytes):
            await csock.send(client)
            return
        if isinstance(client, ssl.SSLContext):
            stream = trio.SSLStream(trio.SocketStream(csock), client, server_hostname=host)
            try:
                await stream.do_handshake()
                out.client = stream
            except trio.BrokenResourceError as e:
                out.client = TlsRefused("client", repr(e))
            return
        try:
            out.client = await client_handshake(csock, client, host)
            out.client_wire = WireConn(csock, "sender", Limits(), tls=out.client)
        except TlsRefused as e:
            out.client = e
            csock.close()  # as the sender does: the server sees the end of the handshake

    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(serve)
            n.start_soon(connect)
        if callable(then):
            await then(out)
        elif out.client_wire is not None and isinstance(out.server, TlsRefused):
            # TLS 1.3: the client learns of the server's refusal on its first read
            try:
                await out.client_wire.send(Hello(PROTOCOL_VERSION, "tx", "sender", "s", 0))
                await out.client_wire.next_event()
            except Exception as e:  # whatever it is, classify() names it
                out.first_read = classify(e)
    listener.close()
    csock.close()
    return out


def _policy(cfg: TlsConfig, *, server: bool) -> TlsPolicy:
    p = load_policy(cfg, server=server)
    assert p is not None
    return p


@pytest.mark.parametrize("layer", ["sealed", "tls"])
def test_correct_pair_carries_frames_and_payload_intact(pki: Pki, layer: str) -> None:
    server = _policy(
        pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example", record_layer=layer),
        server=True,
    )
    client = _policy(
        pki.config("tx", "tx.example", allowed="rx.example", record_layer=layer), server=False
    )
    payload = os.urandom(3 * (1 << 20) + 17)
    got = bytearray(len(payload))

    async def exchange(out: Outcome) -> None:
        tx, rx = out.client_wire, out.server_wire
        assert tx is not None and rx is not None, out
        assert tx.tls is not None and tx.tls.version() == "TLSv1.3"
        assert tx.tls.record_layer == rx.tls.record_layer == layer  # type: ignore[union-attr]
        # the monitor reads TCP_INFO from .sock: it must stay the TCP socket
        assert tx.sock.type == trio.socket.SOCK_STREAM and tx.sock.family == trio.socket.AF_INET
        await tx.send(Hello(PROTOCOL_VERSION, "tx", "sender", "s1", 0))
        hello = await rx.next_event()
        assert isinstance(hello, Hello) and hello.peer_id == "tx"
        await rx.send(Hello(PROTOCOL_VERSION, "rx", "receiver", "s2", 0))
        assert isinstance(await tx.next_event(), Hello)
        view = memoryview(payload)
        hdr = ChunkHeader("r", 0, 0, len(payload), chunk_checksum(view, "r", 0, 0))

        async def send() -> None:
            await tx.send_chunk(hdr, view)

        async with trio.open_nursery() as n:
            n.start_soon(send)
            ev = await rx.next_event()
            assert isinstance(ev, ChunkHeader) and ev.length == len(payload)
            assert await rx.read_payload(memoryview(got))
        assert chunk_checksum(memoryview(got), "r", 0, 0) == ev.checksum
        tx.close()
        rx.close()

    out = trio.run(_handshake_pair, server, client, "127.0.0.1", exchange)
    assert not isinstance(out.server, TlsRefused) and not isinstance(out.client, TlsRefused)
    assert bytes(got) == payload


@pytest.mark.parametrize("layer", ["sealed", "tls"])
def test_large_writes_both_ways_at_once_arrive_intact(pki: Pki, layer: str) -> None:
    """2 MiB writes both ways at the same time (each side reading while it writes), decrypted
    straight into place; reads of odd sizes cut records (sealed: 1 MiB) in the middle."""
    server = _policy(
        pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example", record_layer=layer),
        server=True,
    )
    client = _policy(
        pki.config("tx", "tx.example", allowed="rx.example", record_layer=layer), server=False
    )
    payloads = [os.urandom(2 * (1 << 20) + i * 4099) for i in range(4)]
    want = sum(len(p) for p in payloads)
    received: dict[str, bytearray] = {}

    async def exchange(out: Outcome) -> None:
        assert out.client_wire is not None and out.server_wire is not None, out
        ends = {"tx": out.client_wire.tls, "rx": out.server_wire.tls}

        async def send_all(name: str) -> None:
            end = ends[name]
            assert end is not None
            for p in payloads:
                assert await end.send_all([memoryview(p)]) == len(p)

        async def read_all(name: str) -> None:
            end = ends[name]
            assert end is not None
            buf = received.setdefault(name, bytearray(want))
            view, got = memoryview(buf), 0
            while got < want:
                n = await end.recv_into(view[got : got + (3 << 20) - 7777 * (got % 3)])
                assert n > 0
                got += n

        async with trio.open_nursery() as n:
            for name in ends:
                n.start_soon(send_all, name)
                n.start_soon(read_all, name)
        out.client_wire.close()
        out.server_wire.close()

    trio.run(_handshake_pair, server, client, "127.0.0.1", exchange)
    assert received["tx"] == received["rx"] == b"".join(payloads)


def _forgeries(layer: str) -> list[tuple[str, bytes, type[Exception]]]:
    """Bytes a hostile peer writes around the record layer: (name, bytes, expected cause)."""
    if layer == "tls":
        # an application-data record: right framing, wrong tag
        return [("bad tag", b"\x17\x03\x03\x00\x40" + os.urandom(0x40), ssl.SSLError)]
    return [
        ("bad tag", SEALED_HEADER.pack(64 + 16) + os.urandom(80), SealedError),
        ("oversized length", SEALED_HEADER.pack(0xFFFFFFFF), SealedError),
        ("empty record", SEALED_HEADER.pack(16) + os.urandom(16), SealedError),
        ("cut short", SEALED_HEADER.pack(4096 + 16) + os.urandom(100), SealedError),
    ]


@pytest.mark.parametrize("layer", ["sealed", "tls"])
def test_a_forged_record_fails_the_connection_and_delivers_nothing(pki: Pki, layer: str) -> None:
    for name, forged, cause in _forgeries(layer):
        server = _policy(
            pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example", record_layer=layer),
            server=True,
        )
        client = _policy(
            pki.config("tx", "tx.example", allowed="rx.example", record_layer=layer), server=False
        )
        seen: list[object] = []

        async def exchange(
            out: Outcome,
            forged: bytes = forged,
            cause: type = cause,
            name: str = name,
            seen: list[object] = seen,
        ) -> None:
            tx, rx = out.client_wire, out.server_wire
            assert tx is not None and rx is not None, out
            await tx.send(Hello(PROTOCOL_VERSION, "tx", "sender", "s1", 0))
            assert isinstance(await rx.next_event(), Hello)
            await tx.sock.send(forged)
            tx.sock.shutdown(trio.socket.SHUT_WR)  # "cut short" ends inside its record
            with pytest.raises(PeerClosed) as e:
                seen.append(await rx.next_event())
            assert isinstance(e.value.__cause__, cause), (name, e.value)
            tx.close()
            rx.close()

        trio.run(_handshake_pair, server, client, "127.0.0.1", exchange)
        assert seen == [], name


async def _hellos_then_close(tx: WireConn, rx: WireConn) -> None:
    """A frame each way (sealed at one end, opened at the other), then both closed."""
    await tx.send(Hello(PROTOCOL_VERSION, "tx", "sender", "s1", 0))
    assert isinstance(await rx.next_event(), Hello)
    await rx.send(Hello(PROTOCOL_VERSION, "rx", "receiver", "s2", 0))
    assert isinstance(await tx.next_event(), Hello)
    tx.close()
    rx.close()


def _sampled() -> tuple[int, int]:
    return next((layer, 0) for layer in range(1000) if checksum_sampled(layer, 0))


def _unsampled() -> tuple[int, int]:
    return next((layer, 0) for layer in range(1000) if not checksum_sampled(layer, 0))


def test_sealed_records_need_both_ends_and_old_peers_keep_tls_records(pki: Pki) -> None:
    """ALPN decides inside the handshake: sealed only when both ends ask for it."""
    for rx_layer, tx_layer, want in [
        ("sealed", "sealed", "sealed"),
        ("sealed", "tls", "tls"),
        ("tls", "sealed", "tls"),
    ]:
        server = _policy(pki.config("rx", "127.0.0.1", record_layer=rx_layer), server=True)
        client = _policy(pki.config("tx", "tx.example", record_layer=tx_layer), server=False)

        async def check(out: Outcome, want: str = want) -> None:
            tx, rx = out.client_wire, out.server_wire
            assert tx is not None and rx is not None, out
            assert tx.tls is not None and rx.tls is not None
            assert tx.tls.record_layer == rx.tls.record_layer == want
            if want == "sealed":  # both know xdc-sealed/2: sampled chunk checksums
                assert isinstance(tx.tls, SealedRecords) and isinstance(rx.tls, SealedRecords)
                assert tx.tls.sampled_checksums and rx.tls.sampled_checksums
                assert not tx.checksummed(*_unsampled()) and tx.checksummed(*_sampled())
            await _hellos_then_close(tx, rx)

        trio.run(_handshake_pair, server, client, "127.0.0.1", check)
    # an xdc that knows only xdc-sealed/1 keeps sealed records with every chunk checksummed
    server = _policy(pki.config("rx", "127.0.0.1"), server=True)
    v1 = _policy(pki.config("tx", "tx.example"), server=False)
    v1.context.set_alpn_protocols(["xdc-sealed/1", "xdc/1"])

    async def check_v1(out: Outcome) -> None:
        tx, rx = out.client_wire, out.server_wire
        assert tx is not None and rx is not None, out
        assert isinstance(rx.tls, SealedRecords) and not rx.tls.sampled_checksums
        assert rx.checksummed(*_unsampled()) and rx.checksummed(*_sampled())
        tx.close()
        rx.close()

    trio.run(_handshake_pair, server, v1, "127.0.0.1", check_v1)
    # a client that offers no ALPN at all (an xdc from before sealed records) gets TLS records
    server = _policy(pki.config("rx", "127.0.0.1"), server=True)
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(pki.ca_file)
    old.load_cert_chain(*pki.leaf("tx", "tx.example"))
    out = trio.run(_handshake_pair, server, old)
    assert isinstance(out.server, TlsRecords), out
    assert out.server.record_layer == "tls"


def test_sealed_records_use_aegis_where_both_ends_allow_it_else_aes_gcm(pki: Pki) -> None:
    """The cipher is chosen by ALPN too: AEGIS-128L (xdc-sealed/3) only when both ends offer
    it; an end that allows only AES-GCM gets xdc-sealed/2; an AEGIS-only end and an
    AES-GCM-only end share no sealed version and keep TLS records. Either way a record sealed
    at one end opens at the other (the HELLOs below)."""
    for rx_cipher, tx_cipher, want in [
        ("auto", "auto", Cipher.AEGIS_128L),
        ("aegis-128l", "auto", Cipher.AEGIS_128L),
        ("auto", "aes-128-gcm", Cipher.AES_128_GCM),
        ("aes-128-gcm", "auto", Cipher.AES_128_GCM),
        ("aegis-128l", "aes-128-gcm", None),
    ]:
        server = _policy(pki.config("rx", "127.0.0.1", record_cipher=rx_cipher), server=True)
        client = _policy(pki.config("tx", "tx.example", record_cipher=tx_cipher), server=False)

        async def check(out: Outcome, want: Cipher | None = want) -> None:
            tx, rx = out.client_wire, out.server_wire
            assert tx is not None and rx is not None, out
            if want is None:
                assert isinstance(tx.tls, TlsRecords) and isinstance(rx.tls, TlsRecords)
            else:
                assert isinstance(tx.tls, SealedRecords) and isinstance(rx.tls, SealedRecords)
                assert tx.tls.sealer.cipher is rx.tls.opener.cipher is want
                assert rx.tls.sealer.cipher is tx.tls.opener.cipher is want
                assert tx.tls.sampled_checksums and rx.tls.sampled_checksums
            await _hellos_then_close(tx, rx)

        trio.run(_handshake_pair, server, client, "127.0.0.1", check)


@pytest.mark.parametrize(
    ("case", "server_reason", "client_reason"),
    [
        ("wrong_ca", "wrong_ca", "peer_rejected_ca"),
        ("expired", "expired", "peer_rejected_expired"),
        ("not_allowed", "not_allowed", "closed"),
    ],
)
@pytest.mark.parametrize("layer", ["sealed", "tls"])
def test_receiver_refuses_bad_client_certificates(
    pki: Pki, case: str, server_reason: str, client_reason: str, layer: str
) -> None:
    server = _policy(
        pki.config("rx", "127.0.0.1", allowed="tx.example", record_layer=layer), server=True
    )
    bad = {
        "wrong_ca": lambda: pki.foreign_config("tx", "tx.example"),
        "expired": lambda: pki.config("tx", "tx.example", expired=True),
        "not_allowed": lambda: pki.config("tx", "intruder.example"),
    }[case]()
    bad.record_layer = layer
    out = trio.run(_handshake_pair, server, _policy(bad, server=False))
    assert isinstance(out.server, TlsRefused), out
    assert out.server.reason == server_reason, out.server
    refusal = out.client_refusal()
    assert refusal is not None and refusal.reason == client_reason, out


@pytest.mark.parametrize(
    ("case", "reason", "server_reason"),
    [
        ("wrong_ca", "wrong_ca", "peer_rejected_ca"),
        ("expired", "expired", "peer_rejected_expired"),
        ("wrong_name", "wrong_name", "peer_rejected"),
    ],
)
def test_sender_refuses_bad_receiver_certificates(
    pki: Pki, case: str, reason: str, server_reason: str
) -> None:
    rx_cfg = {
        "wrong_ca": lambda: pki.foreign_config("rx", "rx.example"),
        "expired": lambda: pki.config("rx", "rx.example", expired=True),
        "wrong_name": lambda: pki.config("rx", "other.example"),
    }[case]()
    rx_cfg.ca_file = pki.ca_file
    # the foreign-CA receiver must still trust our client cert, so only the client judges
    if case == "wrong_ca":
        both = pki.root / "both.pem"
        both.write_bytes(pki.ca.cert_pem.bytes() + pki.foreign.cert_pem.bytes())
        rx_cfg.ca_file = str(both)
    client = _policy(pki.config("tx", "tx.example", server_name="rx.example"), server=False)
    out = trio.run(_handshake_pair, _policy(rx_cfg, server=True), client)
    assert isinstance(out.client, TlsRefused), out
    assert out.client.reason == reason, out.client
    # the alert tells the receiver that it was refused, not just that the peer hung up
    assert isinstance(out.server, TlsRefused) and out.server.reason == server_reason, out


def test_plain_tcp_and_old_tls_and_missing_client_cert_refused(pki: Pki) -> None:
    server = _policy(pki.config("rx", "127.0.0.1"), server=True)
    from xdc.protocol import Connection

    hello = Connection("sender", Limits()).send(Hello(PROTOCOL_VERSION, "tx", "sender", "s", 0))
    out = trio.run(_handshake_pair, server, hello)
    assert isinstance(out.server, TlsRefused) and out.server.reason == "plain_tcp", out.server

    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    old.load_verify_locations(pki.ca_file)
    cert, key = pki.leaf("tx", "tx.example")
    old.load_cert_chain(cert, key)
    out = trio.run(_handshake_pair, server, old)
    assert isinstance(out.server, TlsRefused) and out.server.reason == "tls_version", out.server

    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.load_verify_locations(pki.ca_file)

    async def probe(o: Outcome) -> None:
        # the client thinks it is done; the server has refused it for lack of a certificate
        assert isinstance(o.client, trio.SSLStream)
        with pytest.raises(trio.BrokenResourceError):
            await o.client.receive_some(1)

    out = trio.run(_handshake_pair, server, anonymous, "127.0.0.1", probe)
    assert isinstance(out.server, TlsRefused) and out.server.reason == "no_certificate", out.server


@pytest.mark.parametrize(
    ("share", "close", "reason"),
    [
        (b"k" * 64, False, "sealed_setup"),  # more than a share: TLS data left in the record
        (b"k" * 10, True, "closed"),  # gone before its share was complete
    ],
)
def test_sealed_setup_refuses_a_bad_key_share(
    pki: Pki, share: bytes, close: bool, reason: str
) -> None:
    """A client that negotiates sealed records and then sends a wrong key share is refused
    with a reason; the receiver never reads frames from it."""
    server = _policy(pki.config("rx", "127.0.0.1"), server=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.ca_file)
    ctx.load_cert_chain(*pki.leaf("tx", "tx.example"))
    ctx.set_alpn_protocols(["xdc-sealed/1"])
    refused: list[TlsRefused] = []

    async def main() -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        csock = trio.socket.socket()

        async def serve() -> None:
            sock, _ = await listener.accept()
            with pytest.raises(TlsRefused) as e:
                await server_handshake(sock, server)
            refused.append(e.value)
            sock.close()

        async def bad_client() -> None:
            await csock.connect(listener.getsockname())
            stream = trio.SSLStream(trio.SocketStream(csock), ctx, server_hostname="127.0.0.1")
            await stream.do_handshake()
            assert stream.selected_alpn_protocol() == "xdc-sealed/1"
            await stream.send_all(share)
            if close:
                csock.close()

        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(serve)
                n.start_soon(bad_client)
        csock.close()
        listener.close()

    trio.run(main)
    assert [r.reason for r in refused] == [reason], refused
