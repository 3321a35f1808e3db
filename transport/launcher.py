"""Start xdc daemons as child processes (demo, tests, benchmarks) and wait until they serve.

Daemons run as real separate processes so that sender, receiver and the engines each get
their own interpreter (and GIL), the way they are deployed.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from xdc.config import Config, SenderConfig, to_toml


class DaemonProcess:
    def __init__(
        self,
        kind: str,
        cfg: Config,
        workdir: Path,
        *,
        netns: str | None = None,
        extra_args: Sequence[str] = (),
        wrap: Sequence[str] = (),
    ) -> None:
        """``wrap``: a command the daemon runs under (e.g. ``prlimit --nofile=512:512``)."""
        self.kind = kind
        self.cfg = cfg
        self.config_path = workdir / f"{kind}-{cfg.node.id}.toml"
        self.config_path.write_text(to_toml(cfg))
        self.log_path = workdir / f"{kind}-{cfg.node.id}.log"
        argv = [sys.executable, "-m", "xdc", kind, "--config", str(self.config_path), *extra_args]
        argv = [*wrap, *argv]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.control_socket = (
            cfg.sender.control_socket if kind == "sender" else cfg.receiver.control_socket
        )

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.kind} exited early ({self.proc.returncode}):\n{self.log()}"
                )
            if os.path.exists(self.control_socket):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(self.control_socket)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            time.sleep(0.02)
        raise TimeoutError(f"{self.kind} not ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM, then SIGKILL if the daemon is still there after its drain deadline."""
        if timeout is None:
            timeout = self.cfg.node.shutdown_drain_s + 5.0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# where ``free_port`` looks: below the kernel's ephemeral range, from here up
SERVER_PORTS_FROM = 10000


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server that binds it later (a daemon, toxiproxy, vLLM).

    Picked below the kernel's ephemeral range (``ip_local_port_range``), not by binding port
    0: a port from that range can be taken by any outgoing connection in the gap before the
    server binds it, and a vLLM server takes seconds to get there while its own engine and
    every test beside it connect out (a CI run saw a producer fail with EADDRINUSE). A
    server's port clashing now needs another picker to draw the same port in that gap."""
    low = _ephemeral_low()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if low - SERVER_PORTS_FROM >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(SERVER_PORTS_FROM, low)
            with socket.socket(family) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(family) as s:  # a kernel without room below its range
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def pair_flag_problems(connections: int, chunk_kib: int) -> list[str]:
    """``--connections`` and ``--chunk-kib`` of the local-pair commands (``xdc demo``, ``xdc
    bench transfer``) checked against the sender's own bounds, each problem naming its flag:
    otherwise a bad value surfaces as the sender daemon refusing its config mid-run."""
    probe = SenderConfig(connections=connections, chunk_bytes=chunk_kib * 1024)
    probe.pool_bytes = max(probe.pool_bytes, probe.chunk_bytes)
    problems: list[str] = []
    probe.validate(problems)
    out = []
    for problem in problems:
        if problem.startswith("sender.connections:"):
            out.append(problem.replace("sender.connections", "--connections", 1))
        elif problem.startswith("sender.chunk_bytes:"):
            out.append(
                f"--chunk-kib: {chunk_kib} KiB is not a valid sender.chunk_bytes ({problem})"
            )
    return out


def local_pair_config(
    workdir: Path | None = None,
    *,
    connections: int = 8,
    chunk_bytes: int = 1 << 20,
    send_pool: int = 256 << 20,
    recv_pool: int = 1 << 30,
    port: int | None = None,
) -> tuple[Config, Config, Path]:
    """Configs for a sender and a receiver talking over loopback, sockets in ``workdir``.

    TLS is off, said explicitly: both ends share one host, so nothing crosses a network
    (a test that wants mutual TLS sets ``cfg.tls`` on both configs).
    """
    wd = workdir or Path(tempfile.mkdtemp(prefix="xdc-"))
    port = port or free_port()
    rx = Config()
    rx.tls.mode = "off"
    rx.node.id = "rx"
    rx.receiver.listen_port = port
    rx.receiver.pool_bytes = recv_pool
    rx.receiver.control_socket = str(wd / "rx.sock")
    tx = Config()
    tx.tls.mode = "off"
    tx.node.id = "tx"
    tx.sender.peer_port = port
    tx.sender.connections = connections
    tx.sender.chunk_bytes = chunk_bytes
    tx.sender.pool_bytes = send_pool
    tx.sender.control_socket = str(wd / "tx.sock")
    # chunks past the protocol's default limit (``--chunk-kib``): both daemons accept them
    for cfg in (tx, rx):
        cfg.limits.max_chunk_bytes = max(cfg.limits.max_chunk_bytes, chunk_bytes)
    return tx, rx, wd
