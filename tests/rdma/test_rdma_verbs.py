"""The verbs layer over the fake fabric: pyverbs-shaped signatures, and the fake refuses what
hardware refuses, so bookkeeping bugs fail here instead of on a device."""

from __future__ import annotations

import importlib.util
import inspect
from types import ModuleType
from typing import Any

import pytest
import trio
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.registry import MrRegistry
from xdc.transport.rdma.session import next_completions
from xdc.transport.rdma.verbs import (
    Access,
    Completion,
    PyverbsBackend,
    RdmaUnavailable,
    VerbsError,
    WcKind,
    Write,
    load_pyverbs,
)

from xdc.config import RdmaConfig
from xdc.lab import fake_verbs as fake
from xdc.lab.fake_verbs import FakeFabric, FakeVerbs, fake_api

S = RdmaConfig(enabled=True, domain="d", max_inflight=4, recv_depth=4)

# Constructor/method parameters (name, default) of pyverbs 59 (rdma-core pyverbs/*.pyx);
# IBV_* defaults as their numbers. The fake must accept exactly these.
_ = inspect.Parameter.empty
PYVERBS_SIGNATURES: dict[str, list[tuple[str, Any]]] = {
    "Context": [("kwargs", _)],
    "PD": [("creator", _), ("kwargs", _)],
    "MR": [
        ("creator", _),
        ("length", 0),
        ("access", 0),
        ("address", None),
        ("implicit", False),
        ("kwargs", _),
    ],
    "CQ": [("context", _), ("cqe", _), ("cq_context", None), ("channel", None), ("comp_vector", 0)],
    "CompChannel": [("context", _)],
    "QP": [("creator", _), ("init_attr", _), ("qp_attr", None)],
    "QPCap": [
        ("max_send_wr", 1),
        ("max_recv_wr", 10),
        ("max_send_sge", 1),
        ("max_recv_sge", 1),
        ("max_inline_data", 0),
    ],
    "QPInitAttr": [
        ("qp_type", 4),
        ("qp_context", None),
        ("scq", None),
        ("rcq", None),
        ("srq", None),
        ("cap", None),
        ("sq_sig_all", 1),
    ],
    "QPAttr": [("qp_state", 1), ("cur_qp_state", 0), ("port_num", 1), ("path_mtu", 3)],
    "GID": [("val", None)],
    "GlobalRoute": [
        ("dgid", None),
        ("flow_label", 0),
        ("sgid_index", 0),
        ("hop_limit", 1),
        ("traffic_class", 0),
    ],
    "AHAttr": [
        ("dlid", 0),
        ("sl", 0),
        ("src_path_bits", 0),
        ("static_rate", 0),
        ("is_global", 0),
        ("port_num", 1),
        ("gr", None),
    ],
    "SGE": [("addr", _), ("length", _), ("lkey", _)],
    "SendWR": [
        ("wr_id", 0),
        ("opcode", 2),
        ("num_sge", 0),
        ("imm_data", 0),
        ("sg", None),
        ("send_flags", 2),
        ("next_wr", None),
    ],
    "RecvWR": [("wr_id", 0), ("num_sge", 0), ("sg", None), ("next_wr", None)],
    "QP.to_init": [("qp_attr", _)],
    "QP.to_rtr": [("qp_attr", _)],
    "QP.to_rts": [("qp_attr", _)],
    "QP.post_send": [("wr", _), ("bad_wr", None)],
    "QP.post_recv": [("wr", _), ("bad_wr", None)],
    "CQ.poll": [("num_entries", 1)],
    "CQ.req_notify": [("solicited_only", False)],
    "CQ.ack_events": [("num_events", _)],
    "CompChannel.get_cq_event": [("expected_cq", _)],
    "Context.query_port": [("port_num", _)],
    "Context.query_gid": [("port_num", _), ("index", _)],
}


