"""What a daemon and its data worker processes say to each other (docs/data_workers.md).

Sans-IO like the wire protocol: typed messages, ``encode`` to bytes, and a ``JobReader`` that
takes bytes and returns messages, tested without processes or sockets. A frame is a 4-byte
big-endian length and a msgpack array ``[op, fields...]``; a connection's socket travels
beside an ``Adopt`` frame as SCM_RIGHTS ancillary data (the I/O layer's business).

The daemon keeps every decision and all connection state. A job lends a worker one
connection's socket for one payload move, together with the record state that move needs,
and the reply gives the state back: one owner at a time, as the send lock and the single
reader lend a socket to a data thread today.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from xdc.errors import ErrorCode, LocalConnectionError
from xdc.protocol.aead_records import KeyState, Opener, Sealer
from xdc.protocol.length_prefixed import FrameSplitter, FrameTooLarge, prefixed

# the largest frame either side accepts: a SEND of 64 chunks, or record state carrying up to
# a record's read-ahead (64 KiB) and a header, with room to spare
MAX_FRAME = 512 * 1024
MAX_CHUNKS = 64
MAX_BUFFERED = 128 * 1024
# bytes past a plain-TCP payload a RECV reply may carry back (the next frame's header, read
# with the payload's last bytes: ``sockio.READ_AHEAD``)
MAX_AHEAD = 64 * 1024
# a RUN's leases, and a LANDED message's cells
MAX_LEASES = 256
MAX_LEASE_LAYERS = 4096
MAX_LANDED = 1024
# stop flags: one byte each in a shared memory the daemon and its workers map; a RECV may name
# one, and the worker stops reading that payload once the daemon sets it (a verified resend
# of the same chunk is waiting to be copied into place)
STOP_SLOTS = 65536
FLAG_STOP = 1  # stop reading into it; a run leasing the buffer ends
# a run's lease only: its request is complete, so nothing more is landed in it (a chunk of it
# ends the run there, and the daemon reads it into scratch), but the run goes on with its
# other leases. A run ending at every request's completion lost what leasing requests to
# runs under way gained (64 MiB requests: 1.00x), and waiting for it delayed the delivery
FLAG_CLOSED = 2


class WorkerProtocolError(LocalConnectionError):
    """A frame between a daemon and its worker that neither would have written: the worker
    is treated as dead (its connections are lost, their chunks resent elsewhere)."""

    code = ErrorCode.INTERNAL


class Op(enum.IntEnum):
    ADOPT = 1  # daemon -> worker: a connection's socket, with this frame
    RECV = 2  # daemon -> worker: receive a payload into the pool
    SEND = 3  # daemon -> worker: send CHUNK frames whose payloads are in the pool
    DROP = 4  # daemon -> worker: close your copy of a connection's socket
    RUN = 5  # daemon -> worker: read a connection's frames, landing leased chunks, until one is not
    LEASE = 6  # daemon -> worker: one more lease for a RUN under way (a request just accepted)
    DONE = 16  # worker -> daemon: a job's outcome
    LANDED = 17  # worker -> daemon: chunks a RUN landed (their cells and verdicts), in order


class Failure(enum.IntEnum):
    """Why a job did not finish; each means the connection is lost, except NONE."""

    NONE = 0
    CLOSED = 1  # the socket failed or was dropped (reset, EPIPE, EBADF)
    EOF = 2  # the peer closed mid-payload
    IDLE = 3  # nothing arrived for the idle timeout
    SEALED = 4  # a record failed authentication, or its length was impossible
    BAD_JOB = 5  # a job the worker could not carry out (unknown connection, out of the pool)
    SUPERSEDED = 6  # a sealed read told to stop (its stop flag) with a record half read


@dataclass(frozen=True, slots=True)
class RecordState:
    """One direction of a connection's sealed records, lent for a job: the cipher, the
    direction's current secret and key generation, record number and bytes under the key, and
    (receiving) the bytes read past the last record opened."""

    cipher: str
    secret: bytes
    generation: int
    seq: int
    used: int
    rekey_bytes: int
    buffered: bytes = b""

    @classmethod
    def of(cls, direction: Sealer | Opener, buffered: bytes = b"") -> RecordState:
        """``direction`` as it stands now, to lend for one job."""
        k = direction.key_state()
        return cls(
            direction.cipher.label,
            k.secret,
            k.generation,
            k.seq,
            k.used,
            direction.rekey_bytes,
            buffered,
        )

    def key(self) -> KeyState:
        """The key state to resume a direction from."""
        return KeyState(self.secret, self.generation, self.seq, self.used)

    def fields(self) -> list[Any]:
        return [
            self.cipher,
            self.secret,
            self.generation,
            self.seq,
            self.used,
            self.rekey_bytes,
            self.buffered,
        ]


@dataclass(frozen=True, slots=True)
class Adopt:
    conn: int
    sealed: bool  # whether its data phase runs sealed records (else plain TCP)
    idle_timeout: float  # seconds of silence mid-payload before the move fails (0 = none)


@dataclass(frozen=True, slots=True)
class Recv:
    job: int
    conn: int
    offset: int  # where the payload goes in the pool
    length: int
    start: int  # bytes of it already there (read with its header)
    cell: tuple[str, int, int]  # (rid, layer, offset): what the checksum is bound to
    expect: int | None  # the checksum to verify, None = not checked (AEAD covers it)
    records: RecordState | None
    # a stop flag (0..STOP_SLOTS-1) the worker watches while it reads: once set, a plain read
    # ends where it is (the reply says how far: the rest of the payload is the daemon's to
    # skip) and a sealed one fails SUPERSEDED; None = read it all
    stop: int | None = None


@dataclass(frozen=True, slots=True)
class SendChunk:
    rid: str
    layer: int
    offset: int  # the chunk's offset within its layer
    length: int
    pool_offset: int
    checksum: int | None  # None: the worker computes it from the payload
    copy: bool | None = None  # the CHUNK header's ``copy``


@dataclass(frozen=True, slots=True)
class Send:
    job: int
    conn: int
    chunks: tuple[SendChunk, ...]
    records: RecordState | None


@dataclass(frozen=True, slots=True)
class Drop:
    conn: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A request whose chunks a RUN may land: its buffer's place in the pool, its grid, and
    its stop flag: once the daemon sets it, the run writes no more of it (a chunk of it half
    read is given up) and ends before its next frame."""

    rid: str
    base: int
    layer_sizes: tuple[int, ...]
    chunk_bytes: int
    stop: int


