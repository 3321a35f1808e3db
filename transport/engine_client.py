"""Client library for inference engines (blocking; engines are ordinary processes).

KV bytes never travel over the control socket: the prefill engine writes each layer straight
into the sender's shared-memory pool, and the decode engine reads layers straight out of the
receiver's pool. Only offsets and small control messages cross the Unix socket.

Prefill side::

    with PrefillClient("/run/xdc/sender.sock") as tx:
        t = tx.begin("req-1", layer_sizes=[...])
        for i, kv in enumerate(layers):           # as prefill produces them
            t.put_layer(i, kv)      # or: buf = t.layer_buffer(i); fill it; t.layer_ready(i)
        outcome = t.wait(timeout=30)              # ok, or a clear error to fall back on

Decode side::

    with DecodeClient("/run/xdc/receiver.sock") as rx:
        req = rx.await_request(timeout=10)        # only complete, verified requests
        kv0 = req.layer(0)                        # numpy uint8 view into shared memory
        req.release()
"""

from __future__ import annotations

import dataclasses
import itertools
import select
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from xdc.transport.engine_socket import recv_blocking, recv_fd_blocking, send_blocking
from xdc.transport.shm import Segment

from xdc.errors import ControlError, ResultCode, TransferError, XdcError
from xdc.protocol.engine_control import (
    MAX_AWAIT_RIDS,
    MAX_READERS,
    Admit,
    Alloc,
    Await,
    AwaitLayer,
    BeginRequest,
    CancelRequest,
    Discard,
    EngineHello,
    ErrorEvent,
    Look,
    Outcome,
    Ready,
    Release,
    Reply,
    Request,
    RequestInfo,
    Status,
    decode_daemon_message,
    encode_request,
    request_info,
)

__all__ = [
    "Admission",
    "ControlError",
    "DecodeClient",
    "Outcome",
    "PrefillClient",
    "ReceivedRequest",
    "Transfer",
    "TransferError",
    "XdcError",
]


