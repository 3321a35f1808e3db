"""Keep the verbs backend honest against the real pyverbs, without an RDMA device.

A whole transfer runs over the fake fabric while every verbs object the backend builds
(queue-pair capabilities and attributes, address handles, GIDs, scatter-gather entries, send
and receive work requests) is recorded with its constructor arguments, attribute writes and
method calls. Each is then rebuilt, in the same order and the same way, with rdma-core's own
pyverbs classes (none of these needs a device), and every integer field is read back from
the real object. So a keyword pyverbs does not take, a rule it enforces (a receive needs an
SGE) or a field it stores differently fails here, not first on a machine with a NIC.
Completions go the other way: real pyverbs WC objects are fed through the backend's poll.

Needs pyverbs importable (deploy/setup-test-env.sh links Debian's python3-pyverbs); skips
with the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import socket
from collections import Counter
from typing import Any

import pytest
import trio
from xdc.transport.rdma.verbs import Handle, PyverbsBackend, WcKind, load_pyverbs

from tests.rdma_link_fixtures import make_rig, run_transfer
from xdc.lab.fake_verbs import FakeFabric, FakeVerbs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pyverbs") is None,
    reason="pyverbs not installed (deploy/setup-test-env.sh links rdma-core's python3-pyverbs)",
)

DEVICE_FREE = (
    "QPCap",
    "QPInitAttr",
    "QPAttr",
    "GID",
    "GlobalRoute",
    "AHAttr",
    "SGE",
    "SendWR",
    "RecvWR",
)


@dataclasses.dataclass
class Made:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sets: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    calls: list[tuple[str, tuple[Any, ...]]] = dataclasses.field(default_factory=list)


def _recording(cls: Any, name: str, log: list[tuple[object, Made]]) -> Any:
    """A subclass of a fake class that logs how the backend uses it."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        made = Made(name, args, kwargs)
        object.__setattr__(self, "_made", made)
        log.append((self, made))

    def __setattr__(self: Any, key: str, value: Any) -> None:
        made = self.__dict__.get("_made")
        if made is not None:
            made.sets.append((key, value))
        object.__setattr__(self, key, value)

    ns: dict[str, Any] = {"__init__": __init__, "__setattr__": __setattr__}
    if hasattr(cls, "set_wr_rdma"):

        def set_wr_rdma(self: Any, rkey: int, addr: int) -> None:
            made = self._made
            made.calls.append(("set_wr_rdma", (rkey, addr)))
            object.__setattr__(self, "_made", None)  # its own writes are not the backend's
            try:
                cls.set_wr_rdma(self, rkey, addr)
            finally:
                object.__setattr__(self, "_made", made)

        ns["set_wr_rdma"] = set_wr_rdma
    return type(f"Recording{name}", (cls,), ns)


def _record_transfer() -> list[tuple[object, Made]]:
    log: list[tuple[object, Made]] = []
    fabric = FakeFabric()
    fabric.add_device("rxe0")
    fabric.add_device("rxe1")
    verbs = FakeVerbs(fabric)
    recording: dict[str, Any] = {n: _recording(getattr(verbs.api, n), n, log) for n in DEVICE_FREE}
    verbs.api = dataclasses.replace(verbs.api, **recording)

    async def main() -> None:
        rig = await make_rig(verify_every=2, verbs=verbs)
        try:
            await run_transfer(rig)
            assert rig.tracker.complete and rig.landed() == rig.payload
        finally:
            rig.close()

    trio.run(main)
    assert fabric.violations == []
    return log


def test_every_object_the_backend_builds_is_accepted_by_real_pyverbs() -> None:
    log = _record_transfer()
    real = load_pyverbs()
    rebuilt: dict[int, object] = {}

    def conv(value: Any) -> Any:
        if isinstance(value, list):
            return [conv(v) for v in value]
        if id(value) in rebuilt:
            return rebuilt[id(value)]
        if type(value).__module__.endswith(".fake_verbs"):
            return None  # a device object (CQ, PD): pyverbs takes None where we test
        return value

    checked: Counter[str] = Counter()
    for fake_obj, made in log:  # constructors first: attributes are set to later objects
        cls = getattr(real, made.name)
        args = conv(list(made.args))
        rebuilt[id(fake_obj)] = cls(*args, **{k: conv(v) for k, v in made.kwargs.items()})
    for fake_obj, made in log:
        obj = rebuilt[id(fake_obj)]
        for key, value in made.sets:
            setattr(obj, key, conv(value))
        for method, args in made.calls:
            getattr(obj, method)(*args)
        named = inspect.signature(type(fake_obj).__mro__[1]).bind(*made.args, **made.kwargs)
        for key, value in [*named.arguments.items(), *made.sets]:
            if isinstance(value, int) and not isinstance(value, bool):
                assert getattr(obj, key) == value, f"{made.name}.{key}"
                checked[made.name] += 1
        if made.name == "GID":
            assert str(obj) == str(made.args[0] if made.args else made.kwargs["val"])
    # the transfer exercised every kind, both write opcodes, and signalled imm writes
    assert set(checked) == set(DEVICE_FREE) - {"GID"}, checked  # GID: compared as text
    opcodes = {m.kwargs["opcode"] for _o, m in log if m.name == "SendWR"}
    assert opcodes == {real.WR_RDMA_WRITE, real.WR_RDMA_WRITE_WITH_IMM}
    assert all(
        m.kwargs.get("num_sge") == 1 and len(m.kwargs.get("sg") or ()) == 1
        for _o, m in log
        if m.name in ("SendWR", "RecvWR")
    )


def test_real_work_completions_translate() -> None:
    """The backend's poll over real pyverbs WC objects (what CQ.poll returns)."""
    from pyverbs.cq import WC

    real = load_pyverbs()
    wcs = [
        WC(
            wr_id=7,
            status=0,
            opcode=real.WC_RECV_RDMA_WITH_IMM,
            byte_len=4096,
            imm_data=socket.htonl(0x00400003),
        ),
        WC(wr_id=8, status=0, opcode=real.WC_RDMA_WRITE, byte_len=0),
        WC(wr_id=9, status=5, opcode=0xFF),
    ]

    class Cq:  # stands in for a device CQ: returns what pyverbs' CQ.poll returns
        def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
            return len(wcs), wcs

    got = PyverbsBackend(real).poll(Handle(Cq()), 16)
    assert [(c.wr_id, c.kind, c.imm, c.byte_len, c.ok) for c in got] == [
        (7, WcKind.RECV_IMM, 0x00400003, 4096, True),
        (8, WcKind.WRITE, None, 0, True),
        (9, WcKind.OTHER, None, 0, False),
    ]


def test_opening_a_device_that_is_not_there_is_a_clear_verbs_error() -> None:
    from xdc.transport.rdma.verbs import VerbsError

    with pytest.raises(VerbsError, match="open device 'rxe0' failed"):
        PyverbsBackend().open("rxe0")
