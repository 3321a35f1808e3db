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

import itertools
import select
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from xdc.transport.control import ControlError, recv_blocking, send_blocking
from xdc.transport.shm import Segment


class TransferError(Exception):
    """The daemon refused or failed a request; ``code`` says why (e.g. NO_SPACE, DEADLINE)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Outcome:
    rid: str
    ok: bool
    code: str
    error: str
    bytes: int
    elapsed_s: float
    tail_s: float | None
    resent_chunks: int


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
    def __init__(self, path: str, timeout: float, hello: dict[str, Any] | None = None) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            raise ControlError(f"cannot reach the xdc daemon at {path}: {e}") from e
        self._ids = itertools.count(1)
        self._pushed: deque[dict[str, Any]] = deque()
        # errors the daemon pushed for one-way messages, raised at the next call for that rid
        self._errors: dict[str, TransferError] = {}
        self._broken = ""
        try:
            reply = self.call({"op": "hello", **(hello or {})})
            self.segment = Segment.attach(str(reply["shm"]))
        except BaseException:
            self.sock.close()
            raise

    def tell(self, msg: dict[str, Any]) -> None:
        """Send a one-way message: no round trip; a failure comes back as a pushed error."""
        send_blocking(self.sock, msg)

    def check(self, rid: str) -> None:
        """Raise the error the daemon pushed for ``rid``, if any (one that is still on its
        way is raised by a later call: the daemon answers calls in order, after it)."""
        self._pump()
        self._collect()
        err = self._errors.pop(rid, None)
        if err is not None:
            raise err

    def _pump(self) -> None:
        """Read whatever the daemon has pushed so far, without waiting for more."""
        while not self._broken and select.select([self.sock], [], [], 0)[0]:
            self._pushed.append(recv_blocking(self.sock))

    def _collect(self) -> None:
        keep: deque[dict[str, Any]] = deque()
        while self._pushed:
            ev = self._pushed.popleft()
            if ev.get("event") == "error":
                self._errors[str(ev.get("rid"))] = TransferError(
                    str(ev.get("code", "ERROR")), str(ev.get("error", ""))
                )
            else:
                keep.append(ev)
        self._pushed = keep

    def call(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if self._broken:
            raise ControlError(f"connection to {self.path} is unusable ({self._broken})")
        mid = next(self._ids)
        msg = {**msg, "id": mid}
        old = self.sock.gettimeout()
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            send_blocking(self.sock, msg)
            while True:
                reply = recv_blocking(self.sock)
                if reply.get("event"):
                    self._pushed.append(reply)
                    continue
                if reply.get("id") != mid:
                    raise ControlError(f"reply out of order: {reply.get('id')} != {mid}")
                if not reply.get("ok"):
                    raise TransferError(
                        str(reply.get("code", "ERROR")), str(reply.get("error", ""))
                    )
                return reply
        except TimeoutError as e:
            # The daemon may still answer later; that answer must never be taken for the
            # reply to a later call, so this connection is done (the daemon then gives back
            # whatever it would have handed us).
            self._broken = f"no answer to {msg['op']!r} in time"
            self.sock.close()
            raise TransferError("TIMEOUT", f"daemon did not answer {msg['op']!r} in time") from e
        finally:
            if not self._broken:
                self.sock.settimeout(old)

    def close(self) -> None:
        self.segment.close()
        self.sock.close()


class PrefillClient(_Client):
    def __init__(self, control_socket: str, timeout: float = 60.0) -> None:
        super().__init__(control_socket, timeout)
        self._outcomes: dict[str, Outcome] = {}

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
            {
                "op": "begin",
                "rid": rid,
                "layer_sizes": [int(s) for s in layer_sizes],
                "block_hashes": [int(h) for h in block_hashes],
                "cached_blocks": cached_blocks,
                "deadline_s": deadline_s,
                "peer": peer,
                "layout": _check_layout(layout),
            }
        )
        return Transfer(self, rid, list(layer_sizes))

    def cancel(self, rid: str, reason: str = "") -> None:
        self.call({"op": "cancel", "rid": rid, "reason": reason})

    def status(self) -> dict[str, Any]:
        return self.call({"op": "status"})

    def _drain_pushed(self) -> None:
        self._pump()
        self._collect()
        while self._pushed:
            ev = self._pushed.popleft()
            if ev.get("event") == "outcome":
                o = Outcome(
                    rid=str(ev["rid"]),
                    ok=bool(ev["ok"]),
                    code=str(ev.get("code") or ""),
                    error=str(ev.get("error") or ""),
                    bytes=int(ev.get("bytes") or 0),
                    elapsed_s=float(ev.get("elapsed_s") or 0.0),
                    tail_s=None if ev.get("tail_s") is None else float(ev["tail_s"]),
                    resent_chunks=int(ev.get("resent_chunks") or 0),
                )
                self._outcomes[o.rid] = o

    def poll_outcomes(self) -> list[Outcome]:
        """Outcomes that have arrived so far (without waiting)."""
        self._drain_pushed()
        out = list(self._outcomes.values())
        self._outcomes.clear()
        return out

    def poll(self, rid: str) -> Outcome | None:
        """The request's outcome if the daemon has reported it, without waiting."""
        self._drain_pushed()
        return self._outcomes.pop(rid, None)

    def wait(self, rid: str, timeout: float) -> Outcome:
        """Block until the daemon reports the request delivered or failed."""
        timeout = _check_timeout(timeout)
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            while True:
                self._drain_pushed()
                if rid in self._outcomes:
                    return self._outcomes.pop(rid)
                self._pushed.append(recv_blocking(self.sock))
        except TimeoutError as e:
            raise TransferError("TIMEOUT", f"no outcome for {rid} within {timeout}s") from e
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
            reply = self.client.call(
                {"op": "alloc", "rid": self.rid, "layer": layer, "layers": [layer, *ahead]}
            )
            self._asked.update([layer, *ahead])
            for k, v in reply.get("offsets") or [(layer, reply["offset"])]:
                self._offsets[int(k)] = int(v)
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
        msg: dict[str, Any] = {"op": "ready", "rid": self.rid, "layer": layer}
        if upto is not None:
            if isinstance(upto, bool) or not isinstance(upto, int):
                raise TypeError("upto must be an int")
            msg["upto"] = upto
        self.client.tell(msg)

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

    def __init__(self, client: DecodeClient, info: dict[str, Any]) -> None:
        self.client = client
        self.rid = str(info["rid"])
        self.offset = int(info["offset"])
        self.layer_sizes = [int(x) for x in info["layer_sizes"]]
        self.layer_offsets = [int(x) for x in info["layer_offsets"]]
        self.block_hashes = [int(x) for x in info["block_hashes"]]
        self.cached_blocks = int(info["cached_blocks"])
        self.layout = str(info.get("layout") or "")
        self.transfer_s = info.get("transfer_s")
        self.released = False

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_sizes)

    def layer(self, i: int) -> npt.NDArray[np.uint8]:
        if self.released:
            raise TransferError("RELEASED", f"{self.rid} was released")
        return np.frombuffer(
            self.client.segment.view,
            dtype=np.uint8,
            count=self.layer_sizes[i],
            offset=self.offset + self.layer_offsets[i],
        )

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.client.call({"op": "release", "rid": self.rid})


