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


class _Client:
    def __init__(self, path: str, timeout: float) -> None:
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
        hello = self.call({"op": "hello"})
        self.segment = Segment.attach(str(hello["shm"]))

    def tell(self, msg: dict[str, Any]) -> None:
        """Send a one-way message: no round trip; a failure comes back as a pushed error."""
        send_blocking(self.sock, msg)

    def check(self, rid: str) -> None:
        """Raise the error the daemon pushed for ``rid``, if any."""
        self._collect()
        err = self._errors.pop(rid, None)
        if err is not None:
            raise err

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
            raise TransferError("TIMEOUT", f"daemon did not answer {msg['op']!r} in time") from e
        finally:
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
    ) -> Transfer:
        self.call(
            {
                "op": "begin",
                "rid": rid,
                "layer_sizes": [int(s) for s in layer_sizes],
                "block_hashes": [int(h) for h in block_hashes],
                "cached_blocks": cached_blocks,
                "deadline_s": deadline_s,
                "peer": peer,
            }
        )
        return Transfer(self, rid, list(layer_sizes))

    def cancel(self, rid: str, reason: str = "") -> None:
        self.call({"op": "cancel", "rid": rid, "reason": reason})

    def status(self) -> dict[str, Any]:
        return self.call({"op": "status"})

    def _drain_pushed(self) -> None:
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

    def wait(self, rid: str, timeout: float) -> Outcome:
        """Block until the daemon reports the request delivered or failed."""
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

    def layer_ready(self, layer: int) -> None:
        """Hand the layer over. One-way: the engine goes on computing at once; a refusal
        surfaces at the next call for this request and in its outcome."""
        self.client.check(self.rid)
        self.client.tell({"op": "ready", "rid": self.rid, "layer": layer})

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
    def __init__(self, control_socket: str, timeout: float = 60.0) -> None:
        super().__init__(control_socket, timeout)

    def await_request(self, rid: str | None = None, timeout: float = 30.0) -> ReceivedRequest:
        """The next complete request (or the given one); TransferError TIMEOUT/failed."""
        reply = self.call({"op": "await", "rid": rid, "timeout_s": timeout}, timeout=timeout + 5)
        return ReceivedRequest(self, reply)

    def await_layer(self, rid: str, layer: int, timeout: float = 30.0) -> npt.NDArray[np.uint8]:
        """One verified layer of a request that may still be arriving (layer-wise decode)."""
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
