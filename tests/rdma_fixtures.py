"""RDMA daemon rigs: a real Sender and Receiver in one trio run over the fake verbs fabric
(xdc/lab/fake_verbs.py), their payloads, checks and fault gates."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio
from xdc.transport.engine_client import DecodeClient, Outcome, PrefillClient, TransferError
from xdc.transport.launcher import local_pair_config
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.rdma.verbs import RdmaUnavailable, Verbs
from xdc.transport.receiver import Receiver
from xdc.transport.sender import PeerLink, Sender
from xdc.transport.wire import WireConn

from xdc.config import Config, RdmaConfig
from xdc.lab.fake_verbs import FakeFabric, FakeQP, FakeVerbs

RDMA = RdmaConfig(
    enabled=True,
    domain="pd-a",
    max_inflight=16,
    recv_depth=64,
    verify_every=4,
    stall_timeout_s=1.0,
)


LAYERS = [300_000, 0, 70_000, 250_000, 4096, 123_457]


def new_fabric() -> FakeFabric:
    fabric = FakeFabric()
    fabric.add_device("rxe0")
    fabric.add_device("rxe1")
    return fabric


class Rig:
    def __init__(self, sender: Sender, receiver: Receiver, fabric: FakeFabric | None) -> None:
        self.sender = sender
        self.receiver = receiver
        self.fabric = fabric

    @property
    def peer(self) -> PeerLink:
        return next(iter(self.sender.peers.values()))

    def backend(self) -> str:
        return str(self.sender.status()["peers"][self.peer.name]["rdma"]["backend"])

    async def negotiated(self, timeout: float = 5.0) -> dict[str, object]:
        """The sender's RDMA status once it has decided (either way) for this receiver."""
        with trio.fail_after(timeout):
            while self.peer.rdma is not None and self.peer.rdma.tried_session is None:
                await trio.sleep(0.01)
            while self.peer.rdma is not None and self.peer.rdma.reason == "not negotiated yet":
                await trio.sleep(0.01)
        status: dict[str, object] = self.sender.status()["peers"][self.peer.name]["rdma"]
        return status

    async def ship(self, payloads: dict[str, list[bytes]]) -> dict[str, Outcome]:
        """The engines' side of a transfer (``send_payloads`` in a thread): each request's
        layers handed over, and what arrived checked against ``payloads``."""
        outcomes: dict[str, Outcome] = await in_engine_thread(
            send_payloads, self.receiver.rc.control_socket, self.sender.sc.control_socket, payloads
        )
        return outcomes

    async def until(self, cond: Callable[[], bool], timeout: float = 5.0) -> None:
        with trio.fail_after(timeout):
            while not cond():
                await trio.sleep(0.01)


async def with_daemons(
    tmp_path: Path,
    body: Callable[[Rig], Awaitable[None]],
    *,
    tx_rdma: RdmaConfig = RDMA,
    rx_rdma: RdmaConfig = RDMA,
    fabric: FakeFabric | None = None,
    tx_devices: list[str] | None = None,
    rx_devices: list[str] | None = None,
    verbs_factory: Callable[[], Verbs] | None = None,
    rx_deadline_s: float | None = None,
    before_start: Callable[[Rig], None] | None = None,
) -> Rig:
    tx, rx, _ = local_pair_config(
        tmp_path, connections=2, chunk_bytes=64 << 10, send_pool=8 << 20, recv_pool=16 << 20
    )
    if rx_deadline_s is not None:
        rx.receiver.transfer_deadline_s = rx_deadline_s
        # its own limit: the sender's KEEPs hold the window of a request it still holds
        rx.receiver.transfer_max_s = rx_deadline_s
    tx.rdma, rx.rdma = tx_rdma, rx_rdma
    tx.node.shutdown_drain_s = rx.node.shutdown_drain_s = 1.0
    verbs = FakeVerbs(fabric) if fabric is not None else None

    def factory() -> Verbs:
        if verbs_factory is not None:
            return verbs_factory()
        if verbs is None:
            raise RdmaUnavailable("this rig has no fake fabric")
        return verbs

    rx_found = ["rxe1"] if rx_devices is None else rx_devices
    tx_found = ["rxe0"] if tx_devices is None else tx_devices
    receiver = Receiver(rx, rdma=RdmaDeps(factory, lambda: (rx_found, "test probe")))
    sender = Sender(tx, rdma=RdmaDeps(factory, lambda: (tx_found, "test probe")))
    rig = Rig(sender, receiver, fabric)
    if before_start is not None:
        before_start(rig)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(receiver.serve)
            await n.start(sender.serve)
            await body(rig)
            n.cancel_scope.cancel()
    return rig