@dataclass(frozen=True, slots=True)
class Run:
    """Read ``conn``'s frames and land each CHUNK that is a first send (``copy`` False) of a
    leased request at its cell, verify it and report it (``Landed``); end at the first frame
    that is anything else, or a chunk off its request's grid, or when ``stop`` is set, and
    hand back what was read and not consumed (``Done.ahead``; ``Done.skip``: the rest of a
    payload left half read when told to stop). The daemon's books settle every report."""

    job: int
    conn: int
    leases: tuple[Lease, ...]
    buffered: bytes  # what the daemon had read past its last frame: the run's first bytes
    stop: int | None = None
    # sealed records: the receiving direction, lent for the run (its ``buffered``: ciphertext
    # read past the last record the daemon opened) and given back in ``Done.records``
    records: RecordState | None = None
    sampled: bool = False  # sealed records with sampled checksums (``checksum_sampled``)


@dataclass(frozen=True, slots=True)
class AddLease:
    """``lease`` joins the leases of RUN ``job`` on ``conn``, if that run is still under way
    (else it is dropped: the daemon lets go of it when the run's reply comes)."""

    conn: int
    job: int
    lease: Lease


# (rid, layer, offset, length, checksum, verdict); verdict None: given up half read (its
# lease's stop flag was set), the rest of its payload skipped
LandedCell = tuple[str, int, int, int, int, bool | None]


@dataclass(frozen=True, slots=True)
class Landed:
    job: int
    cells: tuple[LandedCell, ...]


@dataclass(frozen=True, slots=True)
class Done:
    job: int
    moved: int  # payload bytes received (RECV, counting ``start``) or sent (SEND)
    verdict: bool | None  # RECV: whether the checksum matched (None for SEND or on failure)
    records: RecordState | None
    failure: Failure = Failure.NONE
    detail: str = ""
    # RECV of plain TCP: the bytes the worker's last read took past the payload, for the
    # daemon's frame parser (only with the whole payload moved); RUN: every byte read and
    # not consumed
    ahead: bytes = b""
    skip: int = 0  # RUN: payload bytes still to come of a chunk it stopped reading


Message = Adopt | Recv | Send | Drop | Run | AddLease | Landed | Done


