"""The thin verbs layer xdc needs, over pyverbs (or a fake with pyverbs' exact signatures).

Only what an RC write-with-immediate transport uses: open a device, PD, MR over an existing
buffer, CQ with a completion channel, RC QP through INIT -> RTR -> RTS, post zero-length
receives, post RDMA WRITE (with or without immediate), poll. ``PyverbsBackend`` talks to a
namespace of pyverbs classes; tests hand it a fake namespace (``fake.py``) whose classes take
the same arguments, so the translation code that will run against real hardware is the code
the device-less tests exercise. pyverbs is imported lazily: xdc runs without it.
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import socket
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from xdc.transport.rdma.qpinfo import MTUS, QpInfo

from xdc.errors import LocalConnectionError, RemoteConnectionError


class RdmaUnavailable(LocalConnectionError):
    """RDMA cannot be used here at all (no pyverbs, no device); the peer stays on TCP."""


class VerbsError(LocalConnectionError):
    """A verbs call failed; the transfer falls back to TCP after cleaning up."""


class RdmaLinkError(RemoteConnectionError):
    """The RC connection failed (error completion, stall); remaining chunks go over TCP."""


WC_WR_FLUSH_ERR = 5  # ibv_wc_status of work flushed from a queue pair in error


class Access(enum.IntFlag):
    """ibv_access_flags bits (same values as the kernel ABI)."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4


class WcKind(enum.Enum):
    WRITE = "write"  # our RDMA WRITE (with or without immediate) was placed remotely
    RECV_IMM = "recv_imm"  # a peer's WRITE_WITH_IMM landed in our memory
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Completion:
    wr_id: int
    status: int  # 0 = success; otherwise an ibv_wc_status
    kind: WcKind
    byte_len: int
    imm: int | None  # host byte order; only for RECV_IMM

    @property
    def ok(self) -> bool:
        return self.status == 0


@dataclass(frozen=True, slots=True)
class PortInfo:
    lid: int
    mtu: int  # active path MTU in bytes
    gid: bytes  # 16 bytes


@dataclass(eq=False)
class Handle:
    """A native verbs object (Context, PD, CQ) with its completion channel if any."""

    native: Any
    channel: Any = None


@dataclass(eq=False)
class Mr:
    native: Any
    addr: int
    length: int
    lkey: int
    rkey: int


@dataclass(eq=False)
class Qp:
    native: Any
    qp_num: int
    port: int
    gid_index: int


@dataclass(frozen=True, slots=True)
class Write:
    """One RDMA WRITE: ``length`` bytes from local ``addr`` to remote ``raddr``."""

    wr_id: int
    addr: int
    length: int
    lkey: int
    raddr: int
    rkey: int
    imm: int | None = None  # host order; None = plain WRITE (no receive consumed)


class Verbs(Protocol):
    def open(self, device: str) -> Handle: ...
    def query_port(self, ctx: Handle, port: int, gid_index: int) -> PortInfo: ...
    def alloc_pd(self, ctx: Handle) -> Handle: ...
    def reg_mr(self, pd: Handle, buf: memoryview, access: Access) -> Mr: ...
    def dereg_mr(self, mr: Mr) -> None: ...
    def create_cq(self, ctx: Handle, depth: int) -> Handle: ...
    def create_qp(
        self, pd: Handle, cq: Handle, send_depth: int, recv_depth: int, port: int, gid_index: int
    ) -> Qp: ...
    def to_init(self, qp: Qp, access: Access) -> None: ...
    def to_rtr(self, qp: Qp, remote: QpInfo, mtu: int) -> None: ...
    def to_rts(self, qp: Qp, psn: int) -> None: ...
    def post_recv(self, qp: Qp, wr_id: int, sink: Mr) -> None: ...
    def post_write(self, qp: Qp, wr: Write) -> None: ...
    def poll(self, cq: Handle, max_entries: int) -> list[Completion]: ...
    def completion_fd(self, cq: Handle) -> int | None: ...
    def arm(self, cq: Handle) -> None: ...
    def consume_event(self, cq: Handle) -> None: ...
    def destroy(self, obj: Handle | Qp) -> None: ...


def address_of(buf: memoryview) -> int:
    """Virtual address of a writable buffer's first byte (what ibv_reg_mr is given)."""
    if buf.readonly:
        raise VerbsError("RDMA buffers must be writable (registration pins them for DMA)")
    if len(buf) == 0:
        raise VerbsError("cannot register an empty buffer")
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@dataclass(frozen=True)
class PyverbsApi:
    """The pyverbs names the backend uses: real modules, or the fake in tests."""

    Context: Any
    PD: Any
    MR: Any
    CQ: Any
    CompChannel: Any
    QP: Any
    QPCap: Any
    QPInitAttr: Any
    QPAttr: Any
    GID: Any
    GlobalRoute: Any
    AHAttr: Any
    SGE: Any
    SendWR: Any
    RecvWR: Any
    QPT_RC: int
    WR_RDMA_WRITE: int
    WR_RDMA_WRITE_WITH_IMM: int
    SEND_SIGNALED: int
    WC_RDMA_WRITE: int
    WC_RECV_RDMA_WITH_IMM: int
    MTU: dict[int, int]  # bytes -> ibv_mtu


