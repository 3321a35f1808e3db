"""The ports the lab picks for servers that bind later (daemons, toxiproxy, vLLM, redis)."""

from __future__ import annotations

import socket
from pathlib import Path

from xdc.transport.launcher import SERVER_PORTS_FROM, free_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_a_server_port_lies_below_the_range_outgoing_connections_draw_from() -> None:
    """A port from the ephemeral range can be taken by any outgoing connection before a slow
    server (vLLM: seconds of imports) binds it; one below the range cannot."""
    low, _high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(SERVER_PORTS_FROM <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not one fixed port every test would share


def test_a_server_port_is_one_a_listener_can_bind_now() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            assert c.getpeername()[1] == port


def test_a_port_someone_listens_on_is_never_picked() -> None:
    """Hold every port but a few listened on, and the picker must skip them: bound here are
    the ports it returns, one after the other, until it has given 30 different ones."""
    held: list[socket.socket] = []
    try:
        for _ in range(30):
            port = free_port()
            s = socket.socket()
            s.bind(("127.0.0.1", port))  # raises if the picker handed out a held port
            s.listen()
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == 30
    finally:
        for s in held:
            s.close()
