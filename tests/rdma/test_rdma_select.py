"""Backend selection (pure) and device discovery over real sysfs-shaped trees."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from xdc.transport.rdma.select import Backend, choose_backend, select_backend, usable_devices

from xdc.config import RdmaConfig

ON = RdmaConfig(enabled=True, domain="pd-a")


@pytest.mark.parametrize(
    ("local", "peer", "devices", "backend", "why"),
    [
        (RdmaConfig(domain="pd-a"), "pd-a", ["rxe0"], Backend.TCP, "disabled"),
        (RdmaConfig(enabled=True), "pd-a", ["rxe0"], Backend.TCP, "no local rdma domain"),
        (ON, None, ["rxe0"], Backend.TCP, "peer declares no"),
        (ON, "pd-b", ["rxe0"], Backend.TCP, "differs"),
        (ON, "pd-a", [], Backend.TCP, "no usable rdma device"),
        (
            RdmaConfig(enabled=True, domain="pd-a", device="mlx5_0"),
            "pd-a",
            ["rxe0"],
            Backend.TCP,
            "not usable",
        ),
        (ON, "pd-a", ["rxe0", "rxe1"], Backend.RDMA, "device rxe0"),
        (
            RdmaConfig(enabled=True, domain="pd-a", device="rxe1"),
            "pd-a",
            ["rxe0", "rxe1"],
            Backend.RDMA,
            "device rxe1",
        ),
    ],
)
def test_select_backend(
    local: RdmaConfig, peer: str | None, devices: list[str], backend: Backend, why: str
) -> None:
    got, reason = select_backend(local, peer, devices)
    assert got is backend
    assert why in reason


def test_choose_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="xdc.rdma"):
        choose_backend(ON, "peer-7", "pd-b", ["rxe0"])
    lines = [r.getMessage() for r in caplog.records if r.name == "xdc.rdma"]
    assert len(lines) == 1
    assert "peer-7" in lines[0] and "tcp" in lines[0] and "differs" in lines[0]


def _device(root: Path, name: str, states: list[str]) -> None:
    for i, state in enumerate(states, 1):
        port = root / name / "ports" / str(i)
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")


def test_usable_devices_from_tree(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "infiniband", tmp_path / "dev"
    assert "does not exist" in usable_devices(sysfs, dev)[1]
    sysfs.mkdir()
    assert "empty" in usable_devices(sysfs, dev)[1]
    _device(sysfs, "rxe0", ["1: DOWN"])
    devices, reason = usable_devices(sysfs, dev)
    assert devices == [] and "ACTIVE" in reason and "rxe0" in reason
    _device(sysfs, "rxe1", ["1: DOWN", "4: ACTIVE"])
    devices, reason = usable_devices(sysfs, dev)
    assert devices == [] and "uverbs" in reason
    dev.mkdir()
    (dev / "uverbs0").write_text("")
    assert usable_devices(sysfs, dev) == (["rxe1"], "usable: rxe1")


def test_this_host(capsys: pytest.CaptureFixture[str]) -> None:
    """Real discovery; on the build machine (kernel without RDMA) this is [] with a reason."""
    devices, reason = usable_devices()
    with capsys.disabled():
        print(f"\nrdma devices on this host: {devices or 'none'} ({reason})")
    assert reason
    assert bool(devices) == reason.startswith("usable")