def make_payloads(n: int) -> dict[str, list[bytes]]:
    return {
        f"req-{i}-{secrets.token_hex(3)}": [secrets.token_bytes(s) for s in LAYERS]
        for i in range(n)
    }


def send_payloads(
    rx_sock: str, tx_sock: str, payloads: dict[str, list[bytes]]
) -> dict[str, Outcome]:
    """Prefill engine: hand every request's layers over one by one; decode engine: check."""
    with PrefillClient(tx_sock) as pc:
        transfers = {rid: pc.begin(rid, LAYERS) for rid in payloads}
        for layer in range(len(LAYERS)):
            for rid, t in transfers.items():
                t.put_layer(layer, payloads[rid][layer])
        outcomes = {rid: t.wait(30) for rid, t in transfers.items()}
    check_delivered(rx_sock, payloads)
    return outcomes


def check_delivered(rx_sock: str, payloads: dict[str, list[bytes]]) -> None:
    with DecodeClient(rx_sock) as dc:
        for rid, layers in payloads.items():
            got = dc.await_request(rid, timeout=10)
            for i, data in enumerate(layers):
                assert got.layer(i).tobytes() == data, f"{rid} layer {i} differs"
            got.release()


def rdma_state(sender: Sender, rid: str) -> Any:
    """A live request's RDMA bookkeeping on the sender (grant, confirmed layers), or None."""
    req = sender.requests.get(rid)
    if req is None or not isinstance(req.peer, PeerLink):
        return None
    return sender.paths[req.peer].state(rid)


def path_name(sender: Sender, rid: str) -> str:
    """Which data path a live request is on ("tcp" or "rdma"); "" once it ended."""
    req = sender.requests.get(rid)
    return sender.path(req).name if req is not None else ""


def rdma_done(sender: Sender, rid: str) -> set[int]:
    """Layers of an RDMA request the receiver has confirmed (empty once it ended)."""
    st = rdma_state(sender, rid)
    return set(st.done) if st is not None else set()


def is_granted(sender: Sender, rid: str) -> bool:
    st = rdma_state(sender, rid)
    return st is not None and st.grant is not None


def assert_no_leaks(fabric: FakeFabric) -> None:
    assert fabric.violations == []
    assert fabric.live_registrations == 0
    assert fabric.registered == fabric.deregistered > 0
    assert fabric.open_objects == 0


# A stall timeout long enough that a test holding WRITEs in flight on purpose (for well under
# a second) is never mistaken for a dead link.
PATIENT = replace(RDMA, stall_timeout_s=3.0)


async def daemon_pair(
    tmp_path: Path,
    body: Callable[[Rig], Awaitable[None]],
    *,
    fabric: FakeFabric,
    tx_rdma: RdmaConfig = RDMA,
    rx_rdma: RdmaConfig = RDMA,
    chunk_bytes: int = 64 << 10,
    send_pool: int = 8 << 20,
    recv_pool: int = 16 << 20,
    configure: Callable[[Config, Config], None] | None = None,
    before_start: Callable[[Rig], None] | None = None,
    timeout: float = 30.0,
) -> Rig:
    """Both daemons over ``fabric``; ``body`` runs while they serve, then both are stopped."""
    tx, rx, _ = local_pair_config(
        tmp_path,
        connections=2,
        chunk_bytes=chunk_bytes,
        send_pool=send_pool,
        recv_pool=recv_pool,
    )
    tx.rdma, rx.rdma = tx_rdma, rx_rdma
    tx.node.shutdown_drain_s = rx.node.shutdown_drain_s = 1.0
    if configure is not None:
        configure(tx, rx)
    verbs = FakeVerbs(fabric)
    receiver = Receiver(rx, rdma=RdmaDeps(lambda: verbs, lambda: (["rxe1"], "test probe")))
    sender = Sender(tx, rdma=RdmaDeps(lambda: verbs, lambda: (["rxe0"], "test probe")))
    rig = Rig(sender, receiver, fabric)
    if before_start is not None:
        before_start(rig)
    try:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as n:
                await n.start(receiver.serve)
                await n.start(sender.serve)
                await _tagged(body(rig))
                n.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _raise_crash(group)
        raise
    return rig