class DecodeClient(_Client):
    def __init__(
        self, control_socket: str, timeout: float = 60.0, *, layout: str | None = None
    ) -> None:
        """``layout``: the KV layout this engine accepts; the receiver then refuses requests
        announced with another (or none) before any of their bytes move."""
        hello = {"layout": _check_layout(layout)} if layout is not None else None
        super().__init__(control_socket, timeout, hello)

    def await_request(self, rid: str | None = None, timeout: float = 30.0) -> ReceivedRequest:
        """The next complete request (or the given one). ``timeout`` 0 only looks. Raises
        TransferError: code TIMEOUT when nothing is complete in time, or the request's
        failure (DEADLINE, CANCELLED, LAYOUT_MISMATCH, ...)."""
        timeout = _check_timeout(timeout)
        reply = self.call({"op": "await", "rid": rid, "timeout_s": timeout}, timeout=timeout + 5)
        return ReceivedRequest(self, reply)

    def await_layer(self, rid: str, layer: int, timeout: float = 30.0) -> npt.NDArray[np.uint8]:
        """One verified layer of a request that may still be arriving (layer-wise decode)."""
        timeout = _check_timeout(timeout)
        reply = self.call(
            {"op": "await_layer", "rid": rid, "layer": layer, "timeout_s": timeout},
            timeout=timeout + 5,
        )
        info = ReceivedRequest(self, reply)
        return info.layer(layer)

    def status(self) -> dict[str, Any]:
        return self.call({"op": "status"})

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