def _check_timeout(timeout: float) -> float:
    """Every wait is bounded: 0 polls, a positive number waits that long (at most a day)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
    if not 0 <= timeout <= 86400:  # also rejects NaN
        raise ValueError(f"timeout must be in 0..86400 seconds, got {timeout!r}")
    return float(timeout)


def _check_layout(layout: str | None) -> str | None:
    if layout is not None and (
        not isinstance(layout, str) or not 0 < len(layout) <= 512 or not layout.isprintable()
    ):
        raise ValueError("layout must be a printable string of 1..512 characters")
    return layout


class _Client:
    """One connection to a daemon. Not thread-safe: one client per thread."""

    def __init__(self, path: str, timeout: float, hello: EngineHello) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            raise ControlError(
                ResultCode.PROTOCOL, f"cannot reach the xdc daemon at {path}: {e}"
            ) from e
        self._ids = itertools.count(1)
        self._outcomes: dict[str, Outcome] = {}
        # errors the daemon pushed for one-way messages, raised at the next call for that rid
        # (None: a message the daemon could not even attribute, raised at the next call)
        self._errors: dict[str | None, TransferError] = {}
        self._broken = ""
        try:
            try:
                fields = self.call(dataclasses.replace(hello, pool_fd=True))
            except TransferError as e:
                if e.code is not ResultCode.BAD_REQUEST or "pool_fd" not in e.message:
                    raise
                fields = self.call(hello)  # a daemon from before descriptor passing
            fd = recv_fd_blocking(self.sock) if fields.get("pool_fd") is True else None
            self.segment = Segment.attach(str(fields["shm"]), fd)
        except BaseException:
            self.sock.close()
            raise
        self.hello = fields

    def tell(self, request: Request) -> None:
        """Send a one-way message: no round trip; a failure comes back as a pushed error."""
        self._usable()
        send_blocking(self.sock, encode_request(request, None))

    def check(self, rid: str) -> None:
        """Raise the error the daemon pushed for ``rid``, if any (one that is still on its
        way is raised by a later call: the daemon answers calls in order, after it)."""
        self._pump()
        err = self._errors.pop(rid, None) or self._errors.pop(None, None)
        if err is not None:
            raise err

    @property
    def broken(self) -> bool:
        """The connection failed (or a call timed out): it takes no more calls, and the
        caller connects afresh."""
        return bool(self._broken)

    def _usable(self) -> None:
        if self._broken:
            raise ControlError(
                ResultCode.PROTOCOL, f"connection to {self.path} is unusable ({self._broken})"
            )

    def _take(self, msg: Reply | Outcome | ErrorEvent) -> Reply | None:
        """File a pushed message away; a reply is returned to the caller."""
        if isinstance(msg, Outcome):
            self._outcomes[msg.rid] = msg
        elif isinstance(msg, ErrorEvent):
            self._errors[msg.rid] = TransferError(msg.code, msg.error, msg.rid)
        else:
            return msg
        return None

    def _pump(self) -> None:
        """Read whatever the daemon has pushed so far, without waiting for more."""
        while not self._broken and select.select([self.sock], [], [], 0)[0]:
            if self._take(decode_daemon_message(recv_blocking(self.sock))) is not None:
                raise ControlError(ResultCode.PROTOCOL, "daemon sent a reply nobody asked for")

    def call(self, request: Request, timeout: float | None = None) -> dict[str, Any]:
        """A round trip; the reply's fields, or TransferError with the daemon's code."""
        self._usable()
        mid = next(self._ids)
        old = self.sock.gettimeout()
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            send_blocking(self.sock, encode_request(request, mid))
            while True:
                reply = self._take(decode_daemon_message(recv_blocking(self.sock)))
                if reply is None:
                    continue
                if reply.id != mid:
                    self._broken = f"reply {reply.id} came for call {mid}"
                    self.sock.close()
                    raise ControlError(ResultCode.PROTOCOL, self._broken)
                if not reply.ok:
                    rid = reply.fields.get("rid")
                    raise TransferError(
                        reply.code, reply.error, rid if isinstance(rid, str) else None
                    )
                return reply.fields
        except TimeoutError as e:
            # The daemon may still answer later; that answer must never be taken for the
            # reply to a later call, so this connection is done (the daemon then gives back
            # whatever it would have handed us).
            self._broken = f"no answer to {type(request).__name__} in time"
            self.sock.close()
            raise TransferError(ResultCode.TIMEOUT, f"daemon did not answer in time ({e})") from e
        except OSError as e:
            self._broken = f"control socket failed: {e}"
            self.sock.close()
            raise ControlError(ResultCode.PROTOCOL, self._broken) from e
        finally:
            if not self._broken:
                self.sock.settimeout(old)

    def status(self) -> dict[str, Any]:
        return self.call(Status())

    def close(self) -> None:
        if hasattr(self, "segment"):
            self.segment.close()
        self.sock.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """The sender's answer to ``PrefillClient.admit``: ``reason`` is one word (a metric
    label: ``draining``, ``peer_refused``, ``peer_unreachable``), ``why`` a sentence."""

    ok: bool
    reason: str = ""
    why: str = ""


class PrefillClient(_Client):
    def __init__(self, control_socket: str, timeout: float = 60.0) -> None:
        super().__init__(control_socket, timeout, EngineHello())

    def begin(
        self,
        rid: str,
        layer_sizes: Sequence[int],
        *,
        block_hashes: Sequence[int] = (),
        cached_blocks: int = 0,
        deadline_s: float | None = None,
        peer: str | None = None,
        layout: str | None = None,
    ) -> Transfer:
        """Announce a request. ``layout`` names what its bytes are (model, dtype, block size,
        KV layout); a receiver whose decode engine expects another refuses it before any
        byte moves, and the outcome says LAYOUT_MISMATCH."""
        self.call(
            BeginRequest(
                rid=rid,
                layer_sizes=tuple(int(s) for s in layer_sizes),
                block_hashes=tuple(int(h) for h in block_hashes),
                cached_blocks=int(cached_blocks),
                deadline_s=deadline_s,
                peer=peer,
                layout=_check_layout(layout) or "",
            )
        )
        return Transfer(self, rid, [int(s) for s in layer_sizes])

    def cancel(self, rid: str, reason: str = "") -> None:
        self.call(CancelRequest(rid, reason))

    def admit(self, peer: str | None = None, timeout: float | None = None) -> Admission:
        """Would the sender ship a request to ``peer`` now (see ``control.Admit``)?"""
        fields = self.call(Admit(peer), timeout)
        if fields.get("admitted") is True:
            return Admission(True)
        reason = fields.get("reason")
        why = fields.get("why")
        return Admission(
            False,
            reason if isinstance(reason, str) and reason else "refused",
            why if isinstance(why, str) else "",
        )

    def poll_outcomes(self) -> list[Outcome]:
        """Outcomes that have arrived so far (without waiting)."""
        self._pump()
        out = list(self._outcomes.values())
        self._outcomes.clear()
        return out

    def poll(self, rid: str) -> Outcome | None:
        """The request's outcome if the daemon has reported it, without waiting."""
        self._pump()
        return self._outcomes.pop(rid, None)

    def wait(self, rid: str, timeout: float) -> Outcome:
        """Block until the daemon reports the request delivered or failed."""
        timeout = _check_timeout(timeout)
        self._usable()
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            while rid not in self._outcomes:
                if self._take(decode_daemon_message(recv_blocking(self.sock))) is not None:
                    raise ControlError(ResultCode.PROTOCOL, "daemon sent a reply nobody asked for")
            return self._outcomes.pop(rid)
        except TimeoutError as e:
            raise TransferError(
                ResultCode.TIMEOUT, f"no outcome for {rid} within {timeout}s"
            ) from e
        finally:
            self.sock.settimeout(old)

    def __enter__(self) -> PrefillClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transfer:
    """One request on its way out; layers are handed over in any order, each once."""

    LOOKAHEAD = 16  # layers allocated per round trip when the pool has room

    def __init__(self, client: PrefillClient, rid: str, layer_sizes: list[int]) -> None:
        self.client = client
        self.rid = rid
        self.layer_sizes = layer_sizes
        self._offsets: dict[int, int] = {}
        self._asked: set[int] = set()

    def layer_buffer(self, layer: int) -> npt.NDArray[np.uint8]:
        """A writable view of this layer's slot in the send pool (blocks while the pool is
        full: that is the backpressure)."""
        self.client.check(self.rid)
        if layer not in self._offsets:
            ahead = [
                j
                for j in range(layer + 1, min(layer + self.LOOKAHEAD, len(self.layer_sizes)))
                if j not in self._asked
            ]
            reply = self.client.call(Alloc(self.rid, (layer, *ahead)))
            self._asked.update([layer, *ahead])
            try:
                for k, v in reply["offsets"]:
                    self._offsets[int(k)] = int(v)
                if layer not in self._offsets:
                    raise KeyError(layer)
            except (KeyError, TypeError, ValueError) as e:
                raise ControlError(ResultCode.PROTOCOL, f"bad alloc reply: {e!r:.100}") from None
            # look-ahead layers the pool had no room for are asked again when needed
            self._asked = {j for j in self._asked if j in self._offsets or j <= layer}
        off = self._offsets.pop(layer)
        size = self.layer_sizes[layer]
        return np.frombuffer(self.client.segment.view, dtype=np.uint8, count=size, offset=off)

    def layer_ready(self, layer: int, upto: int | None = None) -> None:
        """Hand the layer over: all of it, or (``upto``) its first ``upto`` bytes, which
        must then stay as they are; call again with a larger ``upto`` as more is final
        (chunked prefill completing blocks), the layer's size or None ends the hand-over.
        Chunks go on the wire as soon as they lie wholly in the final part. One-way: the
        engine goes on computing at once; a refusal surfaces at the next call for this
        request and in its outcome."""
        self.client.check(self.rid)
        if upto is not None and (isinstance(upto, bool) or not isinstance(upto, int)):
            raise TypeError("upto must be an int")
        self.client.tell(Ready(self.rid, layer, upto))

    def put_layer(self, layer: int, data: bytes | memoryview | npt.NDArray[Any]) -> None:
        buf = self.layer_buffer(layer)
        if isinstance(data, np.ndarray):
            src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            src = np.frombuffer(data, dtype=np.uint8)
        if src.size != buf.size:
            raise ValueError(f"layer {layer} has {src.size} bytes, expected {buf.size}")
        buf[:] = src
        del buf
        self.layer_ready(layer)

    def poll(self) -> Outcome | None:
        """The outcome if it is known already (never waits)."""
        return self.client.poll(self.rid)

    def wait(self, timeout: float = 60.0) -> Outcome:
        return self.client.wait(self.rid, timeout)


