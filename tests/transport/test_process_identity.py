"""Process identity is asked, not guessed (issue 13 class 6): whether a shared-memory pool's
owner lives is its flock, whatever PID namespace either side runs in; who serves an engine
socket is the lock beside it."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
from xdc.transport.launcher import free_port, local_pair_config
from xdc.transport.shm import SHM_DIR

from tests.transport_fixtures import (
    PairFactory,
    engine_socket_ready,
    needs_root,
    transfer_and_verify,
)
from xdc.config import to_toml

CHUNK = 64 * 1024


@needs_root
def test_a_daemon_in_another_pid_namespace_never_sweeps_a_live_daemons_pool(
    pair_factory: PairFactory,
) -> None:
    """The sweep judged owners by the PID in a segment's name: from another PID namespace a
    live daemon's PID does not exist, so its pool was removed under it."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    assert p.tx is not None and p.rx is not None
    ours = {n.name for n in SHM_DIR.glob("xdc-*") if f"-{p.tx.proc.pid}-" in n.name}
    ours |= {n.name for n in SHM_DIR.glob("xdc-*") if f"-{p.rx.proc.pid}-" in n.name}
    assert len(ours) == 2
    _tx, rx, _ = local_pair_config(p.workdir / "ns", chunk_bytes=CHUNK)
    (p.workdir / "ns").mkdir()
    cfg = p.workdir / "ns" / "rx.toml"
    cfg.write_text(to_toml(rx))
    log = open(p.workdir / "ns" / "rx.log", "wb")  # noqa: SIM115
    # under a shell, so the daemon is not the namespace's PID 1 (which ignores signals)
    daemon = f"{sys.executable} -m xdc receiver -c {cfg} & wait"
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", daemon],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        engine_socket_ready(
            rx.receiver.control_socket
        )  # it swept at start, from inside its namespace
        still = {n.name for n in SHM_DIR.glob("xdc-*")}
        assert ours <= still, f"swept a live daemon's pool: {ours - still}"
        transfer_and_verify(p.tx_sock, p.rx_sock, "pools-intact", [3 * CHUNK, CHUNK])
    finally:
        inside = psutil.Process(proc.pid).children(recursive=True)
        for child in inside:
            child.terminate()
        psutil.wait_procs(inside, timeout=15)
        proc.kill()
        proc.wait()
        log.close()
    assert "removed shared memory" not in (p.workdir / "ns" / "rx.log").read_text()


def test_a_second_daemon_with_the_same_socket_refuses_to_start_and_harms_nothing(
    pair_factory: PairFactory,
) -> None:
    """Class 6: it replaced the first one's control socket, failed on the status port with a
    traceback and unlinked the socket on the way out, orphaning the first daemon."""
    p = pair_factory().start()
    assert p.tx is not None
    p.tx_cfg.sender.status_port = free_port()
    cfg = p.workdir / "tx-second.toml"
    cfg.write_text(to_toml(p.tx_cfg))
    out = subprocess.run(
        [sys.executable, "-m", "xdc", "sender", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out
    assert f"another xdc daemon (pid {p.tx.proc.pid}) serves" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert os.path.exists(p.tx_sock)
    transfer_and_verify(p.tx_sock, p.rx_sock, "first-still-serves", [CHUNK])
