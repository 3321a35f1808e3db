"""What a request may do next at the sender, decided in one pure place.

The sender daemon drives this book with what its engines and its peer said; the book keeps
each request's state and answers with **effects**, what must happen now (give a layer's final
bytes to the data path, tell the receiver END or CANCEL, free a layer the receiver holds,
wake the request's task because it was accepted, completed or failed), which the daemon
carries out in order, as the receive side does with ``ReceiveBook``. The rules:

- **Ownership.** A request belongs to the engine connection that began it: only that
  connection may allocate its buffers, hand its layers over or cancel it. When that
  connection goes before every layer was handed over, the request fails (ENGINE_GONE): the
  missing layers can never come.
- **Hand-over.** Layers are handed over in any order, each in one piece or in growing parts
  (``upto``): bytes [0, upto) are final. What is final goes to the data path as soon as the
  request is accepted; a part is never handed over twice and never shrinks.
- **States.** PENDING (BEGIN sent, no ACCEPT yet: a lost connection means BEGIN again),
  SENDING (accepted), then COMPLETE (every layer handed over and every byte confirmed by the
  receiver: ACKs over TCP, its COMPLETE over RDMA) or FAILED (with a code and a reason the
  engine sees). A receiver that restarted lost every accepted request's partial copy.
- **Finished memory.** How recent requests ended is remembered (bounded), so a late call
  from the engine gets the real reason instead of "unknown request".
- **Deadline.** A request fails (DEADLINE) when it goes its window with neither the engine
  handing new bytes over nor the receiver acknowledging any; either restarts the window, so a
  prefill or a thin link may take as long as they take, up to ``max_transfer_s``
  (deadline.py says why).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from xdc.errors import ProtocolError, ResultCode, TransferError
from xdc.protocol.books.deadline import Deadline
from xdc.protocol.books.tracker import SendTracker
from xdc.protocol.wire.events import Begin

Owner = Hashable  # an engine connection, as the daemon names it


class TxState(enum.StrEnum):
    PENDING = "pending"
    SENDING = "sending"
    COMPLETE = "complete"
    FAILED = "failed"


LIVE: Final = (TxState.PENDING, TxState.SENDING)


@dataclass(eq=False)
class TxRequest:
    begin: Begin
    tracker: SendTracker
    owner: Owner | None
    peer: Hashable
    created: float
    clock: Deadline  # fails when neither the engine hands bytes over nor the receiver acks any
    state: TxState = TxState.PENDING
    layer_slot: list[int | None] = field(default_factory=list)  # its buffers in the send pool
    handed: list[bool] = field(default_factory=list)
    ready_upto: list[int] = field(default_factory=list)  # bytes [0, n) of each layer are final
    queued_upto: list[int] = field(default_factory=list)  # of which the data path has this
    code: ResultCode | None = None
    why: str = ""
    t_last_handed: float = 0.0
    t_done: float = 0.0
    resent: int = 0

    @property
    def rid(self) -> str:
        return self.begin.rid

    @property
    def deadline(self) -> float:
        return self.clock.at

    @property
    def all_handed(self) -> bool:
        return all(self.handed)

    @property
    def live(self) -> bool:
        return self.state in LIVE


# --- effects: what the daemon must do, in order --------------------------------------------


@dataclass(frozen=True, slots=True)
class Give:
    """The layer's final bytes (up to ``ready_upto``) go to the request's data path."""

    req: TxRequest
    layer: int


@dataclass(frozen=True, slots=True)
class TellEnd:
    """Every layer is handed over: tell the receiver END."""

    req: TxRequest


@dataclass(frozen=True, slots=True)
class Accepted:
    """The receiver accepted: stop re-sending BEGIN; every final part goes to the path."""

    req: TxRequest


@dataclass(frozen=True, slots=True)
class LayerAcked:
    """The receiver holds the whole layer: its buffer may go once nothing reads it."""

    req: TxRequest
    layer: int


@dataclass(frozen=True, slots=True)
class Completed:
    """Every layer handed over and every byte confirmed: the request is delivered."""

    req: TxRequest


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed (``req.code``, ``req.why``); ``notify``: tell the receiver (CANCEL)
    so it frees what it holds (not when it was the receiver that failed it)."""

    req: TxRequest
    notify: bool


TxEffect: TypeAlias = Give | TellEnd | Accepted | LayerAcked | Completed | Failed