class ReceivedRequest:
    """A complete request in the receiver's pool; valid until ``release``."""

    def __init__(self, client: DecodeClient, info: RequestInfo) -> None:
        self.client = client
        self.info = info
        self.rid = info.rid
        self.offset = info.offset
        self.layer_sizes = list(info.layer_sizes)
        self.layer_offsets = list(info.layer_offsets)
        self.block_hashes = list(info.block_hashes)
        self.cached_blocks = info.cached_blocks
        self.layout = info.layout
        self.transfer_s = info.transfer_s
        self.released = False
        end = max(
            (o + n for o, n in zip(info.layer_offsets, info.layer_sizes, strict=True)), default=0
        )
        if info.offset + end > client.segment.size:
            raise ControlError(ResultCode.PROTOCOL, f"{info.rid} lies outside the receive pool")

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_sizes)

    def layer(self, i: int) -> npt.NDArray[np.uint8]:
        if self.released:
            raise TransferError(ResultCode.RELEASED, f"{self.rid} was released")
        return np.frombuffer(
            self.client.segment.view,
            dtype=np.uint8,
            count=self.layer_sizes[i],
            offset=self.offset + self.layer_offsets[i],
        )

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.client.call(Release(self.rid))


class DecodeClient(_Client):
    def __init__(
        self,
        control_socket: str,
        timeout: float = 60.0,
        *,
        layout: str | None = None,
        readers: int = 1,
    ) -> None:
        """``layout``: the KV layout this engine accepts; the receiver then refuses requests
        announced with another (or none) before any of their bytes move. ``readers``: how
        many connections of this engine (one per tensor-parallel rank) read each request,
        when every rank holds the same bytes; a request is freed once all released it."""
        if not 1 <= readers <= MAX_READERS:
            raise ValueError(f"readers must be 1..{MAX_READERS}, got {readers}")
        hello = EngineHello(_check_layout(layout), readers=readers if readers > 1 else None)
        super().__init__(control_socket, timeout, hello)

    def await_request(self, rid: str | None = None, timeout: float = 30.0) -> ReceivedRequest:
        """The next complete request (or the given one). ``timeout`` 0 only looks. Raises
        TransferError: code TIMEOUT when nothing is complete in time, or the request's
        failure (DEADLINE, CANCELLED, LAYOUT_MISMATCH, ...)."""
        timeout = _check_timeout(timeout)
        fields = self.call(Await(rid, timeout), timeout=timeout + 5)
        return ReceivedRequest(self, request_info(fields))

    def await_any(self, rids: Sequence[str], timeout: float = 30.0) -> ReceivedRequest:
        """The first of ``rids`` to be complete (the oldest when several are), so one waiting
        call serves many requests. A TransferError names in ``.rid`` the request it is about
        (one of them failed), or is TIMEOUT for all."""
        timeout = _check_timeout(timeout)
        fields = self.call(Await(None, timeout, tuple(rids)), timeout=timeout + 5)
        return ReceivedRequest(self, request_info(fields))

    def look(self, rids: Sequence[str]) -> dict[str, str]:
        """Where each of ``rids`` stands at the receiver, claiming nothing (``Look``: e.g.
        ``receiving``, ``complete``, ``failed``, ``unknown``), asked in slices of
        MAX_AWAIT_RIDS."""
        out: dict[str, str] = {}
        names = list(dict.fromkeys(rids))
        for start in range(0, len(names), MAX_AWAIT_RIDS):
            part = names[start : start + MAX_AWAIT_RIDS]
            states = self.call(Look(tuple(part))).get("states")
            if not isinstance(states, list) or len(states) != len(part):
                raise ControlError(ResultCode.PROTOCOL, f"look answered {states!r:.80}")
            out.update(zip(part, (str(x) for x in states), strict=True))
        return out

    def discard(self, rid: str) -> None:
        """This engine will never use ``rid`` (aborted, or recomputed after a timeout): the
        receiver stops it arriving (its sender learns CANCELLED) or frees it, or refuses it
        if it comes later."""
        self.call(Discard(rid))

    def await_layer(self, rid: str, layer: int, timeout: float = 30.0) -> npt.NDArray[np.uint8]:
        """One verified layer of a request that may still be arriving (layer-wise decode)."""
        timeout = _check_timeout(timeout)
        fields = self.call(AwaitLayer(rid, layer, timeout), timeout=timeout + 5)
        return ReceivedRequest(self, request_info(fields)).layer(layer)

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
