"""The engine-facing Unix sockets: owner-only file permissions keep other users out, and
SO_PEERCRED keeps them out even when someone loosens those permissions. The other user is a
real one: a forked child that drops to uid 65534 (nobody) before it connects."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from xdc.transport.engine_socket import (
    ControlError,
    engine_uids,
    recv_blocking,
    send_blocking,
)

from tests.transport_fixtures import Pair
from xdc.protocol.engine_control import EngineHello, Reply, decode_daemon_message, encode_request

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as nobody")


def _as_uid(uid: int, fn: Callable[[], str]) -> str:
    """Run ``fn`` in a forked child that dropped to ``uid`` (no groups): what it returns, or
    the error it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        result = "error"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = fn()
        except BaseException as e:  # report, whatever happened
            result = f"error {e!r}"
        finally:
            os.write(w, result.encode()[:4000])
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def _hello_as(uid: int, path: str) -> str:
    """Connect to an engine socket as ``uid`` in a forked child and say hello; returns
    "ok", "refused" (connected, then closed without an answer) or "EACCES"."""

    def hello() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(path)
        except PermissionError:
            return "EACCES"
        try:
            send_blocking(s, encode_request(EngineHello(), 1))
            answer = decode_daemon_message(recv_blocking(s))
            return "ok" if isinstance(answer, Reply) and answer.ok else "not ok"
        except (ControlError, ConnectionResetError, BrokenPipeError):
            return "refused"

    return _as_uid(uid, hello)


def _wait_log(text: Callable[[], str], needle: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in text():
        if time.monotonic() > deadline:
            raise AssertionError(f"never logged {needle!r}:\n{text()}")
        time.sleep(0.05)


def test_other_uid_kept_out_by_permissions_and_by_peercred(
    pair_factory: Callable[..., Pair],
) -> None:
    p = pair_factory().start()
    assert p.tx is not None and p.rx is not None
    for path in (p.tx_sock, p.rx_sock):
        assert Path(path).stat().st_mode & 0o777 == 0o600
        assert _hello_as(NOBODY, path) == "EACCES"
        assert _hello_as(0, path) == "ok"  # root (and the daemon's own uid) may connect
    # someone loosens the permissions: SO_PEERCRED still refuses the other user
    p.workdir.chmod(0o755)
    for path in (p.tx_sock, p.rx_sock):
        os.chmod(path, 0o666)
        assert _hello_as(NOBODY, path) == "refused"
    _wait_log(p.tx.log, "prefill engine connection refused: pid")
    _wait_log(p.rx.log, f"runs as uid {NOBODY}, not one of [0]")
    # and the daemons still serve their own engines
    assert _hello_as(0, p.tx_sock) == "ok" and _hello_as(0, p.rx_sock) == "ok"


def test_allowed_uids_lets_a_service_user_in(pair_factory: Callable[..., Pair]) -> None:
    p = pair_factory()
    p.tx_cfg.node.allowed_uids = p.rx_cfg.node.allowed_uids = (NOBODY,)
    p.start()
    p.workdir.chmod(0o755)
    for path in (p.tx_sock, p.rx_sock):
        assert Path(path).stat().st_mode & 0o777 == 0o660  # reachable for the daemon's group
        os.chmod(path, 0o666)  # nobody is not in root's group here: open it for the test
        assert _hello_as(NOBODY, path) == "ok"
        assert _hello_as(NOBODY + 1, path) == "refused"


def test_engine_uids() -> None:
    assert engine_uids((), own_uid=1000) == {0, 1000}
    assert engine_uids((7, 8), own_uid=0) == {0, 7, 8}


def test_an_allowed_uid_engine_maps_pools_it_may_not_open_by_name(
    pair_factory: Callable[..., Pair],
) -> None:
    """Issue 26 finding 7: a listed uid was admitted on the socket, then failed to open the
    0600 pool file. The daemons now pass the pool's descriptor over the socket: an engine
    running as nobody hands layers to the sender and reads them verified at the receiver,
    while the pool files stay owner-only."""
    import numpy.random  # noqa: F401 - imported before the fork: nobody cannot read root's site
    from xdc.transport.engine_client import PrefillClient
    from xdc.transport.shm import SHM_DIR

    import xdc.lab.synthetic  # noqa: F401
    from tests.transport_fixtures import transfer_and_verify

    p = pair_factory()
    p.tx_cfg.node.allowed_uids = p.rx_cfg.node.allowed_uids = (NOBODY,)
    p.start()
    p.workdir.chmod(0o755)
    for path in (p.tx_sock, p.rx_sock):
        os.chmod(path, 0o666)  # nobody is not in root's group here: open it for the test
    with PrefillClient(p.tx_sock) as tx:
        pool = SHM_DIR / str(tx.hello["shm"])
    assert pool.stat().st_mode & 0o777 == 0o600 and pool.stat().st_uid == 0

    def transfer() -> str:
        transfer_and_verify(p.tx_sock, p.rx_sock, "as-nobody", [70_000, 5])
        return "ok"

    answer = _as_uid(NOBODY, transfer)
    assert answer == "ok", answer