def _const(modules: list[ModuleType], name: str) -> int:
    """Find an ibv_* constant: module-level in older pyverbs, inside enum classes in newer."""
    for mod in modules:
        if hasattr(mod, name):
            return int(getattr(mod, name))
        for attr in vars(mod).values():
            if isinstance(attr, type) and hasattr(attr, name):
                return int(getattr(attr, name))
    raise RdmaUnavailable(f"pyverbs has no constant {name}")


def load_pyverbs() -> PyverbsApi:
    """Import pyverbs on first use; a missing install is a clear, catchable reason."""
    try:
        dev = importlib.import_module("pyverbs.device")
        pd = importlib.import_module("pyverbs.pd")
        mr = importlib.import_module("pyverbs.mr")
        cq = importlib.import_module("pyverbs.cq")
        qp = importlib.import_module("pyverbs.qp")
        wr = importlib.import_module("pyverbs.wr")
        addr = importlib.import_module("pyverbs.addr")
    except ImportError as exc:
        raise RdmaUnavailable(
            f"pyverbs not installed ({exc}); install rdma-core's python3-pyverbs "
            "or `pip install pyverbs`"
        ) from exc
    enums: list[ModuleType] = []
    for name in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
        try:
            enums.append(importlib.import_module(name))
        except ImportError:
            continue
    return PyverbsApi(
        Context=dev.Context,
        PD=pd.PD,
        MR=mr.MR,
        CQ=cq.CQ,
        CompChannel=cq.CompChannel,
        QP=qp.QP,
        QPCap=qp.QPCap,
        QPInitAttr=qp.QPInitAttr,
        QPAttr=qp.QPAttr,
        GID=addr.GID,
        GlobalRoute=addr.GlobalRoute,
        AHAttr=addr.AHAttr,
        SGE=wr.SGE,
        SendWR=wr.SendWR,
        RecvWR=wr.RecvWR,
        QPT_RC=_const(enums, "IBV_QPT_RC"),
        WR_RDMA_WRITE=_const(enums, "IBV_WR_RDMA_WRITE"),
        WR_RDMA_WRITE_WITH_IMM=_const(enums, "IBV_WR_RDMA_WRITE_WITH_IMM"),
        SEND_SIGNALED=_const(enums, "IBV_SEND_SIGNALED"),
        WC_RDMA_WRITE=_const(enums, "IBV_WC_RDMA_WRITE"),
        WC_RECV_RDMA_WITH_IMM=_const(enums, "IBV_WC_RECV_RDMA_WITH_IMM"),
        MTU={size: _const(enums, f"IBV_MTU_{size}") for size in MTUS},
    )


def gid_to_bytes(gid: Any) -> bytes:
    """pyverbs prints a GID as 'xxxx:xxxx:...:xxxx' (8 groups)."""
    raw = bytes.fromhex(str(gid).replace(":", ""))
    if len(raw) != 16:
        raise VerbsError(f"unexpected GID format {gid!s}")
    return raw


def gid_to_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def _wrap(call: str, exc: Exception) -> VerbsError:
    return VerbsError(f"{call} failed: {exc}")


