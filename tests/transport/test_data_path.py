"""The data-path interface without sockets: which path a request takes and what each path
does with the receiver's answers, so the sender itself never names one."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

from xdc.transport.data_path import PeerPaths, TcpPath
from xdc.transport.peer_link import Work

from xdc.protocol import Begin, Cancel
from xdc.protocol.books.send import SendBook, TxRequest

CHUNK = 4096


class RecordingLink:
    """The one thing a TCP path asks of its link: take chunks into the striping queue."""

    rdma = None

    def __init__(self) -> None:
        self.queued: list[tuple[Work, bool]] = []
        self.deferred: list[tuple[Work, float]] = []

    def enqueue(self, items: list[Work], *, front: bool = False) -> None:
        self.queued.extend((w, front) for w in items)

    def defer(self, work: Work, delay_s: float) -> None:
        self.deferred.append((work, delay_s))


def request(rid: str = "r") -> TxRequest:
    book = SendBook(
        max_layers=8,
        max_request_bytes=1 << 30,
        max_block_hashes=16,
        max_concurrent=4,
        fits=lambda n: n <= 1 << 20,
    )
    req = book.begin("engine", Begin(rid, (2 * CHUNK, CHUNK), CHUNK, (), 0, 10_000), "p", 0.0, 9)
    for layer in range(len(req.handed)):
        req.layer_slot[layer] = layer << 20
    return req


def paths(reading: set[tuple[str, int]] | None = None) -> tuple[PeerPaths, RecordingLink]:
    link = RecordingLink()
    held = reading if reading is not None else set()
    return PeerPaths(link, Work, lambda rid, layer: (rid, layer) in held), link  # type: ignore[arg-type]


def test_a_peer_without_rdma_sends_every_request_by_tcp_and_ignores_grants() -> None:
    p, _ = paths()
    req = request()
    p.granted(req, b"\x00" * 32)  # a grant where RDMA is off means nothing
    assert isinstance(p.accepted(req), TcpPath)
    assert p.of(req).name == "tcp"
    assert p.state(req.rid) is None


def test_tcp_queues_only_whole_final_cells_and_each_once() -> None:
    p, link = paths()
    req = request()
    path = p.accepted(req)
    req.ready_upto[0] = CHUNK + 100  # one cell and a part of the next are final
    path.give(req, 0)
    path.give(req, 0)
    assert [(w.layer, w.offset, w.length) for w, _ in link.queued] == [(0, 0, CHUNK)]
    req.ready_upto[0] = 2 * CHUNK
    path.give(req, 0)
    assert [w.offset for w, _ in link.queued] == [0, CHUNK]


def test_tcp_resends_a_nacked_chunk_first_but_only_if_still_wanted() -> None:
    p, link = paths()
    req = request()
    path = p.accepted(req)
    w = Work(req.rid, 1, 0, CHUNK)
    assert path.nacked(req, 1, 0, w, 0) is True
    assert link.queued == [(dataclasses.replace(w, copy=True), True)]  # marked as a resend
    assert path.nacked(req, 1, 0, None, 0) is False  # acked meanwhile, or the request ended
    assert len(link.queued) == 1
    assert not link.deferred


def test_a_chunk_declined_as_busy_is_resent_later_and_later_each_time() -> None:
    p, link = paths()
    req = request()
    path = p.accepted(req)
    w = Work(req.rid, 1, 0, CHUNK)
    for _ in range(8):  # declined again each time it is resent
        assert path.nacked(req, 1, 0, w, 20) is True
        w, _delay = link.deferred[-1]
    assert not link.queued  # never at once
    assert [round(d, 3) for _w, d in link.deferred] == [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1, 1]
    assert w.busy_nacks == 8 and (w.rid, w.layer, w.offset, w.length) == (req.rid, 1, 0, CHUNK)
    assert w.copy  # every resend says it is one
    assert path.nacked(req, 1, 0, None, 20) is False  # acked meanwhile: nothing deferred
    assert len(link.deferred) == 8


def test_over_tcp_layer_done_and_complete_are_informational() -> None:
    p, _ = paths()
    req = request()
    path = p.accepted(req)
    assert path.confirmed(req, 0) is False
    assert path.peer_complete(req) is False
    assert path.layer_done(req, 0) is False  # only ACKs of verified chunks make it held
    for off, _n in req.tracker.chunks(0):
        req.tracker.ack(0, off)
    assert path.layer_done(req, 0) is True


def test_a_layer_under_sendmsg_is_busy() -> None:
    reading = {("r", 0)}
    p, _ = paths(reading)
    req = request()
    path = p.accepted(req)
    assert path.busy(req, 0) is True
    assert path.busy(req, 1) is False


def test_a_failed_tcp_request_owes_a_cancel_only_when_the_receiver_must_be_told() -> None:
    p, _ = paths()
    req = request()
    p.accepted(req)
    req.why = "engine cancelled"
    cancel = p.failed(req, notify=True)
    assert cancel == Cancel("r", "engine cancelled")
    assert p.failed(req, notify=False) is None  # the receiver failed it: it knows


async def _finished(p: PeerPaths, req: TxRequest) -> Any:
    return await p.finished(req, 1.0)


def test_a_tcp_request_owes_nothing_after_its_end() -> None:
    import trio

    p, _ = paths()
    req = request()
    p.accepted(req)
    assert trio.run(_finished, p, req) is None
    assert p.fall_back(req, {0}) is False  # no RDMA link to fall back from
    assert p.frees_due() == []


def test_the_sender_never_names_a_data_path() -> None:
    """Which path a request takes is the data path module's business (issue 28): the
    sender module neither imports a concrete path nor reaches into RDMA bookkeeping."""
    import xdc.transport.sender as sender_mod

    tree = ast.parse(Path(sender_mod.__file__).read_text())
    imported = {
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "xdc.transport.data_path"
        for a in node.names
    }
    assert imported <= {"DataPath", "PeerPaths"}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"free_wait", "writing", "was_granted", "take", "confirm_layer"}
