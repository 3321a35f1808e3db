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

from tests.test_rdma_transfer import make_rig, run_transfer

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
