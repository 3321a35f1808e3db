"""The same end-to-end transfer on a real RDMA device through pyverbs.

Runs wherever /sys/class/infiniband has an ACTIVE port and pyverbs imports (soft-RoCE works:
``rdma link add rxe0 type rxe netdev lo`` on a kernel with rdma_rxe); both queue pairs live
on the first device, connected to each other. Otherwise it skips with the reason (``-ra``
prints it). The machine this was written on has a kernel without RDMA support (no
/sys/class/infiniband, no rdma_rxe module, "Failed to open NETLINK_RDMA socket").
"""

from __future__ import annotations

import importlib.util

import pytest
import trio
from xdc.transport.rdma.select import usable_devices
from xdc.transport.rdma.verbs import PyverbsBackend

from tests.rdma_link_fixtures import make_rig, run_transfer

DEVICES, WHY = usable_devices()
if importlib.util.find_spec("pyverbs") is None:
    WHY = f"pyverbs not installed; {WHY}"
    DEVICES = []

pytestmark = pytest.mark.skipif(not DEVICES, reason=f"no RDMA device: {WHY}")


def test_real_device_transfer() -> None:
    async def main() -> None:
        rig = await make_rig(verify_every=2, verbs=PyverbsBackend(), devices=(DEVICES[0],) * 2)
        try:
            await run_transfer(rig)
            assert rig.tracker.complete and rig.landed() == rig.payload
        finally:
            rig.close()

    trio.run(main)


def test_real_device_daemons() -> None:
    """The daemons, RDMA selected on the real device: same checks as the fake-fabric test."""
    import functools
    import tempfile
    from pathlib import Path

    from tests.rdma_fixtures import LAYERS, RDMA, Rig, make_payloads, with_daemons

    payloads = make_payloads(4)

    async def body(rig: Rig) -> None:
        status = await rig.negotiated()
        assert status["backend"] == "rdma", status
        outcomes = await rig.ship(payloads)
        assert all(o.ok for o in outcomes.values()), outcomes
        assert rig.sender.metrics.bytes_sent._value.get() == 0  # no payload went by TCP
        (sess,) = rig.receiver.status()["rdma"].values()
        assert sess["landed_bytes"] == 4 * sum(LAYERS)

    with tempfile.TemporaryDirectory(prefix="xdc-rdma-") as wd:
        trio.run(
            functools.partial(
                with_daemons,
                Path(wd),
                body,
                tx_rdma=RDMA,
                rx_rdma=RDMA,
                verbs_factory=PyverbsBackend,
                tx_devices=[DEVICES[0]],
                rx_devices=[DEVICES[0]],
            )
        )
