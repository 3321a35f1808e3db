"""A decode engine's connection to the receiver: it claims requests, pins layers and
releases them; the request book decides, the engine waits (bounded) for what it named, and
what the connection held goes back to the book when it closes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

import trio
from xdc.transport.daemon import pool_hello
from xdc.transport.pool import BufferPool
from xdc.transport.waits import WaitIndex

from xdc.errors import ResultCode, TransferError
from xdc.protocol.books.receive import WAIT, Effect, ReceiveBook, Refusal, RxRequest
from xdc.protocol.engine_control import (
    Await,
    AwaitLayer,
    Discard,
    EngineHello,
    Look,
    Release,
    Request,
    Status,
)

log = logging.getLogger("xdc.receiver")


class EngineHost(Protocol):
    """What a decode engine's connection uses of the receiver (``receiver.Receiver``)."""

    book: ReceiveBook
    pool: BufferPool
    waits: WaitIndex
    counts: dict[str, int]
    engines: int  # open decode-engine connections
    awaiting: int  # engine calls waiting

    def _apply(self, effects: Iterable[Effect]) -> None: ...
    def describe(self, req: RxRequest) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...


class DecodeEngine:
    """One decode engine's connection: it claims requests, pins layers and releases them;
    the book decides, and gives back what it held when the connection goes."""

    def __init__(self, rx: EngineHost) -> None:
        self.rx = rx
        rx.engines += 1

    async def handle(self, request: Request) -> dict[str, Any]:
        rx = self.rx
        if isinstance(request, EngineHello):
            if request.layout is not None:
                rx.book.engine_layout(self, request.layout)
            rx.book.engine_readers_of(self, request.readers or 1)
            return pool_hello(rx.pool, request.pool_fd)
        if isinstance(request, Await):
            if request.rids:
                return await self._wait(
                    lambda: self._claim_any(request.rids), request.timeout_s, request.rids
                )
            return await self._wait(
                lambda: self._claim(request.rid),
                request.timeout_s,
                None if request.rid is None else (request.rid,),
                named=request.rid,
            )
        if isinstance(request, AwaitLayer):
            return await self._wait(
                lambda: rx.book.pin_layer(self, request.rid, request.layer),
                request.timeout_s,
                (request.rid,),
            )
        if isinstance(request, Look):
            return {"states": [rx.book.state_of(rid) for rid in request.rids]}
        if isinstance(request, Release):
            req = rx.book.get(request.rid)
            refusal, effects = rx.book.release(self, request.rid)
            rx._apply(effects)
            if refusal is not None:
                raise TransferError(refusal.code, refusal.why)
            if req is not None and req.readers > 1:
                log.info(
                    "request %s released by %d of its %d readers",
                    req.rid,
                    len(req.read_by),
                    req.readers,
                )
            return {}
        if isinstance(request, Discard):
            refusal, effects = rx.book.discard(
                self, request.rid, "its decode engine gave it up", trio.current_time()
            )
            rx._apply(effects)
            if refusal is not None:
                raise TransferError(refusal.code, refusal.why, request.rid)
            return {}
        if isinstance(request, Status):
            return rx.status()
        raise TransferError(ResultCode.BAD_OP, f"{type(request).__name__} is not served here")

    def _claim_any(self, rids: tuple[str, ...]) -> RxRequest | Refusal | Any:
        answer, effects = self.rx.book.claim_any(self, rids, trio.current_time())
        self.rx._apply(effects)
        return answer

    def _claim(self, rid: str | None) -> RxRequest | Refusal | Any:
        answer, effects = self.rx.book.claim(self, rid, trio.current_time())
        self.rx._apply(effects)
        return answer

    async def _wait(
        self,
        ask: Any,
        timeout: float,
        rids: tuple[str, ...] | None,
        named: str | None = None,
    ) -> dict[str, Any]:
        """Ask the book until it answers, or the caller's time is up (0: ask once), looking
        again only when one of ``rids`` changed (None: any request). A named request the
        receiver never heard of is UNKNOWN_REQUEST, not TIMEOUT."""
        self.rx.awaiting += 1
        try:
            answer = self._look(ask) if timeout == 0 else await self._woken(ask, timeout, rids)
        finally:
            self.rx.awaiting -= 1
        if answer is not WAIT:
            return self.rx.describe(answer)
        if named is not None and not self.rx.book.known(named):
            why = f"no request {named!r} has begun here (within {timeout:g}s)"
            raise TransferError(ResultCode.UNKNOWN_REQUEST, why, named)
        raise TransferError(ResultCode.TIMEOUT, f"not ready within {timeout:g}s")

    async def _woken(self, ask: Any, timeout: float, rids: tuple[str, ...] | None) -> Any:
        """The book's answer, asked again each time one of ``rids`` changes, or WAIT when
        the time is up. (A look, timeout 0, registers no waiter: a loader's poll names up
        to 1,024 requests, and watching them cost more than the look itself.)"""
        with trio.move_on_after(timeout), self.rx.waits.watching(rids) as waiter:
            while True:
                changed = waiter.renew()
                answer = self._look(ask)
                if answer is not WAIT:
                    return answer
                await changed.wait()
        return WAIT

    def _look(self, ask: Any) -> Any:
        self.rx.counts["engine_looks"] += 1
        answer = ask()
        if isinstance(answer, Refusal):
            raise TransferError(answer.code, answer.why, answer.rid)
        return answer

    def closed(self) -> None:
        rx = self.rx
        rx.engines -= 1
        rx._apply(rx.book.engine_gone(self))