def _params(obj: Any) -> list[tuple[str, Any]]:
    sig = inspect.signature(obj)
    return [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", sorted(PYVERBS_SIGNATURES))
def test_fake_matches_pyverbs_signatures(name: str) -> None:
    api = fake_api(FakeFabric())
    cls_name, _dot, method = name.partition(".")
    obj = getattr(api, cls_name)
    target = getattr(obj, method) if method else obj.__init__
    assert _params(target) == PYVERBS_SIGNATURES[name]


def test_fake_constants_match_pyverbs_when_installed() -> None:
    if importlib.util.find_spec("pyverbs") is None:
        pytest.skip("pyverbs not installed: constants checked against rdma-core 59 source only")
    real = load_pyverbs()
    ours = fake_api(FakeFabric())
    for field in (
        "QPT_RC",
        "WR_RDMA_WRITE",
        "WR_RDMA_WRITE_WITH_IMM",
        "SEND_SIGNALED",
        "WC_RDMA_WRITE",
        "WC_RECV_RDMA_WITH_IMM",
        "MTU",
    ):
        assert getattr(real, field) == getattr(ours, field), field


def test_missing_pyverbs_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def without_pyverbs(name: str, package: str | None = None) -> ModuleType:
        if name.split(".")[0] == "pyverbs":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", without_pyverbs)
    with pytest.raises(RdmaUnavailable, match="pyverbs not installed"):
        PyverbsBackend()


def _pair(
    fabric: FakeFabric, settings: RdmaConfig = S
) -> tuple[FakeVerbs, RdmaEndpoint, RdmaEndpoint]:
    fabric.add_device("rxe0")
    fabric.add_device("rxe1")
    verbs = FakeVerbs(fabric)
    return verbs, RdmaEndpoint(verbs, "rxe0", settings), RdmaEndpoint(verbs, "rxe1", settings)


def _connect(a: RdmaEndpoint, b: RdmaEndpoint, a_mr: Any = None, b_mr: Any = None) -> None:
    ia, ib = a.local_info("pa", a_mr), b.local_info("pb", b_mr)
    a.connect(ib)
    b.connect(ia)


def _clean(fabric: FakeFabric) -> None:
    assert fabric.violations == []
    assert fabric.live_registrations == 0
    assert fabric.registered == fabric.deregistered
    assert fabric.open_objects == 0
    assert fabric.pinned == {}


def test_write_with_imm_copies_bytes_and_carries_imm() -> None:
    fabric = FakeFabric()
    verbs, tx, rx = _pair(fabric)
    src, dst = bytearray(b"x" * 8192), bytearray(8192)
    src[100:105] = b"hello"
    smr = tx.register("src", memoryview(src), Access.LOCAL_WRITE)
    dmr = rx.register("dst", memoryview(dst))
    _connect(tx, rx, b_mr=dmr)
    rx.fill_receives()
    assert tx.qp is not None and tx.cq is not None and rx.cq is not None
    verbs.post_write(
        tx.qp, Write(7, smr.addr + 100, 5, smr.lkey, dmr.addr + 4000, dmr.rkey, 0xABC12345)
    )
    assert verbs.poll(tx.cq, 8) == [Completion(7, 0, WcKind.WRITE, 0, None)]
    (got,) = verbs.poll(rx.cq, 8)
    assert (got.kind, got.imm, got.byte_len, got.ok) == (WcKind.RECV_IMM, 0xABC12345, 5, True)
    assert bytes(dst[4000:4005]) == b"hello" and dst.count(0) == 8192 - 5
    tx.close()
    rx.close()
    _clean(fabric)


def test_hardware_rules_enforced() -> None:
    fabric = FakeFabric()
    verbs, tx, rx = _pair(fabric)
    src, dst = bytearray(4096), bytearray(4096)
    smr = tx.register("src", memoryview(src), Access.LOCAL_WRITE)
    dmr = rx.register("dst", memoryview(dst))
    assert tx.qp is not None and tx.cq is not None and rx.cq is not None and rx.qp is not None
    with pytest.raises(VerbsError, match="RTS"):  # not connected yet
        verbs.post_write(tx.qp, Write(1, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey))
    _connect(tx, rx, b_mr=dmr)
    # WRITE_WITH_IMM with no receive posted: the requester retries (rnr_retry=7) until one is
    # posted, and a plain WRITE behind it waits too (RC keeps order)
    src[:4] = b"abcd"
    verbs.post_write(tx.qp, Write(2, smr.addr, 2, smr.lkey, dmr.addr, dmr.rkey, 1))
    verbs.post_write(tx.qp, Write(3, smr.addr + 2, 2, smr.lkey, dmr.addr + 2, dmr.rkey))
    assert verbs.poll(tx.cq, 4) == [] and bytes(dst[:4]) == bytes(4)
    assert rx.sink_mr is not None
    verbs.post_recv(rx.qp, 77, rx.sink_mr)
    assert [(c.wr_id, c.ok) for c in verbs.poll(tx.cq, 4)] == [(2, True), (3, True)]
    assert [(c.wr_id, c.imm) for c in verbs.poll(rx.cq, 4)] == [(77, 1)]
    assert bytes(dst[:4]) == b"abcd"
    # a write outside the remote MR puts both QPs in error; later work is flushed
    verbs.post_write(tx.qp, Write(4, smr.addr, 8, smr.lkey, dmr.addr + 4093, dmr.rkey))
    assert verbs.poll(tx.cq, 4)[0].status == fake.IBV_WC_REM_ACCESS_ERR
    verbs.post_write(tx.qp, Write(5, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey))
    (c,) = verbs.poll(tx.cq, 4)
    assert c.status == fake.IBV_WC_WR_FLUSH_ERR and c.kind is WcKind.OTHER
    tx.close()
    rx.close()
    _clean(fabric)


@pytest.mark.parametrize(
    ("lkey_delta", "raddr_delta", "length", "status"),
    [
        (1, 0, 8, fake.IBV_WC_LOC_PROT_ERR),  # unregistered lkey
        (0, 0, 4097, fake.IBV_WC_LOC_PROT_ERR),  # beyond the local MR
        (0, 4090, 8, fake.IBV_WC_REM_ACCESS_ERR),  # beyond the remote MR
    ],
)
def test_bounds_checked(lkey_delta: int, raddr_delta: int, length: int, status: int) -> None:
    fabric = FakeFabric()
    verbs, tx, rx = _pair(fabric)
    src, dst = bytearray(4096), bytearray(4096)
    smr = tx.register("src", memoryview(src), Access.LOCAL_WRITE)
    dmr = rx.register("dst", memoryview(dst))
    _connect(tx, rx, b_mr=dmr)
    rx.fill_receives()
    assert tx.qp is not None and tx.cq is not None and rx.cq is not None
    verbs.post_write(
        tx.qp, Write(1, smr.addr, length, smr.lkey + lkey_delta, dmr.addr + raddr_delta, dmr.rkey)
    )
    assert verbs.poll(tx.cq, 4)[0].status == status
    if status == fake.IBV_WC_REM_ACCESS_ERR:  # the responder went to error: receives flushed
        flushed = verbs.poll(rx.cq, 16)
        assert len(flushed) == S.recv_depth
        assert {c.status for c in flushed} == {fake.IBV_WC_WR_FLUSH_ERR}
    assert bytes(dst) == bytes(4096)
    tx.close()
    rx.close()
    _clean(fabric)


def test_psn_exchange_must_be_right() -> None:
    fabric = FakeFabric()
    verbs, tx, rx = _pair(fabric)
    src, dst = bytearray(4096), bytearray(4096)
    smr = tx.register("src", memoryview(src), Access.LOCAL_WRITE)
    dmr = rx.register("dst", memoryview(dst))
    info = tx.local_info("p")
    bad = type(info)(**{**{k: getattr(info, k) for k in info.__slots__}, "psn": info.psn ^ 1})
    rx.connect(bad)
    tx.connect(rx.local_info("p", dmr))
    assert tx.qp is not None and tx.cq is not None
    verbs.post_write(tx.qp, Write(1, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey))
    assert verbs.poll(tx.cq, 4)[0].status == fake.IBV_WC_RETRY_EXC_ERR
    assert any("PSN" in v for v in fabric.violations)
    tx.close()
    rx.close()


def test_send_queue_depth_enforced() -> None:
    fabric = FakeFabric()
    verbs, tx, rx = _pair(fabric)
    src, dst = bytearray(4096), bytearray(4096)
    smr = tx.register("src", memoryview(src), Access.LOCAL_WRITE)
    dmr = rx.register("dst", memoryview(dst))
    _connect(tx, rx, b_mr=dmr)
    assert tx.qp is not None and tx.cq is not None
    for i in range(S.max_inflight):
        verbs.post_write(tx.qp, Write(i, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey))
    with pytest.raises(VerbsError, match="send queue full"):
        verbs.post_write(tx.qp, Write(99, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey))
    assert len(verbs.poll(tx.cq, 64)) == S.max_inflight  # polling frees the slots
    verbs.post_write(tx.qp, Write(100, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey))
    tx.close()
    rx.close()
    _clean(fabric)


def test_registry_registers_once_and_releases_everything() -> None:
    fabric = FakeFabric()
    fabric.add_device("rxe0")
    verbs = FakeVerbs(fabric)
    ctx = verbs.open("rxe0")
    pd = verbs.alloc_pd(ctx)
    a, b = bytearray(4096), bytearray(8192)
    with MrRegistry(verbs, pd) as reg:
        mr = reg.register("a", memoryview(a), Access.LOCAL_WRITE)
        reg.register("b", memoryview(b), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        assert reg.by_rkey(mr.rkey) is mr and len(reg) == 2
        with pytest.raises(VerbsError, match="registered already"):
            reg.register("a", memoryview(a), Access.LOCAL_WRITE)
        assert fabric.live_registrations == 2
    assert fabric.live_registrations == 0
    reg.close()  # idempotent: nothing is deregistered twice
    with pytest.raises(VerbsError, match="closed"):
        reg.register("c", memoryview(a), Access.LOCAL_WRITE)
    verbs.destroy(pd)
    verbs.destroy(ctx)
    _clean(fabric)


def test_fake_catches_double_deregistration_and_pd_leak() -> None:
    fabric = FakeFabric()
    fabric.add_device("rxe0")
    verbs = FakeVerbs(fabric)
    ctx = verbs.open("rxe0")
    pd = verbs.alloc_pd(ctx)
    buf = bytearray(4096)
    mr = verbs.reg_mr(pd, memoryview(buf), Access.LOCAL_WRITE)
    verbs.dereg_mr(mr)
    verbs.dereg_mr(mr)
    assert fabric.violations == [f"MR {mr.lkey:#x} deregistered 2 times"]
    verbs.reg_mr(pd, memoryview(buf), Access.LOCAL_WRITE)
    verbs.destroy(pd)
    assert "PD closed with 1 MR(s) registered" in fabric.violations
    verbs.destroy(ctx)


def test_registration_needs_mapped_writable_memory() -> None:
    fabric = FakeFabric()
    fabric.add_device("rxe0")
    raw = PyverbsBackend(fake_api(fabric))  # no pinning: the address is not "mapped"
    ctx = raw.open("rxe0")
    pd = raw.alloc_pd(ctx)
    with pytest.raises(VerbsError, match="EFAULT"):
        raw.reg_mr(pd, memoryview(bytearray(64)), Access.LOCAL_WRITE)
    with pytest.raises(VerbsError, match="writable"):
        raw.reg_mr(pd, memoryview(b"read-only"), Access.LOCAL_WRITE)
    raw.destroy(pd)
    raw.destroy(ctx)
    assert fabric.open_objects == 0


@pytest.mark.parametrize("bad", ["device", "gid"])
def test_failed_setup_leaks_nothing(bad: str) -> None:
    fabric = FakeFabric()
    fabric.add_device("rxe0")
    verbs = FakeVerbs(fabric)
    settings = RdmaConfig(gid_index=9) if bad == "gid" else S
    with pytest.raises(VerbsError):
        RdmaEndpoint(verbs, "nope" if bad == "device" else "rxe0", settings)
    _clean(fabric)


def test_completions_awaited_on_channel_fd() -> None:
    """next_completions sleeps on the completion channel until a completion arrives."""
    fabric = FakeFabric()
    verbs, tx, rx = _pair(fabric)
    src, dst = bytearray(4096), bytearray(4096)
    smr = tx.register("src", memoryview(src), Access.LOCAL_WRITE)
    dmr = rx.register("dst", memoryview(dst))
    _connect(tx, rx, b_mr=dmr)
    rx.fill_receives()
    assert tx.qp is not None and rx.cq is not None and tx.cq is not None
    txqp, rxcq = tx.qp, rx.cq

    async def main() -> tuple[list[Completion], float, list[Completion]]:
        assert await next_completions(verbs, rxcq, 0.05) == []  # times out, returns nothing
        async with trio.open_nursery() as n:

            async def later() -> None:
                await trio.sleep(0.1)
                verbs.post_write(txqp, Write(1, smr.addr, 8, smr.lkey, dmr.addr, dmr.rkey, 42))

            n.start_soon(later)
            t0 = trio.current_time()
            got = await next_completions(verbs, rxcq, 5)
            waited = trio.current_time() - t0
        return got, waited, verbs.poll(tx.cq, 4) if tx.cq else []

    got, waited, sent = trio.run(main)
    assert [c.imm for c in got] == [42] and 0.09 < waited < 2
    assert len(sent) == 1 and sent[0].ok
    tx.close()
    rx.close()
    _clean(fabric)
