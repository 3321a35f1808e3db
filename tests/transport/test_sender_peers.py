"""A sender streams each request to the receiver the request names (a PD cluster has many
decode nodes, and the router picks one per request), but only to its own receiver and those
in ``sender.allowed_peers``: a request naming any other address is refused with a clear error,
and nothing connects there (issue 28)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient

from tests.transport_fixtures import Pair, transfer_and_verify
from xdc.config import SenderConfig
from xdc.errors import ResultCode, XdcError


class RecordingListener:
    """A TCP listener on loopback that counts the connections it is offered."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[RecordingListener]:
    rec = RecordingListener()
    try:
        yield rec
    finally:
        rec.close()


def _two_receivers(pair_factory: Callable[..., Pair]) -> tuple[Pair, Pair]:
    """Pair a (sender and its receiver) and pair b (a second receiver the sender may name)."""
    b = pair_factory()
    a = pair_factory()
    a.tx_cfg.sender.allowed_peers = (f"127.0.0.1:{b.rx_cfg.receiver.listen_port}",)
    b.start(sender=False)
    a.start()
    return a, b


def test_a_request_lands_on_the_receiver_it_names(pair_factory: Callable[..., Pair]) -> None:
    """Each transfer is awaited and verified at the decode side of the receiver it named."""
    a, b = _two_receivers(pair_factory)
    b_addr = f"127.0.0.1:{b.rx_cfg.receiver.listen_port}"
    transfer_and_verify(a.tx_sock, a.rx_sock, "to-a", [70_000, 5_000])
    transfer_and_verify(a.tx_sock, b.rx_sock, "to-b", [70_000, 5_000], peer=b_addr)
    transfer_and_verify(a.tx_sock, a.rx_sock, "to-a-again", [1_000], peer=None)
    with PrefillClient(a.tx_sock) as tx:
        peers = tx.status()["peers"]
    assert b_addr in str(peers), peers


def test_a_request_naming_a_peer_not_allowed_is_refused_and_nothing_connects(
    pair_factory: Callable[..., Pair], listener: RecordingListener
) -> None:
    a, _ = _two_receivers(pair_factory)
    with PrefillClient(a.tx_sock) as tx:
        with pytest.raises(XdcError) as e:
            tx.begin("stray", [1_000], peer=f"127.0.0.1:{listener.port}")
        assert getattr(e.value, "code", None) == ResultCode.BAD_REQUEST
        assert "sender.allowed_peers" in str(e.value)
        # the same host on the configured port's neighbour: still refused
        with pytest.raises(XdcError):
            tx.begin("stray2", [1_000], peer=f"localhost:{a.rx_cfg.receiver.listen_port}")
    time.sleep(1.0)  # a window for a dial in the background (nothing to observe instead)
    assert listener.accepted == 0
    transfer_and_verify(a.tx_sock, a.rx_sock, "still-fine", [4_000])  # the daemon goes on


def test_admission_says_at_once_which_requests_could_not_be_shipped(
    pair_factory: Callable[..., Pair], listener: RecordingListener
) -> None:
    """``admit`` is what a prefill engine's scheduler asks before computing a request for a
    remote decode: yes for the sender's receivers; ``peer_refused`` for an address it may
    not ship to (and nothing connects there); ``peer_unreachable`` once an allowed receiver
    has had no connection for a second while connecting failed; yes again when it is back."""
    a, b = _two_receivers(pair_factory)
    b_addr = f"127.0.0.1:{b.rx_cfg.receiver.listen_port}"
    with PrefillClient(a.tx_sock) as tx:
        assert tx.admit().ok and tx.admit(f"127.0.0.1:{a.rx_cfg.receiver.listen_port}").ok
        assert tx.admit(b_addr).ok
        stray = tx.admit(f"127.0.0.1:{listener.port}")
        assert (stray.ok, stray.reason) == (False, "peer_refused"), stray
        assert "sender.allowed_peers" in stray.why
        assert b.rx is not None
        b.rx.kill()  # node b's receiver goes away
        b.retired.append(b.rx)
        deadline = time.monotonic() + 10
        while (a_b := tx.admit(b_addr)).ok:
            assert time.monotonic() < deadline, "the dead receiver was never reported"
            time.sleep(0.1)
        assert a_b.reason == "peer_unreachable" and b_addr in a_b.why, a_b
        assert tx.admit().ok  # the other receiver is fine
        b.start(sender=False)  # back on the same port
        deadline = time.monotonic() + 15
        while not tx.admit(b_addr).ok:
            assert time.monotonic() < deadline, "the receiver came back but stays refused"
            time.sleep(0.1)
    assert listener.accepted == 0
    transfer_and_verify(a.tx_sock, b.rx_sock, "b-again", [4_000], peer=b_addr)


@pytest.mark.parametrize(
    "value",
    ["nohost", "h:0", "h:70000", ":7000", "h:7000=", "h:x"],
)
def test_bad_allowed_peers_are_a_clear_config_error(value: str) -> None:
    problems: list[str] = []
    SenderConfig(allowed_peers=(value,)).validate(problems)
    assert problems and "sender.allowed_peers" in problems[0], problems
    ok: list[str] = []
    SenderConfig(allowed_peers=("10.0.0.2:7400", "pd-b.example:7400=rx-b.example")).validate(ok)
    assert ok == []
    assert SenderConfig(allowed_peers=("h:1=n", "g:2")).allowed_peer_names() == {
        ("h", 1): "n",
        ("g", 2): None,
    }


@pytest.mark.parametrize("value", ["nohost", "h:0", "h:70000", ":7000", "h:x"])
def test_bad_extra_addresses_are_a_clear_config_error(value: str) -> None:
    problems: list[str] = []
    SenderConfig(peer_extra_addresses=("10.0.0.9:7070", value)).validate(problems)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"sender.peer_extra_addresses: {value!r} is not host:port")
    cfg = SenderConfig(peer_extra_addresses=("10.0.0.9:7070", "rx-b:7071"))
    assert cfg.extra_addresses() == (("10.0.0.9", 7070), ("rx-b", 7071))


def test_one_receiver_named_twice_is_two_sessions_not_one_connection_reopened(
    pair_factory: Callable[..., Pair],
) -> None:
    """A receiver closes a connection when its sender opens the same connection number of
    the same session again (the sender gave the old one up). Two links of one sender to one
    receiver under two names (its address and ``localhost``) must not look like that: each
    link HELLOs with a session of its own, so neither closes the other's connections."""
    p = pair_factory()
    port = p.rx_cfg.receiver.listen_port
    p.tx_cfg.sender.allowed_peers = (f"localhost:{port}",)
    p.start()
    for i in range(3):
        transfer_and_verify(p.tx_sock, p.rx_sock, f"by-address-{i}", [70_000, 5_000])
        transfer_and_verify(
            p.tx_sock, p.rx_sock, f"by-name-{i}", [70_000, 5_000], peer=f"localhost:{port}"
        )
    time.sleep(1.0)  # reconnects, had the links been closing each other's connections
    with PrefillClient(p.tx_sock) as tx:
        peers = tx.status()["peers"]
    conns = p.tx_cfg.sender.connections
    assert len(peers) == 2, peers
    assert len({peer["session"] for peer in peers.values()}) == 2, peers
    for name, peer in peers.items():
        assert peer["connects"] == conns, (name, peer)
        assert peer["live_connections"] == conns, (name, peer)
    with DecodeClient(p.rx_sock) as rx:
        assert rx.status()["superseded_connections"] == 0