def encode(msg: Message) -> bytes:
    """One frame for ``msg``."""
    body: list[Any]
    if isinstance(msg, Adopt):
        body = [Op.ADOPT, msg.conn, msg.sealed, msg.idle_timeout]
    elif isinstance(msg, Recv):
        body = [Op.RECV, msg.job, msg.conn, msg.offset, msg.length, msg.start, list(msg.cell)]
        body += [msg.expect, _state_out(msg.records), msg.stop]
    elif isinstance(msg, Send):
        chunks = [
            [c.rid, c.layer, c.offset, c.length, c.pool_offset, c.checksum, c.copy]
            for c in msg.chunks
        ]
        body = [Op.SEND, msg.job, msg.conn, chunks, _state_out(msg.records)]
    elif isinstance(msg, Drop):
        body = [Op.DROP, msg.conn]
    elif isinstance(msg, Run):
        leases = [_lease_out(x) for x in msg.leases]
        body = [Op.RUN, msg.job, msg.conn, leases, msg.buffered, msg.stop]
        body += [_state_out(msg.records), msg.sampled]
    elif isinstance(msg, AddLease):
        body = [Op.LEASE, msg.conn, msg.job, _lease_out(msg.lease)]
    elif isinstance(msg, Landed):
        body = [Op.LANDED, msg.job, [list(c) for c in msg.cells]]
    else:
        body = [Op.DONE, msg.job, msg.moved, msg.verdict, _state_out(msg.records)]
        body += [int(msg.failure), msg.detail[:512], msg.ahead, msg.skip]
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise WorkerProtocolError(f"a {Op(body[0]).name} frame of {len(payload)} bytes")
    return prefixed(payload)


