"""An in-process RDMA fabric behind classes with pyverbs' constructor signatures.

``FakeVerbs`` is ``PyverbsBackend`` over this namespace, so the code that will drive a real
device is the code the tests run. The fake is deliberately strict where the hardware is strict
(QP state machine, PSN/QPN pairing, lkey/rkey bounds and access flags, send/receive queue and
CQ depths, receives consumed by WRITE_WITH_IMM, flush on error) and stricter where pyverbs is
forgiving but the forgiveness would hide a bookkeeping bug (deregistering twice, closing a PD
with live registrations): those are recorded in ``FakeFabric.violations`` for tests to assert
empty. WRITEs really copy bytes between registered buffers of this process (ctypes.memmove on
addresses validated against pinned registrations), so end-to-end data checks are real.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from xdc.transport.rdma.verbs import Access, Mr, PyverbsApi, PyverbsBackend

# Numeric values of the kernel ABI enums, as pyverbs exposes them
IBV_QPT_RC = 2
IBV_QPT_UD = 4
IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR = 0, 1, 2, 3, 6
IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND = 0, 1, 2
IBV_SEND_SIGNALED = 2
IBV_WC_RDMA_WRITE, IBV_WC_RECV_RDMA_WITH_IMM = 1, 129
IBV_WC_SUCCESS = 0
IBV_WC_LOC_PROT_ERR = 4
IBV_WC_WR_FLUSH_ERR = 5
IBV_WC_REM_ACCESS_ERR = 10
IBV_WC_RETRY_EXC_ERR = 12
IBV_WC_RNR_RETRY_EXC_ERR = 13
IBV_MTU = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
_ERR_OPCODE = 0xFF  # the opcode of an error completion is undefined; never rely on it


class FakeRdmaError(Exception):
    """Stands in for PyverbsRDMAError / PyverbsUserError."""


@dataclass
class FakeDevice:
    name: str
    gid: bytes
    lid: int
    mtu: int = 4096


@dataclass
class FakeFabric:
    devices: dict[str, FakeDevice] = field(default_factory=dict)
    qps: dict[tuple[bytes, int], FakeQP] = field(default_factory=dict)
    mrs: dict[int, FakeMR] = field(default_factory=dict)  # lkey (= rkey) -> live MR
    pinned: dict[int, tuple[int, Any]] = field(default_factory=dict)  # addr -> (len, export)
    violations: list[str] = field(default_factory=list)
    registered: int = 0
    deregistered: int = 0
    open_objects: int = 0  # contexts, PDs, CQs, channels and QPs not yet closed
    link_broken: bool = False  # every later WRITE fails with RETRY_EXC_ERR
    corrupt_writes: int = 0  # flip a byte in the next N delivered WRITEs
    channel_fd: bool = True  # False: CompChannel without .fd, like rdma-core 44's pyverbs
    _next_qpn: int = 0x11
    _next_key: int = 0x100

    def add_device(self, name: str, lid: int = 0, mtu: int = 4096) -> FakeDevice:
        idx = len(self.devices) + 1
        gid = bytes.fromhex("00000000000000000000ffff7f000000")[:15] + bytes([idx])
        dev = FakeDevice(name, gid, lid, mtu)
        self.devices[name] = dev
        return dev

    def new_qpn(self) -> int:
        self._next_qpn += 1
        return self._next_qpn

    def new_key(self) -> int:
        self._next_key += 0x101
        return self._next_key

    def pinned_covers(self, addr: int, length: int) -> bool:
        return any(a <= addr and addr + length <= a + n for a, (n, _e) in self.pinned.items())

    @property
    def live_registrations(self) -> int:
        return len(self.mrs)


class _Obj:
    fabric: FakeFabric
    closed = False

    def _opened(self) -> None:
        self.fabric.open_objects += 1

    def _closing(self) -> bool:
        if self.closed:
            return False
        self.closed = True
        self.fabric.open_objects -= 1
        return True


class FakeContext(_Obj):
    fabric: FakeFabric  # bound per fabric by fake_api()

    def __init__(self, **kwargs: Any) -> None:
        name = kwargs.get("name")
        dev = self.fabric.devices.get(str(name))
        if dev is None:
            raise FakeRdmaError(f"No IB devices found with name {name}")
        self.device = dev
        self.name = name
        self._opened()

    def query_port(self, port_num: int) -> Any:
        if port_num != 1:
            raise FakeRdmaError(f"Failed to query port {port_num}")
        return _Attrs(lid=self.device.lid, active_mtu=IBV_MTU[self.device.mtu], state=4)

    def query_gid(self, port_num: int, index: int) -> FakeGID:
        if port_num != 1 or index not in (0, 1):
            raise FakeRdmaError(f"Failed to query gid {index} of port {port_num}")
        return FakeGID(_gid_str(self.device.gid))

    def close(self) -> None:
        self._closing()


class _Attrs:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


class FakeGID:
    def __init__(self, val: str | None = None) -> None:
        self.raw = bytes(16) if val is None else bytes.fromhex(val.replace(":", ""))
        if len(self.raw) != 16:
            raise FakeRdmaError(f"bad GID {val!r}")

    def __str__(self) -> str:
        return _gid_str(self.raw)


class FakePD(_Obj):
    def __init__(self, creator: Any, **kwargs: Any) -> None:
        if not isinstance(creator, FakeContext) or creator.closed:
            raise FakeRdmaError("PD creator must be an open Context")
        self.fabric = creator.fabric
        self.ctx = creator
        self.mrs: set[FakeMR] = set()
        self._opened()

    def close(self) -> None:
        if not self._closing():
            return
        if self.mrs:  # pyverbs would close them for us; a correct caller never relies on it
            self.fabric.violations.append(f"PD closed with {len(self.mrs)} MR(s) registered")
            for mr in list(self.mrs):
                mr.close()


class FakeMR:
    def __init__(
        self,
        creator: Any,
        length: int = 0,
        access: int = 0,
        address: int | None = None,
        implicit: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(creator, FakePD) or creator.closed:
            raise FakeRdmaError("MR creator must be an open PD")
        if implicit or kwargs:
            raise FakeRdmaError("the fake supports only explicit registrations")
        if not address or length <= 0:
            # pyverbs would allocate its own buffer here; xdc always registers its pool
            raise FakeRdmaError(
                f"Failed to register a MR. length: {length}, access flags: {access}"
            )
        fabric = creator.fabric
        if not fabric.pinned_covers(address, length):
            raise FakeRdmaError(f"Failed to register a MR at {address:#x}: EFAULT (not mapped)")
        if access & Access.REMOTE_WRITE and not access & Access.LOCAL_WRITE:
            raise FakeRdmaError("EINVAL: REMOTE_WRITE requires LOCAL_WRITE")
        self.fabric = fabric
        self.pd = creator
        self.buf = address
        self.length = length
        self.access = access
        self.lkey = self.rkey = fabric.new_key()
        self.closes = 0
        fabric.mrs[self.lkey] = self
        fabric.registered += 1
        creator.mrs.add(self)

    def close(self) -> None:
        self.closes += 1
        if self.closes > 1:
            self.fabric.violations.append(f"MR {self.lkey:#x} deregistered {self.closes} times")
            return
        self.fabric.mrs.pop(self.lkey, None)
        self.fabric.deregistered += 1
        self.pd.mrs.discard(self)

    def covers(self, addr: int, length: int) -> bool:
        return self.buf <= addr and addr + length <= self.buf + self.length


class FakeCompChannel(_Obj):
    def __init__(self, context: Any) -> None:
        self.fabric = context.fabric
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._opened()

    @property
    def fd(self) -> int:
        if not self.fabric.channel_fd:
            raise AttributeError("'CompChannel' object has no attribute 'fd' (pyverbs < 59)")
        return self._r

    def notify(self) -> None:
        os.write(self._w, b"\x01")

    def get_cq_event(self, expected_cq: Any) -> None:
        try:
            os.read(self._r, 1)
        except BlockingIOError:
            raise FakeRdmaError("Failed to get CQ event (none pending)") from None
        expected_cq.num_events += 1

    def close(self) -> None:
        if self._closing():
            os.close(self._r)
            os.close(self._w)


class FakeWC:
    def __init__(
        self,
        wr_id: int = 0,
        status: int = 0,
        opcode: int = 0,
        vendor_err: int = 0,
        byte_len: int = 0,
        qp_num: int = 0,
        src_qp: int = 0,
        imm_data: int = 0,
        wc_flags: int = 0,
        pkey_index: int = 0,
        slid: int = 0,
        sl: int = 0,
        dlid_path_bits: int = 0,
    ) -> None:
        self.wr_id, self.status, self.opcode = wr_id, status, opcode
        self.byte_len, self.qp_num, self.imm_data = byte_len, qp_num, imm_data
        self.owner: FakeQP | None = None  # fake only: the QP whose send slot this frees


class FakeCQ(_Obj):
    def __init__(
        self,
        context: Any,
        cqe: int,
        cq_context: Any = None,
        channel: Any = None,
        comp_vector: int = 0,
    ) -> None:
        if cqe < 1:
            raise FakeRdmaError("Failed to create a CQ")
        self.fabric = context.fabric
        self.cqe = cqe
        self.channel = channel
        self.entries: deque[FakeWC] = deque()
        self.armed = False
        self.num_events = 0
        self.overrun = False
        self._opened()

    def push(self, wc: FakeWC) -> None:
        if len(self.entries) >= self.cqe:
            self.overrun = True
            self.fabric.violations.append(f"CQ overrun (depth {self.cqe})")
            return
        self.entries.append(wc)
        if self.armed and self.channel is not None:
            self.armed = False
            self.channel.notify()

    def poll(self, num_entries: int = 1) -> tuple[int, list[FakeWC]]:
        if self.overrun:
            raise FakeRdmaError("Failed to poll CQ (overrun)")
        out: list[FakeWC] = []
        while self.entries and len(out) < num_entries:
            wc = self.entries.popleft()
            if wc.owner is not None:  # polling a send completion frees its send-queue slot
                wc.owner.send_outstanding -= 1
            out.append(wc)
        return len(out), out

    def req_notify(self, solicited_only: bool = False) -> None:
        self.armed = True

    def ack_events(self, num_events: int) -> None:
        self.num_events -= num_events

    def close(self) -> None:
        self._closing()


class FakeQPCap:
    def __init__(
        self,
        max_send_wr: int = 1,
        max_recv_wr: int = 10,
        max_send_sge: int = 1,
        max_recv_sge: int = 1,
        max_inline_data: int = 0,
    ) -> None:
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge = max_send_sge, max_recv_sge


class FakeQPInitAttr:
    def __init__(
        self,
        qp_type: int = IBV_QPT_UD,
        qp_context: Any = None,
        scq: Any = None,
        rcq: Any = None,
        srq: Any = None,
        cap: Any = None,
        sq_sig_all: int = 1,
    ) -> None:
        self.qp_type, self.scq, self.rcq = qp_type, scq, rcq
        self.cap = cap if cap is not None else FakeQPCap()
        self.sq_sig_all = sq_sig_all


class FakeQPAttr:
    def __init__(
        self,
        qp_state: int = IBV_QPS_INIT,
        cur_qp_state: int = IBV_QPS_RESET,
        port_num: int = 1,
        path_mtu: int = IBV_MTU[1024],
    ) -> None:
        self.qp_state, self.port_num, self.path_mtu = qp_state, port_num, path_mtu
        self.dest_qp_num = 0
        self.rq_psn = self.sq_psn = 0
        self.qp_access_flags = 0
        self.ah_attr: Any = None
        self.max_dest_rd_atomic = self.max_rd_atomic = self.min_rnr_timer = 0
        self.timeout = self.retry_cnt = self.rnr_retry = 0


class FakeGlobalRoute:
    def __init__(
        self,
        dgid: Any = None,
        flow_label: int = 0,
        sgid_index: int = 0,
        hop_limit: int = 1,
        traffic_class: int = 0,
    ) -> None:
        self.dgid, self.sgid_index = dgid, sgid_index


class FakeAHAttr:
    def __init__(
        self,
        dlid: int = 0,
        sl: int = 0,
        src_path_bits: int = 0,
        static_rate: int = 0,
        is_global: int = 0,
        port_num: int = 1,
        gr: Any = None,
    ) -> None:
        self.dlid, self.is_global, self.port_num, self.gr = dlid, is_global, port_num, gr


class FakeSGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class FakeSendWR:
    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = IBV_WR_SEND,
        num_sge: int = 0,
        imm_data: int = 0,
        sg: Any = None,
        send_flags: int = IBV_SEND_SIGNALED,
        next_wr: Any = None,
    ) -> None:
        if num_sge < 1 or sg is None:
            raise FakeRdmaError("A WR needs at least one SGE")
        if len(sg) != num_sge:
            raise FakeRdmaError(f"num_sge {num_sge} but {len(sg)} SGEs given")
        self.wr_id, self.opcode, self.imm_data = wr_id, opcode, imm_data
        self.sg, self.send_flags = list(sg), send_flags
        self.rkey: int | None = None
        self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class FakeRecvWR:
    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: Any = None, next_wr: Any = None):
        if num_sge < 1 or sg is None:  # pyverbs' own rule (wr.pyx), even for WRITE_WITH_IMM
            raise FakeRdmaError("A WR needs at least one SGE")
        if len(sg) != num_sge:
            raise FakeRdmaError(f"num_sge {num_sge} but {len(sg)} SGEs given")
        self.wr_id = wr_id
        self.sg = list(sg)


class FakeQP(_Obj):
    def __init__(self, creator: Any, init_attr: Any, qp_attr: Any = None) -> None:
        if not isinstance(creator, FakePD) or creator.closed:
            raise FakeRdmaError("QP creator must be an open PD")
        if init_attr.qp_type != IBV_QPT_RC:
            raise FakeRdmaError("the fake implements RC queue pairs only")
        if init_attr.scq is None or init_attr.rcq is None:
            raise FakeRdmaError("Failed to create QP: send and receive CQ required")
        self.fabric = creator.fabric
        self.pd = creator
        self.gid = creator.ctx.device.gid
        self.mtu_limit = creator.ctx.device.mtu
        self.qp_num = self.fabric.new_qpn()
        self.scq: FakeCQ = init_attr.scq
        self.rcq: FakeCQ = init_attr.rcq
        self.cap = init_attr.cap
        self.qp_state = IBV_QPS_RESET
        self.access = 0
        self.dest: tuple[bytes, int] | None = None
        self.sq_psn = self.rq_psn = 0
        self.mtu = 0
        self.recvs: deque[int] = deque()
        # WRITE_WITH_IMMs of peers that found no receive posted: with rnr_retry 7 (infinite)
        # the requester keeps retrying, so they complete when a receive is posted
        self.rnr_waiting: deque[tuple[FakeQP, Any]] = deque()
        self.rnr_retry = 0
        self.send_outstanding = 0
        self.fabric.qps[(self.gid, self.qp_num)] = self
        self._opened()
        if qp_attr is not None:
            self.to_init(qp_attr)

    def to_init(self, qp_attr: Any) -> None:
        if self.qp_state not in (IBV_QPS_RESET, IBV_QPS_INIT):
            raise FakeRdmaError("Failed to modify QP state to init")
        self.access = qp_attr.qp_access_flags
        self.qp_state = IBV_QPS_INIT

    def to_rtr(self, qp_attr: Any) -> None:
        if self.qp_state != IBV_QPS_INIT:
            self.to_init(qp_attr)
        ah = qp_attr.ah_attr
        if not qp_attr.dest_qp_num or ah is None or ah.gr is None or ah.gr.dgid is None:
            raise FakeRdmaError("Failed to modify QP state to RTR (no destination)")
        mtu_bytes = {v: k for k, v in IBV_MTU.items()}.get(qp_attr.path_mtu, 0)
        if not mtu_bytes or mtu_bytes > self.mtu_limit:
            raise FakeRdmaError("Failed to modify QP state to RTR (bad path MTU)")
        self.dest = (ah.gr.dgid.raw, qp_attr.dest_qp_num)
        self.rq_psn = qp_attr.rq_psn
        self.mtu = mtu_bytes
        self.qp_state = IBV_QPS_RTR

    def to_rts(self, qp_attr: Any) -> None:
        if self.qp_state != IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        self.sq_psn = qp_attr.sq_psn
        self.rnr_retry = qp_attr.rnr_retry
        self.qp_state = IBV_QPS_RTS

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        if self.closed or self.qp_state == IBV_QPS_RESET:
            raise FakeRdmaError("Failed to post recv (QP in RESET)")
        if self.qp_state == IBV_QPS_ERR:
            self.rcq.push(FakeWC(wr.wr_id, IBV_WC_WR_FLUSH_ERR, _ERR_OPCODE, qp_num=self.qp_num))
            return
        if len(self.recvs) >= self.cap.max_recv_wr:
            raise FakeRdmaError("Failed to post recv (ENOMEM: receive queue full)")
        for sge in wr.sg:
            mr = self.fabric.mrs.get(sge.lkey)
            if mr is None or not mr.buf <= sge.addr <= sge.addr + sge.length <= mr.buf + mr.length:
                raise FakeRdmaError(
                    f"receive SGE {sge.addr:#x}+{sge.length} not in MR {sge.lkey:#x}"
                )
        self.recvs.append(wr.wr_id)
        while self.rnr_waiting and (
            self.recvs or self.rnr_waiting[0][1].opcode != IBV_WR_RDMA_WRITE_WITH_IMM
        ):
            sender, waiting = self.rnr_waiting.popleft()
            status = sender._deliver(waiting, resume=True)
            assert status is not None
            sender._complete(waiting, status)

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        if self.closed or self.qp_state not in (IBV_QPS_RTS, IBV_QPS_ERR):
            raise FakeRdmaError("Failed to post send (QP not in RTS)")
        if self.send_outstanding >= self.cap.max_send_wr:
            raise FakeRdmaError("Failed to post send (ENOMEM: send queue full)")
        if wr.rkey is None or wr.opcode not in (IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM):
            raise FakeRdmaError("the fake implements RDMA WRITE (with immediate) only")
        self.send_outstanding += 1
        status = IBV_WC_WR_FLUSH_ERR if self.qp_state == IBV_QPS_ERR else self._deliver(wr)
        if status is not None:
            self._complete(wr, status)

    def _complete(self, wr: Any, status: int) -> None:
        wc = FakeWC(
            wr.wr_id,
            status,
            IBV_WC_RDMA_WRITE if status == IBV_WC_SUCCESS else _ERR_OPCODE,
            qp_num=self.qp_num,
        )
        if status != IBV_WC_SUCCESS:
            self._to_error()
        wc.owner = self
        self.scq.push(wc)

    def _deliver(self, wr: Any, resume: bool = False) -> int | None:
        """Execute a WRITE; its completion status, or None while it waits for a receive."""
        fabric = self.fabric
        if fabric.link_broken or self.dest is None:
            return IBV_WC_RETRY_EXC_ERR
        peer = fabric.qps.get(self.dest)
        if (
            peer is None
            or peer.closed
            or peer.qp_state not in (IBV_QPS_RTR, IBV_QPS_RTS)
            or peer.dest != (self.gid, self.qp_num)
        ):
            return IBV_WC_RETRY_EXC_ERR  # nobody answers: the requester retries, then gives up
        if peer.rq_psn != self.sq_psn:
            fabric.violations.append(
                f"PSN mismatch: QP {self.qp_num:#x} sends {self.sq_psn}, peer expects {peer.rq_psn}"
            )
            return IBV_WC_RETRY_EXC_ERR
        if not resume and self.rnr_blocked(peer):
            peer.rnr_waiting.append((self, wr))  # RC keeps order: wait behind the blocked one
            return None
        length = sum(s.length for s in wr.sg)
        for sge in wr.sg:
            mr = fabric.mrs.get(sge.lkey)
            if mr is None or mr.pd is not self.pd or not mr.covers(sge.addr, sge.length):
                return IBV_WC_LOC_PROT_ERR
        rmr = fabric.mrs.get(wr.rkey)
        if (
            rmr is None
            or rmr.pd is not peer.pd
            or not rmr.covers(wr.remote_addr, length)
            or not rmr.access & Access.REMOTE_WRITE
            or not peer.access & Access.REMOTE_WRITE
        ):
            peer._to_error()
            return IBV_WC_REM_ACCESS_ERR
        if wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM and not peer.recvs:
            if self.rnr_retry == 7:
                peer.rnr_waiting.append((self, wr))
                return None
            return IBV_WC_RNR_RETRY_EXC_ERR
        dst = wr.remote_addr
        for sge in wr.sg:
            ctypes.memmove(dst, sge.addr, sge.length)
            dst += sge.length
        if fabric.corrupt_writes and length:
            fabric.corrupt_writes -= 1
            byte = ctypes.c_ubyte.from_address(wr.remote_addr + length // 2)
            byte.value ^= 0x5A
        packets = max(1, -(-length // peer.mtu))
        self.sq_psn = (self.sq_psn + packets) & 0xFFFFFF
        peer.rq_psn = (peer.rq_psn + packets) & 0xFFFFFF
        if wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM:
            rid = peer.recvs.popleft()
            peer.rcq.push(
                FakeWC(
                    rid,
                    IBV_WC_SUCCESS,
                    IBV_WC_RECV_RDMA_WITH_IMM,
                    byte_len=length,
                    qp_num=peer.qp_num,
                    imm_data=wr.imm_data,
                )
            )
        return IBV_WC_SUCCESS

    def rnr_blocked(self, peer: FakeQP) -> bool:
        return any(q is self for q, _wr in peer.rnr_waiting)

    def _drop_waiters(self) -> None:
        while self.rnr_waiting:  # nobody will answer them any more
            sender, waiting = self.rnr_waiting.popleft()
            sender._complete(waiting, IBV_WC_RETRY_EXC_ERR)

    def _to_error(self) -> None:
        if self.qp_state == IBV_QPS_ERR:
            return
        self.qp_state = IBV_QPS_ERR
        self._drop_waiters()
        while self.recvs:  # outstanding receives complete with FLUSH_ERR, as on hardware
            self.rcq.push(
                FakeWC(self.recvs.popleft(), IBV_WC_WR_FLUSH_ERR, _ERR_OPCODE, qp_num=self.qp_num)
            )

    def close(self) -> None:
        if self._closing():
            self.fabric.qps.pop((self.gid, self.qp_num), None)
            self._drop_waiters()
            for other in self.fabric.qps.values():  # our writes parked at a peer die with us
                other.rnr_waiting = deque(e for e in other.rnr_waiting if e[0] is not self)


def fake_api(fabric: FakeFabric) -> PyverbsApi:
    """A pyverbs namespace whose objects live in ``fabric``."""
    context = type("Context", (FakeContext,), {"fabric": fabric})
    return PyverbsApi(
        Context=context,
        PD=FakePD,
        MR=FakeMR,
        CQ=FakeCQ,
        CompChannel=FakeCompChannel,
        QP=FakeQP,
        QPCap=FakeQPCap,
        QPInitAttr=FakeQPInitAttr,
        QPAttr=FakeQPAttr,
        GID=FakeGID,
        GlobalRoute=FakeGlobalRoute,
        AHAttr=FakeAHAttr,
        SGE=FakeSGE,
        SendWR=FakeSendWR,
        RecvWR=FakeRecvWR,
        QPT_RC=IBV_QPT_RC,
        WR_RDMA_WRITE=IBV_WR_RDMA_WRITE,
        WR_RDMA_WRITE_WITH_IMM=IBV_WR_RDMA_WRITE_WITH_IMM,
        SEND_SIGNALED=IBV_SEND_SIGNALED,
        WC_RDMA_WRITE=IBV_WC_RDMA_WRITE,
        WC_RECV_RDMA_WITH_IMM=IBV_WC_RECV_RDMA_WITH_IMM,
        MTU=dict(IBV_MTU),
    )


class FakeVerbs(PyverbsBackend):
    """PyverbsBackend over a FakeFabric; registration pins the buffer like the kernel does.

    The pin is a live export of the buffer, so an mmap cannot be unmapped under a registration
    that was never deregistered (Segment.close then leaves the mapping, and the leak shows in
    ``fabric.live_registrations``) instead of a WRITE landing in unmapped memory.
    """

    def __init__(self, fabric: FakeFabric | None = None) -> None:
        self.fabric = fabric if fabric is not None else FakeFabric()
        super().__init__(fake_api(self.fabric))

    def reg_mr(self, pd: Any, buf: memoryview, access: Access) -> Mr:
        export = (ctypes.c_char * len(buf)).from_buffer(buf) if not buf.readonly else None
        addr = ctypes.addressof(export) if export is not None else 0
        if export is not None:
            self.fabric.pinned[addr] = (len(buf), export)
        try:
            return super().reg_mr(pd, buf, access)
        except BaseException:
            self._unpin(addr)
            raise

    def dereg_mr(self, mr: Mr) -> None:
        try:
            super().dereg_mr(mr)
        finally:
            if not any(m.buf == mr.addr for m in self.fabric.mrs.values()):
                self._unpin(mr.addr)

    def _unpin(self, addr: int) -> None:
        with contextlib.suppress(KeyError):
            del self.fabric.pinned[addr]