class SendBook:
    def __init__(
        self,
        *,
        max_layers: int,
        max_request_bytes: int,
        max_block_hashes: int,
        max_concurrent: int,
        fits: Callable[[int], bool],
        memory: int = 4096,
        max_transfer_s: float = 600.0,
    ) -> None:
        self.max_layers = max_layers
        self.max_transfer_s = max_transfer_s  # the cap on a request however it progresses
        self.max_request_bytes = max_request_bytes
        self.max_block_hashes = max_block_hashes
        self.max_concurrent = max_concurrent
        self.fits = fits  # could a buffer this big ever fit the send pool
        self.memory = memory
        self.requests: dict[str, TxRequest] = {}
        self.ended: OrderedDict[str, tuple[ResultCode, str]] = OrderedDict()
        self.draining = False

    # --- engine side -------------------------------------------------------------------------

    def begin(
        self, owner: Owner | None, begin: Begin, peer: Hashable, now: float, deadline_s: float
    ) -> TxRequest:
        """A new request, or TransferError saying why not (nothing is held then)."""
        rid = begin.rid
        sizes = begin.layer_sizes
        if rid in self.requests:
            raise TransferError(ResultCode.DUPLICATE_REQUEST, f"request {rid} is already in flight")
        if len(sizes) > self.max_layers:
            raise TransferError(
                ResultCode.LIMIT, f"{len(sizes)} layers exceed the limit of {self.max_layers}"
            )
        total = sum(sizes)
        if not 0 < total <= self.max_request_bytes:
            raise TransferError(
                ResultCode.LIMIT, f"request of {total} bytes outside 1..{self.max_request_bytes}"
            )
        if len(begin.block_hashes) > self.max_block_hashes:
            raise TransferError(
                ResultCode.LIMIT,
                f"{len(begin.block_hashes)} block hashes exceed the limit of "
                f"{self.max_block_hashes}",
            )
        biggest = max(sizes)
        if not self.fits(biggest):
            raise TransferError(
                ResultCode.NO_SPACE, f"a layer of {biggest} bytes can never fit the send pool"
            )
        if self.draining:
            raise TransferError(
                ResultCode.SHUTTING_DOWN, "the sender is shutting down; send it elsewhere"
            )
        if len(self.requests) >= self.max_concurrent:
            raise TransferError(ResultCode.TOO_BUSY, "too many concurrent transfers")
        n = len(sizes)
        req = TxRequest(
            begin=begin,
            tracker=SendTracker(rid, sizes, begin.chunk_bytes),
            owner=owner,
            peer=peer,
            created=now,
            clock=Deadline.start(now, deadline_s, self.max_transfer_s),
            layer_slot=[None] * n,
            handed=[False] * n,
            ready_upto=[0] * n,
            queued_upto=[0] * n,
        )
        self.requests[rid] = req
        return req

    def owned(self, owner: Owner | None, rid: str) -> TxRequest:
        """The live request ``rid`` of this engine connection, or TransferError."""
        req = self.requests.get(rid)
        if req is None:
            ended = self.ended.get(rid)
            if ended is not None:
                code, why = ended
                if code is ResultCode.OK:
                    raise TransferError(ResultCode.BAD_REQUEST, f"request {rid} was delivered")
                raise TransferError(code, why or "request already finished")
            raise TransferError(ResultCode.UNKNOWN_REQUEST, f"no request {rid!r} in flight")
        if req.owner is not owner:
            raise TransferError(ResultCode.NOT_OWNER, f"request {rid} is another engine's")
        if req.state is TxState.FAILED:
            raise TransferError(req.code or ResultCode.FAILED, req.why)
        return req

    def may_allocate(self, owner: Owner | None, rid: str, layer: int) -> TxRequest:
        req = self.owned(owner, rid)
        if not 0 <= layer < len(req.handed):
            raise TransferError(ResultCode.BAD_REQUEST, f"request {rid} has no layer {layer}")
        if req.layer_slot[layer] is not None or req.handed[layer]:
            raise TransferError(
                ResultCode.BAD_REQUEST, f"layer {layer} of {rid} was already allocated"
            )
        return req

    def hand_over(
        self, owner: Owner | None, rid: str, layer: int, upto: int | None, now: float
    ) -> list[TxEffect]:
        """Bytes [0, upto) of the layer are final (None: all of it)."""
        req = self.owned(owner, rid)
        if not 0 <= layer < len(req.handed) or req.handed[layer]:
            raise TransferError(
                ResultCode.BAD_REQUEST, f"layer {layer} of {rid} is not awaiting hand-over"
            )
        size = req.begin.layer_sizes[layer]
        if req.layer_slot[layer] is None and size > 0:
            raise TransferError(
                ResultCode.BAD_REQUEST, f"layer {layer} of {rid} has no buffer (call alloc)"
            )
        upto = size if upto is None else upto
        if not req.ready_upto[layer] <= upto <= size:
            raise TransferError(
                ResultCode.BAD_REQUEST,
                f"layer {layer} of {rid}: upto {upto} outside {req.ready_upto[layer]}..{size}",
            )
        if upto > req.ready_upto[layer] or upto == size:
            req.clock.progress(now)  # the engine is alive and computing: no stall
        req.ready_upto[layer] = upto
        req.handed[layer] = upto == size
        out: list[TxEffect] = []
        if req.state is TxState.SENDING:
            out.append(Give(req, layer))
        if req.handed[layer] and req.all_handed:
            req.t_last_handed = now
            out.append(TellEnd(req))
            if req.state is TxState.SENDING and req.tracker.all_acked:
                out += self.complete(req, now)
        return out

    def engine_gone(self, owner: Owner) -> list[TxEffect]:
        """A connection closed: requests it had not handed over completely can never finish
        and fail (ENGINE_GONE); the rest go on without an owner."""
        out: list[TxEffect] = []
        for req in list(self.requests.values()):
            if req.owner is owner:
                req.owner = None
                if req.live and not req.all_handed:
                    why = "prefill engine disconnected mid-request"
                    out += self.fail(req.rid, ResultCode.ENGINE_GONE, why)
        return out

    # --- peer side ---------------------------------------------------------------------------

    def accepted(self, rid: str) -> list[TxEffect]:
        """ACCEPT: the request may send (nothing, if it is not waiting for one)."""
        req = self.requests.get(rid)
        if req is None or req.state is not TxState.PENDING:
            return []
        req.state = TxState.SENDING
        return [Accepted(req)]

    def acked(self, rid: str, layer: int, offset: int, now: float) -> list[TxEffect]:
        """An ACK. One off the request's grid fails the request (PROTOCOL)."""
        req = self.requests.get(rid)
        if req is None or req.state is not TxState.SENDING:
            return []
        try:
            if not req.tracker.ack(layer, offset):
                return []
        except ProtocolError as e:
            return self.fail(rid, ResultCode.PROTOCOL, f"bad ack: {e.message}")
        req.clock.progress(now)  # the link moves: a slow one is not a stall
        out: list[TxEffect] = []
        if req.tracker.layer_acked(layer):
            out.append(LayerAcked(req, layer))
        if req.tracker.all_acked and req.all_handed:
            out += self.complete(req, now)
        return out

    def complete(self, req: TxRequest, now: float) -> list[TxEffect]:
        """Delivered (the data path confirmed every byte); nothing if it already ended."""
        if req.state is not TxState.SENDING:
            return []
        req.state = TxState.COMPLETE
        req.t_done = now
        return [Completed(req)]

    def fail(self, rid: str, code: ResultCode, why: str, *, notify: bool = True) -> list[TxEffect]:
        """The request fails (nothing once it ended)."""
        req = self.requests.get(rid)
        if req is None or not req.live:
            return []
        req.state = TxState.FAILED
        req.code, req.why = code, why
        return [Failed(req, notify)]

    def peer_restarted(self, peer: Hashable) -> list[TxEffect]:
        """A new receiver session: the accepted requests' partial copies are gone and they
        fail (PEER_RESTARTED; the new session never heard of them). PENDING ones simply BEGIN
        again on the new session."""
        out: list[TxEffect] = []
        for r in list(self.requests.values()):
            if r.peer == peer and r.state is TxState.SENDING:
                why = "receiver restarted; partial transfer lost"
                out += self.fail(r.rid, ResultCode.PEER_RESTARTED, why, notify=False)
        return out

    # --- the end -----------------------------------------------------------------------------

    def finish(self, req: TxRequest) -> None:
        """The request leaves; how it ended is remembered."""
        self.requests.pop(req.rid, None)
        if req.state is TxState.COMPLETE:
            self.ended[req.rid] = (ResultCode.OK, "")
        else:
            self.ended[req.rid] = (req.code or ResultCode.FAILED, req.why)
        self.ended.move_to_end(req.rid)
        while len(self.ended) > self.memory:
            self.ended.popitem(last=False)