class JobReader:
    """Bytes in, messages out. ``feed`` raises WorkerProtocolError for anything malformed;
    after that the reader is spent (the other side is not to be trusted further)."""

    def __init__(self) -> None:
        self._frames = FrameSplitter(MAX_FRAME)
        self._broken = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        if self._broken:
            raise WorkerProtocolError("the worker channel already failed")
        try:
            try:
                bodies = self._frames.feed(data)
            except FrameTooLarge as e:
                raise WorkerProtocolError(str(e)) from None
            out = [decode(raw) for raw in bodies]
        except WorkerProtocolError:
            self._broken = True
            raise
        return out

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame (a channel that ends with some was cut mid-frame)."""
        return self._frames.pending


def decode(raw: bytes) -> Message:
    """One frame's body (without its length) as a message."""
    try:
        body = msgpack.unpackb(raw, use_list=True, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise WorkerProtocolError(f"undecodable frame: {e}") from None
    if not isinstance(body, list) or not body:
        raise WorkerProtocolError("a frame must be a non-empty array")
    op, f = body[0], body[1:]
    try:
        if op == Op.ADOPT:
            _arity(f, 3)
            return Adopt(_uint(f[0]), _bool(f[1]), _seconds(f[2]))
        if op == Op.RECV:
            _arity(f, 9)
            cell = f[5]
            if not (isinstance(cell, list) and len(cell) == 3):
                raise WorkerProtocolError("RECV cell must be [rid, layer, offset]")
            return Recv(
                _uint(f[0]),
                _uint(f[1]),
                _uint(f[2]),
                _uint(f[3]),
                _uint(f[4]),
                (_str(cell[0]), _uint(cell[1]), _uint(cell[2])),
                None if f[6] is None else _uint(f[6]),
                _state_in(f[7]),
                None if f[8] is None else _slot(f[8]),
            )
        if op == Op.SEND:
            _arity(f, 4)
            if not isinstance(f[2], list) or not 0 < len(f[2]) <= MAX_CHUNKS:
                raise WorkerProtocolError(f"SEND takes 1..{MAX_CHUNKS} chunks")
            return Send(_uint(f[0]), _uint(f[1]), tuple(_chunk(c) for c in f[2]), _state_in(f[3]))
        if op == Op.DROP:
            _arity(f, 1)
            return Drop(_uint(f[0]))
        if op == Op.RUN:
            _arity(f, 7)
            if not isinstance(f[2], list) or not 0 < len(f[2]) <= MAX_LEASES:
                raise WorkerProtocolError(f"RUN takes 1..{MAX_LEASES} leases")
            buffered = f[3]
            if not isinstance(buffered, bytes) or len(buffered) > MAX_AHEAD:
                raise WorkerProtocolError(f"RUN may start with at most {MAX_AHEAD} bytes")
            stop = None if f[4] is None else _slot(f[4])
            leases = tuple(_lease(x) for x in f[2])
            return Run(
                _uint(f[0]), _uint(f[1]), leases, buffered, stop, _state_in(f[5]), _bool(f[6])
            )
        if op == Op.LEASE:
            _arity(f, 3)
            return AddLease(_uint(f[0]), _uint(f[1]), _lease(f[2]))
        if op == Op.LANDED:
            _arity(f, 2)
            if not isinstance(f[1], list) or not 0 < len(f[1]) <= MAX_LANDED:
                raise WorkerProtocolError(f"LANDED takes 1..{MAX_LANDED} cells")
            return Landed(_uint(f[0]), tuple(_landed(c) for c in f[1]))
        if op == Op.DONE:
            _arity(f, 8)
            verdict = f[2]
            if verdict is not None:
                verdict = _bool(verdict)
            try:
                failure = Failure(f[4])
            except ValueError:
                raise WorkerProtocolError(f"unknown failure {f[4]!r}") from None
            ahead = f[6]
            if not isinstance(ahead, bytes) or len(ahead) > MAX_AHEAD:
                raise WorkerProtocolError(f"DONE may carry at most {MAX_AHEAD} bytes read ahead")
            return Done(
                _uint(f[0]),
                _uint(f[1]),
                verdict,
                _state_in(f[3]),
                failure,
                _str(f[5]),
                ahead,
                _uint(f[7]),
            )
    except (TypeError, IndexError) as e:
        raise WorkerProtocolError(f"malformed {op!r} frame: {e}") from None
    raise WorkerProtocolError(f"unknown op {op!r}")


def _state_out(s: RecordState | None) -> list[Any] | None:
    return None if s is None else s.fields()


def _state_in(v: Any) -> RecordState | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 7:
        raise WorkerProtocolError("record state must be a 7-element array")
    secret, buffered = v[1], v[6]
    if not isinstance(secret, bytes) or len(secret) != 32:
        raise WorkerProtocolError("record state secret must be 32 bytes")
    if not isinstance(buffered, bytes) or len(buffered) > MAX_BUFFERED:
        raise WorkerProtocolError(f"record state may carry at most {MAX_BUFFERED} buffered bytes")
    return RecordState(
        _str(v[0]), secret, _uint(v[2]), _uint(v[3]), _uint(v[4]), _uint(v[5]), buffered
    )


def _chunk(c: Any) -> SendChunk:
    if not isinstance(c, list) or len(c) != 7:
        raise WorkerProtocolError("a SEND chunk must be a 7-element array")
    checksum = None if c[5] is None else _uint(c[5])
    copy = None if c[6] is None else _bool(c[6])
    return SendChunk(_str(c[0]), _uint(c[1]), _uint(c[2]), _uint(c[3]), _uint(c[4]), checksum, copy)


def _lease_out(x: Lease) -> list[Any]:
    return [x.rid, x.base, list(x.layer_sizes), x.chunk_bytes, x.stop]


def _lease(x: Any) -> Lease:
    if not isinstance(x, list) or len(x) != 5 or not isinstance(x[2], list):
        raise WorkerProtocolError("a lease is [rid, base, [layer sizes], chunk bytes, stop]")
    if len(x[2]) > MAX_LEASE_LAYERS:
        raise WorkerProtocolError(f"a lease of more than {MAX_LEASE_LAYERS} layers")
    chunk = _uint(x[3])
    if not chunk:
        raise WorkerProtocolError("a lease's chunk bytes must be > 0")
    return Lease(_str(x[0]), _uint(x[1]), tuple(_uint(v) for v in x[2]), chunk, _slot(x[4]))


def _landed(c: Any) -> LandedCell:
    if not isinstance(c, list) or len(c) != 6:
        raise WorkerProtocolError("a LANDED cell is [rid, layer, offset, length, checksum, ok]")
    verdict = None if c[5] is None else _bool(c[5])
    return (_str(c[0]), _uint(c[1]), _uint(c[2]), _uint(c[3]), _uint(c[4]), verdict)


def _slot(v: Any) -> int:
    slot = _uint(v)
    if slot >= STOP_SLOTS:
        raise WorkerProtocolError(f"stop flag {slot} (there are {STOP_SLOTS})")
    return slot


def _arity(f: list[Any], n: int) -> None:
    if len(f) != n:
        raise WorkerProtocolError(f"expected {n} fields, got {len(f)}")


def _uint(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
        raise WorkerProtocolError(f"expected an unsigned 64-bit integer, got {v!r:.40}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise WorkerProtocolError(f"expected a boolean, got {v!r:.40}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str) or len(v) > 1024:
        raise WorkerProtocolError(f"expected a string of at most 1024 characters, got {v!r:.40}")
    return v


def _seconds(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e9:
        raise WorkerProtocolError(f"expected seconds >= 0, got {v!r:.40}")
    return float(v)