class DaemonCrashed(Exception):
    """An exception other than the test's own assertions escaped a daemon's nursery."""


async def _tagged(work: Awaitable[None]) -> None:
    """Mark what the test body (or its engine threads) raised: a failure, not a crash."""
    try:
        await work
    except Exception as exc:
        pending: list[BaseException] = [exc]
        while pending:
            e = pending.pop()
            if isinstance(e, BaseExceptionGroup):
                pending.extend(e.exceptions)
            else:
                e.from_test_body = True  # type: ignore[attr-defined]
        raise


def _raise_crash(group: BaseExceptionGroup[BaseException]) -> None:
    def crash(e: BaseException) -> bool:
        expected = (AssertionError, trio.TooSlowError, trio.Cancelled, TransferError)
        if getattr(e, "from_test_body", False):
            return False
        return not isinstance(e, (BaseExceptionGroup, *expected))

    crashed, _rest = group.split(crash)
    if crashed is not None:
        leaves = []
        pending: list[BaseException] = [crashed]
        while pending:
            e = pending.pop()
            if isinstance(e, BaseExceptionGroup):
                pending.extend(e.exceptions)
            else:
                leaves.append(f"{type(e).__name__}: {e}")
        raise DaemonCrashed("; ".join(leaves)) from group


async def in_engine_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking engine function in a thread. Abandoned if a daemon crashes, so the
    crash surfaces at once instead of after the engine's socket timeouts."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args), abandon_on_cancel=True)


def _address(view: memoryview) -> int:
    # the same computation as verbs.address_of, with the ctypes export dropped at once
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _overlap(a: int, n: int, b: int, m: int) -> bool:
    return a < b + m and b < a + n