class PyverbsBackend:
    """Verbs over a pyverbs namespace. Every native failure surfaces as VerbsError."""

    def __init__(self, api: PyverbsApi | None = None) -> None:
        self.api = api if api is not None else load_pyverbs()
        self._mtu_bytes = {v: k for k, v in self.api.MTU.items()}

    def open(self, device: str) -> Handle:
        try:
            return Handle(self.api.Context(name=device))
        except Exception as exc:
            raise _wrap(f"open device {device!r}", exc) from exc

    def query_port(self, ctx: Handle, port: int, gid_index: int) -> PortInfo:
        try:
            attr = ctx.native.query_port(port)
            gid = ctx.native.query_gid(port, gid_index)
        except Exception as exc:
            raise _wrap(f"query port {port}", exc) from exc
        return PortInfo(
            lid=int(attr.lid), mtu=self._mtu_bytes[int(attr.active_mtu)], gid=gid_to_bytes(gid)
        )

    def alloc_pd(self, ctx: Handle) -> Handle:
        try:
            return Handle(self.api.PD(ctx.native))
        except Exception as exc:
            raise _wrap("alloc PD", exc) from exc

    def reg_mr(self, pd: Handle, buf: memoryview, access: Access) -> Mr:
        addr = address_of(buf)
        try:
            mr = self.api.MR(pd.native, len(buf), int(access), address=addr)
        except Exception as exc:
            raise _wrap(f"register {len(buf)} bytes at {addr:#x}", exc) from exc
        return Mr(mr, addr, len(buf), int(mr.lkey), int(mr.rkey))

    def dereg_mr(self, mr: Mr) -> None:
        try:
            mr.native.close()
        except Exception as exc:
            raise _wrap("deregister MR", exc) from exc

    def create_cq(self, ctx: Handle, depth: int) -> Handle:
        channel = None
        try:
            channel = self.api.CompChannel(ctx.native)
            return Handle(self.api.CQ(ctx.native, depth, None, channel, 0), channel)
        except Exception as exc:
            if channel is not None:
                channel.close()
            raise _wrap(f"create CQ of {depth}", exc) from exc

    def create_qp(
        self, pd: Handle, cq: Handle, send_depth: int, recv_depth: int, port: int, gid_index: int
    ) -> Qp:
        cap = self.api.QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth)
        init = self.api.QPInitAttr(
            qp_type=self.api.QPT_RC, scq=cq.native, rcq=cq.native, cap=cap, sq_sig_all=1
        )
        try:
            qp = self.api.QP(pd.native, init)
        except Exception as exc:
            raise _wrap("create RC QP", exc) from exc
        return Qp(qp, int(qp.qp_num), port, gid_index)

    def to_init(self, qp: Qp, access: Access) -> None:
        attr = self.api.QPAttr(port_num=qp.port)
        attr.qp_access_flags = int(access)
        try:
            qp.native.to_init(attr)
        except Exception as exc:
            raise _wrap("QP -> INIT", exc) from exc

    def to_rtr(self, qp: Qp, remote: QpInfo, mtu: int) -> None:
        attr = self.api.QPAttr(port_num=qp.port, path_mtu=self.api.MTU[mtu])
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        gr = self.api.GlobalRoute(
            dgid=self.api.GID(gid_to_str(remote.gid)), sgid_index=qp.gid_index
        )
        attr.ah_attr = self.api.AHAttr(dlid=remote.lid, is_global=1, port_num=qp.port, gr=gr)
        try:
            qp.native.to_rtr(attr)
        except Exception as exc:
            raise _wrap("QP -> RTR", exc) from exc

    def to_rts(self, qp: Qp, psn: int) -> None:
        attr = self.api.QPAttr(port_num=qp.port)
        attr.sq_psn = psn
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 1
        try:
            qp.native.to_rts(attr)
        except Exception as exc:
            raise _wrap("QP -> RTS", exc) from exc

    def post_recv(self, qp: Qp, wr_id: int, sink: Mr) -> None:
        """A receive for one WRITE_WITH_IMM. It consumes no bytes, but pyverbs (like some
        providers) wants one valid SGE, so it points at a small registered sink."""
        sge = self.api.SGE(sink.addr, sink.length, sink.lkey)
        try:
            qp.native.post_recv(self.api.RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))
        except Exception as exc:
            raise _wrap("post receive", exc) from exc

    def post_write(self, qp: Qp, wr: Write) -> None:
        sge = self.api.SGE(wr.addr, wr.length, wr.lkey)
        if wr.imm is None:
            send = self.api.SendWR(
                wr_id=wr.wr_id, opcode=self.api.WR_RDMA_WRITE, num_sge=1, sg=[sge]
            )
        else:
            send = self.api.SendWR(
                wr_id=wr.wr_id,
                opcode=self.api.WR_RDMA_WRITE_WITH_IMM,
                num_sge=1,
                imm_data=socket.htonl(wr.imm),  # the wire carries it big-endian
                sg=[sge],
                send_flags=self.api.SEND_SIGNALED,
            )
        send.set_wr_rdma(wr.rkey, wr.raddr)
        try:
            qp.native.post_send(send)
        except Exception as exc:
            raise _wrap("post RDMA write", exc) from exc

    def poll(self, cq: Handle, max_entries: int) -> list[Completion]:
        try:
            _n, wcs = cq.native.poll(max_entries)
        except Exception as exc:
            raise _wrap("poll CQ", exc) from exc
        out = []
        for wc in wcs:
            opcode = int(wc.opcode)
            if opcode == self.api.WC_RECV_RDMA_WITH_IMM:
                kind, imm = WcKind.RECV_IMM, socket.ntohl(int(wc.imm_data))
            elif opcode == self.api.WC_RDMA_WRITE:
                kind, imm = WcKind.WRITE, None
            else:  # error completions carry no valid opcode
                kind, imm = WcKind.OTHER, None
            out.append(Completion(int(wc.wr_id), int(wc.status), kind, int(wc.byte_len), imm))
        return out

    def completion_fd(self, cq: Handle) -> int | None:
        """The completion channel's fd to sleep on; None where pyverbs does not expose it
        (CompChannel.fd arrived after rdma-core 44, e.g. Debian 12's python3-pyverbs)."""
        fd = getattr(cq.channel, "fd", None)
        return None if fd is None else int(fd)

    def arm(self, cq: Handle) -> None:
        try:
            cq.native.req_notify()
        except Exception as exc:
            raise _wrap("arm CQ", exc) from exc

    def consume_event(self, cq: Handle) -> None:
        try:
            cq.channel.get_cq_event(cq.native)
            cq.native.ack_events(1)
        except Exception as exc:
            raise _wrap("read CQ event", exc) from exc

    def destroy(self, obj: Handle | Qp) -> None:
        try:
            obj.native.close()
            if isinstance(obj, Handle) and obj.channel is not None:
                obj.channel.close()
        except Exception as exc:
            raise _wrap(f"close {type(obj.native).__name__}", exc) from exc
