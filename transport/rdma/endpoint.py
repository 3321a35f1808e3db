"""One side of an RC connection: device, PD, CQ, QP and the registrations, built and torn
down as a unit.

Construction is exception-safe (whatever was created is destroyed if a later step fails) and
``close`` destroys in dependency order (QP, then MRs, CQ, PD, device) exactly once, so neither
a failed setup nor a failed transfer leaks a registration or a queue pair.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from types import TracebackType

from xdc.transport.rdma.qpinfo import QpInfo
from xdc.transport.rdma.registry import MrRegistry
from xdc.transport.rdma.verbs import Access, Handle, Mr, PortInfo, Qp, Verbs, VerbsError

from xdc.config import RdmaConfig

REMOTE_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE
RECV_SINK_BYTES = 64  # what each posted receive points at; WRITE_WITH_IMM writes none of it


class RdmaEndpoint:
    def __init__(self, verbs: Verbs, device: str, settings: RdmaConfig) -> None:
        self.verbs = verbs
        self.settings = settings
        self.psn = secrets.randbelow(1 << 24)
        self.connected = False
        self.closed = False
        self._recv_posted = 0
        self.ctx: Handle | None = None
        self.pd: Handle | None = None
        self.cq: Handle | None = None
        self.qp: Qp | None = None
        self.mrs: MrRegistry | None = None
        self.sink_mr: Mr | None = None
        try:
            self.ctx = verbs.open(device)
            self.port: PortInfo = verbs.query_port(self.ctx, settings.port, settings.gid_index)
            self.pd = verbs.alloc_pd(self.ctx)
            self.mrs = MrRegistry(verbs, self.pd)
            depth = settings.max_inflight + settings.recv_depth
            self.cq = verbs.create_cq(self.ctx, depth)
            self.qp = verbs.create_qp(
                self.pd,
                self.cq,
                settings.max_inflight,
                settings.recv_depth,
                settings.port,
                settings.gid_index,
            )
            verbs.to_init(self.qp, REMOTE_ACCESS)
            self._sink = memoryview(bytearray(RECV_SINK_BYTES))
            self.sink_mr = self.mrs.register("recv-sink", self._sink, Access.LOCAL_WRITE)
        except BaseException:
            self.close()
            raise

    def _need(self) -> tuple[Qp, MrRegistry]:
        if self.closed or self.qp is None or self.mrs is None:
            raise VerbsError("endpoint is closed")
        return self.qp, self.mrs

    def register(self, name: str, buf: memoryview, access: Access = REMOTE_ACCESS) -> Mr:
        return self._need()[1].register(name, buf, access)

    def local_info(self, pool: str, mr: Mr | None = None) -> QpInfo:
        """What the peer needs to connect to us and, with ``mr``, to write into it."""
        qp, _ = self._need()
        return QpInfo(
            qp_num=qp.qp_num,
            psn=self.psn,
            gid=self.port.gid,
            lid=self.port.lid,
            mtu=self.port.mtu,
            rkey=mr.rkey if mr else 0,
            addr=mr.addr if mr else 0,
            length=mr.length if mr else 0,
            pool=pool,
        )

    def connect(self, remote: QpInfo) -> None:
        """INIT -> RTR -> RTS against the peer's advertised QP; path MTU is the smaller one."""
        qp, _ = self._need()
        if self.connected:
            raise VerbsError("endpoint is connected already")
        self.verbs.to_rtr(qp, remote, min(remote.mtu, self.port.mtu))
        self.verbs.to_rts(qp, self.psn)
        self.connected = True

    def fill_receives(self) -> None:
        """Keep ``recv_depth`` zero-length receives posted (one per expected WRITE_WITH_IMM)."""
        qp, _ = self._need()
        assert self.sink_mr is not None  # registered in __init__
        while self._recv_posted < self.settings.recv_depth:
            self.verbs.post_recv(qp, self._recv_posted, self.sink_mr)
            self._recv_posted += 1

    def receive_consumed(self) -> None:
        """A RECV_IMM (or its flush) completed: that receive is no longer posted."""
        self._recv_posted -= 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []

        def attempt(step: Callable[[], None]) -> None:
            try:
                step()
            except BaseException as exc:  # keep tearing down; report the first failure
                errors.append(exc)

        qp, mrs, cq, pd, ctx = self.qp, self.mrs, self.cq, self.pd, self.ctx
        if qp is not None:
            attempt(functools.partial(self.verbs.destroy, qp))
        if mrs is not None:
            attempt(mrs.close)
        for handle in (cq, pd, ctx):
            if handle is not None:
                attempt(functools.partial(self.verbs.destroy, handle))
        if errors:
            raise errors[0]

    def __enter__(self) -> RdmaEndpoint:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
