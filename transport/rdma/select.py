"""Which backend a pair of peers uses, and which RDMA devices this host can actually use.

The decision is a pure function so every branch is tested without a device; the daemon logs
its reason in one line, because "why is this transfer on TCP?" is the first question anyone
asks when RDMA is configured.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from xdc.transport.rdma.verbs import PyverbsBackend, Verbs

from xdc.config import RdmaConfig

log = logging.getLogger("xdc.rdma")

SYS_INFINIBAND = Path("/sys/class/infiniband")
DEV_INFINIBAND = Path("/dev/infiniband")


class Backend(enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


def select_backend(
    local: RdmaConfig, peer_domain: str | None, devices: list[str]
) -> tuple[Backend, str]:
    """RDMA only when both ends declare the same domain and we have a usable device."""
    if not local.enabled:
        return Backend.TCP, "rdma disabled in local config"
    if not local.domain:
        return Backend.TCP, "no local rdma domain configured"
    if not peer_domain:
        return Backend.TCP, "peer declares no rdma domain"
    if peer_domain != local.domain:
        return Backend.TCP, f"peer domain {peer_domain!r} differs from ours {local.domain!r}"
    if not devices:
        return Backend.TCP, "no usable rdma device on this host"
    if local.device and local.device not in devices:
        return Backend.TCP, f"configured device {local.device!r} not usable (have {devices})"
    device = local.device or devices[0]
    return Backend.RDMA, f"same domain {local.domain!r}, device {device}"


def choose_backend(
    local: RdmaConfig, peer_id: str, peer_domain: str | None, devices: list[str]
) -> tuple[Backend, str]:
    """select_backend plus the one log line per peer the issue asks for."""
    backend, reason = select_backend(local, peer_domain, devices)
    log.info("peer %s: using %s (%s)", peer_id, backend.value, reason)
    return backend, reason


def _port_active(port_dir: Path) -> bool:
    try:
        state = (port_dir / "state").read_text()
    except OSError:
        return False
    # sysfs reports e.g. "4: ACTIVE"
    return state.split(":", 1)[-1].strip().upper() == "ACTIVE"


def usable_devices(
    sys_root: Path = SYS_INFINIBAND, dev_root: Path = DEV_INFINIBAND
) -> tuple[list[str], str]:
    """Devices with at least one ACTIVE port, and a reason when there are none.

    A device listed in sysfs is not enough: without /dev/infiniband (no uverbs char devices,
    e.g. inside a container that was not given them) verbs cannot open it.
    """
    if not sys_root.is_dir():
        return [], f"{sys_root} does not exist (kernel without RDMA support or no RDMA driver)"
    names = sorted(p.name for p in sys_root.iterdir())
    if not names:
        return [], f"{sys_root} is empty (no RDMA device; soft-RoCE: rdma link add ...)"
    active = [
        name
        for name in names
        if any(_port_active(p) for p in sorted((sys_root / name / "ports").glob("*")))
    ]
    if not active:
        return [], f"no RDMA device has an ACTIVE port (devices: {', '.join(names)})"
    if not dev_root.is_dir() or not any(p.name.startswith("uverbs") for p in dev_root.iterdir()):
        return [], f"{dev_root} has no uverbs devices (not exposed to this container?)"
    if not os.access(dev_root, os.R_OK | os.X_OK):
        return [], f"{dev_root} is not readable by uid {os.getuid()}"
    return active, f"usable: {', '.join(active)}"


VerbsFactory = Callable[[], Verbs]
DeviceProbe = Callable[[], tuple[list[str], str]]


@dataclass(frozen=True)
class RdmaDeps:
    """Where a daemon gets its verbs and its device list: pyverbs and sysfs in production,
    the fake fabric in tests (the daemons' code is otherwise the same)."""

    verbs: VerbsFactory = PyverbsBackend
    devices: DeviceProbe = usable_devices