class FreeGuard:
    """Checks, at every free of either pool, that no WRITE that can still read or land there
    is in flight: the sender's source bytes while its QP lives, the receiver's request bytes
    (and checksum tables) while a live receiver QP is connected to the writing QP."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.errors: list[str] = []
        self.checked = 0
        tx_free, rx_free = rig.sender.pool.free, rig.receiver.pool.free
        tx_base = _address(rig.sender.pool.view)
        rx_base = _address(rig.receiver.pool.view)

        def sender_free(offset: int) -> None:
            self._check_sender(tx_base + offset, rig.sender.pool.allocator._used[offset])
            tx_free(offset)

        def receiver_free(offset: int) -> None:
            self._check_receiver(rx_base + offset, rig.receiver.pool.allocator._used[offset])
            rx_free(offset)

        rig.sender.pool.free = sender_free  # type: ignore[method-assign]
        rig.receiver.pool.free = receiver_free  # type: ignore[method-assign]

    def _writes(self) -> list[tuple[FakeQP, int, int, int, int]]:
        """(sender QP, source addr, remote addr, length, is data) of every WRITE not
        completed (a checksum WRITE's source is the staging area, not the pool)."""
        out = []
        for peer in self.rig.sender.peers.values():
            rdma = peer.rdma
            if rdma is None or rdma.writer is None or rdma.ep is None or rdma.ep.qp is None:
                continue
            qp: FakeQP = rdma.ep.qp.native
            for req, index, staging in rdma.writer._inflight.values():
                if staging is not None:  # an 8-byte checksum WRITE from the staging area
                    entry = req.grant.sums_addr + 8 * (index // req.grant.verify_every)
                    out.append((qp, 0, entry, 8, 0))
                    continue
                layer, offset, length = req.chunks.locate(index)
                _src, src_addr = req.sources[layer]
                pos = req.chunks.position(layer, offset)
                out.append((qp, src_addr + offset, req.grant.addr + pos, length, 1))
        return out

    def _check_sender(self, addr: int, size: int) -> None:
        self.checked += 1
        for qp, src, _dst, length, is_data in self._writes():
            if is_data and not qp.closed and _overlap(src, length, addr, size):
                self.errors.append(f"sender freed {addr:#x}+{size} under a WRITE from {src:#x}")

    def _check_receiver(self, addr: int, size: int) -> None:
        self.checked += 1
        for qp, _src, dst, length, _d in self._writes():
            peer = self.rig.fabric.qps.get(qp.dest) if qp.dest and self.rig.fabric else None
            live = peer is not None and not peer.closed and not qp.closed
            if live and _overlap(dst, length, addr, size):
                self.errors.append(f"receiver freed {addr:#x}+{size} under a WRITE to {dst:#x}")


class Gate:
    """Holds the receiver's RDMA landing loop at its next event: it polls no completion and
    reposts no receive, so (with a small rx recv_depth) the sender's WRITE_WITH_IMMs wait for
    receives (RNR) and stay in flight until the gate opens."""

    def __init__(self, receiver: Receiver) -> None:
        self.opened = trio.Event()
        self.held = trio.Event()
        land = receiver._on_rdma_event

        async def gated(sess: Any, ev: Any) -> None:
            if not self.opened.is_set():
                self.held.set()
                await self.opened.wait()
            await land(sess, ev)

        receiver._on_rdma_event = gated  # type: ignore[method-assign]

    def open(self) -> None:
        self.opened.set()


def any_wire(rig: Rig) -> WireConn:
    """One of the receiver's data connections from the (one) honest sender."""
    wires = rig.receiver.session_wires[rig.sender.session]
    return next(w for w in wires if not w.closed)


@contextlib.asynccontextmanager
async def logged(rig: Rig, text: str) -> AsyncIterator[None]:
    """Run the body, then wait until an xdc logger has written a line containing ``text``
    (how a test knows a peer's frame was handled when handling it changes nothing)."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("xdc").addHandler(handler)
    try:
        yield
        await rig.until(lambda: any(text in m for m in seen))
    finally:
        logging.getLogger("xdc").removeHandler(handler)


async def deliver_by_rdma(
    rig: Rig, payloads: dict[str, list[bytes]]
) -> tuple[FreeGuard, dict[str, Any]]:
    """Negotiate, send every request (checked on arrival), and show none of it went by TCP;
    returns the free guard (to check once the pools drain) and the receiver's session."""
    assert (await rig.negotiated())["backend"] == "rdma"
    guard = FreeGuard(rig)
    outcomes = await in_engine_thread(
        send_each, rig.receiver.rc.control_socket, rig.sender.sc.control_socket, payloads
    )
    all_ok(outcomes)
    assert rig.sender.metrics.bytes_sent._value.get() == 0
    (sess,) = rig.receiver.status()["rdma"].values()
    return guard, sess


async def pools_empty(rig: Rig, timeout: float = 5.0) -> None:
    await rig.until(lambda: rig.sender.pool.allocator.used_bytes == 0, timeout)
    await rig.until(lambda: rig.receiver.pool.allocator.used_bytes == 0, timeout)


def all_ok(outcomes: dict[str, Outcome]) -> None:
    assert all(o.ok for o in outcomes.values()), outcomes


def partial_handover(
    tx_sock: str,
    rids: list[str],
    payloads: dict[str, list[bytes]],
    middle: Callable[[], None],
    split: int = 3,
    deadline_s: float | None = None,
    vanish: bool = False,
    hand_rest: bool = True,
) -> dict[str, Outcome]:
    """Prefill engine: hand over layers [0, split) of every request, call ``middle`` (the
    test's interference, run in the trio thread), then the rest (unless not ``hand_rest``);
    the outcomes. ``vanish``: the engine disconnects right after ``middle`` instead (no
    outcome can reach it)."""
    pc = PrefillClient(tx_sock)
    try:
        ts = {rid: pc.begin(rid, LAYERS, deadline_s=deadline_s) for rid in rids}
        for layer in range(split):
            for rid, t in ts.items():
                t.put_layer(layer, payloads[rid][layer])
        middle()
        if vanish:
            return {}
        for layer in range(split, len(LAYERS) if hand_rest else split):
            for rid, t in ts.items():
                with contextlib.suppress(TransferError):  # failed already: see its outcome
                    t.put_layer(layer, payloads[rid][layer])
        return {rid: t.wait(20) for rid, t in ts.items()}
    finally:
        pc.close()


def in_trio(
    token: trio.lowlevel.TrioToken, fn: Callable[[], Awaitable[None]]
) -> Callable[[], None]:
    return lambda: trio.from_thread.run(fn, trio_token=token)


def send_each(rx_sock: str, tx_sock: str, payloads: dict[str, list[bytes]]) -> dict[str, Outcome]:
    """One prefill engine per request, all at once (a tight send pool then pushes back on
    each without one request's hand-over waiting behind another's), and a decode engine
    taking, checking and releasing requests as they complete (so a tight receive pool
    drains)."""
    out: dict[str, Outcome] = {}
    errors: list[BaseException] = []

    def one(rid: str) -> None:
        try:
            with PrefillClient(tx_sock) as pc:
                t = pc.begin(rid, [len(x) for x in payloads[rid]])
                for layer, data in enumerate(payloads[rid]):
                    t.put_layer(layer, data)
                out[rid] = t.wait(30)
        except BaseException as exc:  # reported by the caller's assertion
            errors.append(exc)

    def decode() -> None:
        try:
            with DecodeClient(rx_sock) as dc:
                for _ in payloads:
                    got = dc.await_request(timeout=20)
                    for i, data in enumerate(payloads[got.rid]):
                        assert got.layer(i).tobytes() == data, f"{got.rid} layer {i} differs"
                    got.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in payloads]
    threads.append(threading.Thread(target=decode))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    return out


class Restartable:
    """A sender and a receiver that the test can stop and start again on the same port (and
    control socket), all over one fake fabric."""

    def __init__(self, tmp_path: Path, fabric: FakeFabric, rdma: RdmaConfig = RDMA) -> None:
        self.tx, self.rx, _ = local_pair_config(
            tmp_path, connections=2, chunk_bytes=64 << 10, send_pool=8 << 20, recv_pool=16 << 20
        )
        self.tx.rdma, self.rx.rdma = rdma, rdma
        self.tx.node.shutdown_drain_s = self.rx.node.shutdown_drain_s = 1.0
        self.fabric = fabric
        self.verbs = FakeVerbs(fabric)
        self.sender = Sender(self.tx, rdma=RdmaDeps(lambda: self.verbs, lambda: (["rxe0"], "t")))
        self.receiver = self._new_receiver()
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()

    def _new_receiver(self, hook: Callable[[Receiver], None] | None = None) -> Receiver:
        receiver = Receiver(self.rx, rdma=RdmaDeps(lambda: self.verbs, lambda: (["rxe1"], "t")))
        if hook is not None:
            hook(receiver)
        return receiver

    @property
    def rig(self) -> Rig:
        return Rig(self.sender, self.receiver, self.fabric)

    async def start_receiver(self, nursery: trio.Nursery) -> None:
        self._scope, self._stopped = trio.CancelScope(), trio.Event()
        scope, stopped, receiver = self._scope, self._stopped, self.receiver

        async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await receiver.serve(task_status=task_status)
            finally:
                stopped.set()

        await nursery.start(run)

    async def restart_receiver(
        self, nursery: trio.Nursery, hook: Callable[[Receiver], None] | None = None
    ) -> None:
        """Stop the receiver without a drain (its connections just close), start a new one;
        ``hook`` may wrap the new one's methods before it serves."""
        self._scope.cancel()
        await self._stopped.wait()
        self.receiver = self._new_receiver(hook)
        await self.start_receiver(nursery)


class PostGuard:
    """Checks every data WRITE the sender posts: its source bytes must lie in the live send
    buffer of the layer it belongs to (never freed memory, never another request's)."""

    def __init__(self, rig: Rig, verbs: Any) -> None:
        self.errors: list[str] = []
        self.posted = 0
        post = verbs.post_write
        base = _address(rig.sender.pool.view)

        def post_write(qp: Any, wr: Any) -> None:
            rdma = rig.peer.rdma
            entry = rdma.writer._inflight.get(wr.wr_id) if rdma and rdma.writer else None
            if entry is not None and entry[2] is None:  # a data WRITE (not a checksum)
                self.posted += 1
                req, index, _s = entry
                layer, _o, _n = req.chunks.locate(index)
                out = rig.sender.requests.get(req.begin.rid)
                slot = out.layer_slot[layer] if out is not None else None
                size = req.begin.layer_sizes[layer]
                if slot is None or not base + slot <= wr.addr <= wr.addr + wr.length <= (
                    base + slot + max(size, 1)
                ):
                    self.errors.append(f"WRITE of {req.begin.rid} layer {layer} from freed bytes")
            post(qp, wr)

        verbs.post_write = post_write
