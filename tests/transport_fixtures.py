"""Fixtures that start real sender/receiver daemon processes talking over loopback TCP."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from xdc.config import Config
from xdc.transport.launcher import DaemonProcess, local_pair_config
from xdc.transport.shm import SHM_DIR


@dataclass
class Pair:
    tx_cfg: Config
    rx_cfg: Config
    workdir: Path
    tx: DaemonProcess | None = None
    rx: DaemonProcess | None = None

    def start(self, *, sender: bool = True, receiver: bool = True) -> Pair:
        if receiver:
            self.rx = DaemonProcess("receiver", self.rx_cfg, self.workdir)
            self.rx.wait_ready()
        if sender:
            self.tx = DaemonProcess("sender", self.tx_cfg, self.workdir)
            self.tx.wait_ready()
        return self

    @property
    def tx_sock(self) -> str:
        return self.tx_cfg.sender.control_socket

    @property
    def rx_sock(self) -> str:
        return self.rx_cfg.receiver.control_socket

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
def pair_factory(request: pytest.FixtureRequest) -> Iterator[object]:
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
    leaked = {p.name for p in SHM_DIR.glob("xdc-*")} - shm_before
    assert not leaked, f"daemons leaked shared-memory segments: {leaked}"
