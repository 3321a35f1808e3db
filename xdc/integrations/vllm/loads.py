"""The decode side of the vLLM connector: waiting for transfers, landing them in vLLM's blocks,
and checking every block it fills (moved out of connector.py, as ``saves`` holds the producer's
hand-over). Driven by the engine's own per-step calls; no thread of its own but the hashing
threads of a GPU landing (``Loader._land_on_device``), or the reader threads of its hash
helper processes (``xdc.integrations.hash_helpers``)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from prometheus_client import Counter

from xdc.config import usable_cores
from xdc.errors import ResultCode, XdcError
from xdc.integrations.hash_helpers import HashHelpers, acquire, helpers_for, release
from xdc.integrations.kvcopy import NULL_BLOCK, BlockCopier, BlockShape, Copy, pool_tensor
from xdc.integrations.vllm.blocks import (
    GroupKind,
    KvPlan,
    LoadSpec,
    Piece,
    arrival_message,
    arrival_mismatch,
    arrival_positions,
    digest_layer_bytes,
    digest_offsets,
    hash_threads,
    prompt_slot,
)
from xdc.integrations.vllm.params import ConnectorConfig
from xdc.protocol.engine_control import MAX_AWAIT_RIDS, check_rid
from xdc.transport.engine_client import DecodeClient, ReceivedRequest

# under "vllm." so that vLLM's logging configuration shows it (the connector's logger)
log = logging.getLogger("vllm.xdc.connector")

LOAD_FAILURES = Counter(
    "xdc_vllm_kv_load_failures",
    "Decode requests whose KV transfer failed and were recomputed locally, by reason",
    ["reason"],
)
LOADS = Counter("xdc_vllm_kv_loads", "Decode requests whose KV arrived through xdc")

# Planted faults, for the differential test's proof that it catches them (never set in
# production): "wrong_block" lands the first block of each load in the next block's place;
# "stale_write" lands loads whose request vLLM already freed; "zero_state" zeroes the moved
# linear-attention / SSM state after it landed (what a decode of the wrong state looks like);
# "unbound_prompt" lands KV made from another prompt (what a mixed-up transfer id did);
# "other_shard" has each tensor-parallel rank ask for the next rank's share (connector.py).
FAULT = os.environ.get("XDC_CONNECTOR_FAULT", "")


def _takes(rid: str) -> bool:
    """Whether the receiver takes ``rid`` as a transfer id (the engine protocol's rule)."""
    try:
        check_rid(rid)
    except XdcError:
        return False
    return True


def _block_digest(t: torch.Tensor, shape: BlockShape, b: int) -> int:
    """xxh3-64 of vLLM block ``b`` of a layer's KV tensor, as bytes (in logical order, as
    the copies move them)."""
    return xxhash.xxh3_64_intdigest(_block_bytes_of(t, b * shape.rows, shape.rows).numpy())


def _block_bytes_of(t: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Blocks ``b .. b + n - 1`` of a KV tensor as bytes (a copy only if they are strided)."""
    x = t[b : b + n]
    if not x.is_contiguous():
        x = x.contiguous()
    return x.view(-1).view(torch.uint8)


def _shifted(p: Piece) -> Piece:
    """Planted fault: the piece's first block lands in the second one's place."""
    ids = p.block_ids
    return Piece(p.group, p.first, (ids[1], *ids[1:])) if len(ids) > 1 else p


class Loader:
    """The decode side's waiting, driven by the engine's own per-step calls.

    Every step, ``poll`` asks the local receiver once, without waiting, for any of the pending
    transfers (one call on a Unix socket, only while loads are pending), lands the complete
    ones and checks deadlines. No thread: a loader thread had to win the GIL from the engine's
    busy loop (which spins while requests wait for KV) and that added tens of milliseconds to
    every load (bench/vllm_ttft.py: 256 tokens 48 ms remote TTFT with a thread).
    """

    # a receiver that does not answer a non-waiting call within this is treated as gone
    CALL_TIMEOUT_S = 5.0
    LANDS_PER_POLL = 16
    # the engine spins through thousands of empty steps a second while requests wait: asking
    # the receiver at every one of them took a core from it (3,584 tokens: 640 ms TTFT);
    # every 2 ms costs it little and adds at most that much to a load
    POLL_INTERVAL_S = 0.002
    # a hash helper that has not answered a check this long is killed, failing its checks
    # (a load's blocks hash in well under a second on one core; xdc.integrations.hash_helpers)
    HASH_STALL_S = 10.0

    def __init__(
        self,
        cfg: ConnectorConfig,
        layout: str,
        kv: dict[str, torch.Tensor],
        shapes: list[BlockShape],
        plan: KvPlan,
        copier: BlockCopier,
        readers: int = 1,
        ranks: int = 1,
    ) -> None:
        """``ranks``: the engine's tensor-parallel size (its ranks share the host's cores,
        which ``hash_helpers = "auto"`` divides among them)."""
        self.cfg = cfg
        self.readers = readers  # this engine's ranks that read each transfer (shared: all)
        self.plan = plan
        self.layout = layout
        self.kv = list(kv.values())
        self.shapes = shapes
        self.bb = [sh.block_bytes for sh in shapes]
        self.copier = copier
        # loads whose device copies are still in flight (GPU): rid -> landing
        self._landing: dict[str, Landing] = {}
        self._hasher: ThreadPoolExecutor | None = None  # arrival hashes of GPU loads
        # ...or in helper processes: started at the first GPU landing (None: not yet)
        self._helpers: HashHelpers | None = None
        self._helpers_wanted = (
            helpers_for(usable_cores(), ranks)
            if cfg.hash_helpers == "auto"
            else int(cfg.hash_helpers)
        )
        self._rx_pool: torch.Tensor | None = None  # the receiver's pool, pinned while in use
        self._pending: dict[str, tuple[LoadSpec, float, bool]] = {}  # rid -> (spec, t0, arriving)
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._rx: DecodeClient | None = None
        self._next_check = 0.0
        self._next_poll = 0.0
        self._ghosts: set[str] = set()  # planted stale writes: landed but never reported
        self.reasons: dict[str, str] = {}  # failed loads since the last step: req_id -> why

    def add(self, specs: list[LoadSpec]) -> None:
        now = time.monotonic()
        for s in specs:
            if s.error:
                self._fail(s, "blocks", s.error)
                with contextlib.suppress(XdcError, OSError):
                    self._client().discard(s.rid)
            elif not _takes(s.rid):
                # the receiver refuses such a name, and its refusal names no request: asked
                # beside the others, it would fail them all as if the receiver were gone
                self._fail(s, "bad_request", f"transfer id {s.rid!r:.60} is not one it takes")
            elif s.rid in self._pending:
                self._fail(s, "duplicate", f"transfer {s.rid} is already awaited")
            else:
                self._pending[s.rid] = (s, now, False)

    def drop(self, req_ids: list[str], why: str = "it finished before its transfer landed") -> None:
        """vLLM finished these requests (an abort, mostly) while their load may be pending.
        vLLM 0.32 keeps the blocks of a request aborted while WAITING_FOR_REMOTE_KVS until
        the connector reports it in finished_recving, and frees them then. So a pending load
        is taken out now, reported finished at this step's end (vLLM frees the blocks), and
        never lands afterwards; the receiver discards the transfer (or refuses it when it
        comes). The old loader kept waiting until its own timeout (30 s): the blocks were
        held that long for a request nobody wanted."""
        gone = set(req_ids)
        for rid, (spec, _, _) in list(self._pending.items()):
            if spec.req_id not in gone:
                continue
            self._done.add(spec.req_id)  # finished_recving: vLLM frees the blocks
            log.info("xdc: request %s: transfer %s dropped: %s", spec.req_id, rid, why)
            if FAULT == "stale_write":
                self._ghosts.add(spec.req_id)  # planted: it still lands, into freed blocks
                continue
            del self._pending[rid]
            with contextlib.suppress(XdcError, OSError):
                self._client().discard(rid)

    def take(self) -> tuple[set[str], set[str]]:
        """Poll once, then hand over (loaded, failed) vLLM request ids."""
        if self._landing:
            self._finish_landings()
        now = time.monotonic()
        if self._pending and now >= self._next_poll:
            self._next_poll = now + self.POLL_INTERVAL_S
            try:
                self._poll()
            except (XdcError, OSError) as e:
                # the receiver or its socket failed: every waiting request recomputes
                log.error("xdc: the receiver's socket failed: %s", e)
                for spec, _, _ in list(self._pending.values()):
                    self._fail(spec, "receiver_gone", f"receiver unreachable: {e}")
                self._pending.clear()
                self._close()
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        return done, failed

    def stop(self) -> None:
        self._close()
        if self._helpers is not None:
            release(self._helpers)
            self._helpers = None

    def _close(self) -> None:
        """Everything tied to the receiver (also when it failed, to start afresh with the
        next); the hash helpers map pools by name and outlive a receiver, so they stay."""
        self._finish_landings(wait=True)  # nothing may still read the pool
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None
        if self._rx_pool is not None:
            self.copier.unpin(self._rx_pool)
            self._rx_pool = None
        if self._rx is not None:
            with contextlib.suppress(Exception):
                self._rx.close()
        self._rx = None

    def _client(self) -> DecodeClient:
        if self._rx is None:
            self._rx = DecodeClient(
                self.cfg.receiver_socket,
                self.CALL_TIMEOUT_S,
                layout=self.layout,
                readers=self.readers,
            )
            self._rx_pool = pool_tensor(self._rx.segment.view)
            self.copier.pin(self._rx_pool)  # a DMA source (GPU)
        return self._rx

    def _fail(self, spec: LoadSpec, reason: str, why: str) -> None:
        if spec.req_id in self._ghosts:  # planted fault: reported already, when dropped
            self._ghosts.discard(spec.req_id)
            return
        log.warning(
            "xdc: request %s (transfer %s): %s; prefilling it locally", spec.req_id, spec.rid, why
        )
        LOAD_FAILURES.labels(reason).inc()
        self._failed.add(spec.req_id)
        self.reasons[spec.req_id] = reason

    def _poll(self) -> None:
        """Land up to ``LANDS_PER_POLL`` complete transfers. One await names at most
        ``MAX_AWAIT_RIDS`` requests, so the waiting ones are asked about in slices of that
        many (naming them all in one call once failed every one of them as if the receiver
        were gone, when more than that many waited)."""
        rx = self._client()
        landed = 0  # or failed
        waiting = list(self._pending)
        for start in range(0, len(waiting), MAX_AWAIT_RIDS):
            batch = waiting[start : start + MAX_AWAIT_RIDS]
            while landed < self.LANDS_PER_POLL:
                batch = [rid for rid in batch if rid in self._pending]
                if not batch:
                    break
                try:
                    req = rx.await_any(batch, timeout=0)
                except XdcError as e:
                    rid, code = e.rid, e.code
                    if code == ResultCode.TIMEOUT:
                        break  # nothing of this slice is complete now
                    if rid in self._pending:
                        spec = self._pending.pop(rid)[0]
                        self._fail(spec, str(code).lower(), f"transfer failed: {e}")
                        landed += 1
                        continue
                    raise
                self._take_complete(req, self._pending.pop(req.rid)[0])
                landed += 1
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + 0.1
            self._check_deadlines(rx, now)

    def _land(self, req: ReceivedRequest, spec: LoadSpec) -> Landing | None:
        """Copy a complete transfer into the engine's blocks and check it landed right. On
        CPU that is done when this returns (None); a GPU's copies complete later: the
        landing is returned and finished by ``_finish_landings``."""
        plan, n = self.plan, len(self.kv)
        counts = plan.layer_blocks(spec.tokens)
        want = [c * bb for c, bb in zip(counts, self.bb, strict=True)]
        want.append(digest_layer_bytes(counts))
        sizes = list(req.layer_sizes)
        if sizes != want:
            self._fail(
                spec,
                "size_mismatch",
                f"transfer has {len(sizes)} layers of {sorted(set(sizes))[:4]} bytes, expected "
                f"{len(want)} of {sorted(set(want))[:4]} (the KV layers and a digest layer)",
            )
            return None
        digests = req.layer(n).view(np.dtype("<u8"))
        made_from = int(digests[prompt_slot(counts)])
        if made_from != spec.prompt_digest and FAULT != "unbound_prompt":
            self._fail(
                spec,
                "prompt_mismatch",
                f"the transfer's KV was made from another prompt (digest {made_from:016x}, "
                f"this request's {spec.prompt_digest:016x}): a transfer id reused or mixed up",
            )
            return None
        own = {p.group: p for p in spec.pieces}
        pieces = {k: _shifted(p) for k, p in own.items()} if FAULT == "wrong_block" else own
        at = digest_offsets(counts)
        if self.copier.device != "cpu":
            return self._land_on_device(req, spec, own, pieces, digests, at)
        for i, dst in enumerate(self.kv):
            p = pieces.get(plan.layer_groups[i])
            if p is not None:
                src = torch.from_numpy(req.layer(i))
                self.copier.load(dst, self.shapes[i], p.block_ids, src, p.first)
        # read back what vLLM's blocks now hold, at the ids it gave us
        for i, dst in enumerate(self.kv):
            k = plan.layer_groups[i]
            p = own.get(k)
            if p is None:
                continue
            for j, b in enumerate(p.block_ids):
                if b == NULL_BLOCK:
                    continue
                if _block_digest(dst, self.shapes[i], b) != int(digests[at[i] + p.first + j]):
                    self._fail(
                        spec,
                        "integrity",
                        f"layer {i} block {p.first + j} (vLLM block {b}) does not hash to "
                        "what the producer copied",
                    )
                    return None
            if FAULT == "zero_state" and plan.groups[k].kind is GroupKind.STATE:
                for b in p.block_ids:
                    dst[b].zero_()  # planted: a wrong state reaches the engine
        self._loaded(spec)
        return None

    def _land_on_device(
        self,
        req: ReceivedRequest,
        spec: LoadSpec,
        own: dict[int, Piece],
        pieces: dict[int, Piece],
        digests: np.ndarray[Any, np.dtype[np.uint64]],
        at: list[int],
    ) -> Landing:
        """The GPU's check, in two halves that never bring the KV back to the host: the
        bytes as they arrived (host memory) hash to what the producer copied, and the
        blocks read back on the device where the engine will look equal what was copied.

        The first half runs in helper processes while the copies run (``hash_helpers``;
        in hashing threads where there are none): hashing every block on the engine's
        thread stalled its step for the whole request (xxh3 of 1.07 GB, the 8K-token
        profile: ~130 ms on the 2-core lab VM, one core), and threads of this process take
        turns at the GIL with it (python-xxhash keeps the GIL for blocks of 64 KiB or
        less). The load is reported (loaded or failed) only once both halves are in; a
        mismatch fails it after its blocks were written, which the engine then recomputes,
        as it does when the device check fails."""
        plan = self.plan
        hashes = [
            self._arrival_hash(req, i, own[plan.layer_groups[i]], digests, at[i])
            for i in range(len(self.kv))
            if plan.layer_groups[i] in own
        ]
        copies: list[Copy] = []
        try:
            for i, dst in enumerate(self.kv):
                k = plan.layer_groups[i]
                p = pieces.get(k)
                if p is None:
                    continue
                src = torch.from_numpy(req.layer(i))
                check = own[k].block_ids
                copies.append(
                    self.copier.load(dst, self.shapes[i], p.block_ids, src, p.first, check)
                )
        except BaseException:
            for h in hashes:  # they read the pool, which the caller now releases
                if not h.cancel():
                    h.exception()  # under way: until it is done
            raise
        return Landing(spec, req, copies, hashes)

    def _arrival_hash(
        self,
        req: ReceivedRequest,
        i: int,
        piece: Piece,
        digests: np.ndarray[Any, np.dtype[np.uint64]],
        at: int,
    ) -> Future[str | None]:
        """Why layer ``i``'s arrived blocks are not the producer's, or None, when known."""
        if self._helpers is None and self._helpers_wanted > 0:
            try:
                self._helpers = acquire(self._helpers_wanted)
            except OSError as e:
                log.warning("xdc: no hash helper processes (%s): hashing in threads", e)
            self._helpers_wanted = 0  # started once, or never
        if self._helpers is not None and self._helpers.usable:
            positions, expected = arrival_positions(piece, digests, at)
            offset = req.offset + req.layer_offsets[i]
            found = self._helpers.check(
                req.client.segment.name, offset, self.bb[i], positions, expected
            )
            out: Future[str | None] = Future()

            def verdict(f: Future[int]) -> None:
                with contextlib.suppress(InvalidStateError):  # cancelled: nobody reads it
                    e = f.exception()
                    if e is not None:
                        out.set_exception(e)
                    else:
                        k = f.result()
                        out.set_result(None if k < 0 else arrival_message(i, int(positions[k])))

            found.add_done_callback(verdict)
            return out
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(hash_threads(), thread_name_prefix="xdc-hash")
        return self._hasher.submit(
            arrival_mismatch, req.layer(i), self.bb[i], piece, digests, at, i
        )

    def _finish_landings(self, wait: bool = False) -> None:
        """Loads whose device copies completed: reported loaded (or failed), their pool
        bytes released."""
        if self._helpers is not None:
            self._helpers.reap(self.HASH_STALL_S)
        for rid, landing in list(self._landing.items()):
            if wait:
                for c in landing.copies:
                    c.wait()
                for h in landing.hashes:
                    with contextlib.suppress(FutureTimeout):
                        h.exception(timeout=self.HASH_STALL_S)  # the verdict is read below
                    if not h.done() and self._helpers is not None:
                        self._helpers.reap(0.0)  # a helper that never answers: it fails it
                    h.exception()
            elif not all(c.done() for c in landing.copies) or not all(
                h.done() for h in landing.hashes
            ):
                continue
            del self._landing[rid]
            with contextlib.suppress(XdcError, OSError):
                landing.req.release()
            arrived = next((why for h in landing.hashes if (why := _verdict(h))), None)
            if arrived is not None:
                self._fail(landing.spec, "integrity", arrived)
            elif all(c.verified() for c in landing.copies):
                self._loaded(landing.spec)
            else:
                self._fail(
                    landing.spec,
                    "integrity",
                    "the blocks read back on the device differ from what was copied there",
                )

    def _loaded(self, spec: LoadSpec) -> None:
        if spec.req_id in self._ghosts:  # planted fault: reported already, when dropped
            self._ghosts.discard(spec.req_id)
            return
        LOADS.inc()
        self._done.add(spec.req_id)

    def _check_deadlines(self, rx: DecodeClient, now: float) -> None:
        for rid, (spec, since, arriving) in list(self._pending.items()):
            if now - since > spec.timeout_s:
                self._pending.pop(rid)
                with contextlib.suppress(XdcError):
                    rx.discard(rid)
                self._fail(spec, "timeout", f"not complete within {spec.timeout_s:g}s")
            elif not arriving and now - since > spec.arrival_timeout_s:
                try:
                    req = rx.await_request(rid, timeout=0)
                except XdcError as e:
                    code = e.code
                    if code == ResultCode.UNKNOWN_REQUEST:
                        self._pending.pop(rid)
                        with contextlib.suppress(XdcError):
                            rx.discard(rid)
                        self._fail(
                            spec,
                            "never_arrived",
                            f"no transfer began within {spec.arrival_timeout_s:g}s",
                        )
                    elif code == ResultCode.TIMEOUT:
                        self._pending[rid] = (spec, since, True)  # it is arriving
                    else:
                        self._pending.pop(rid)
                        self._fail(spec, str(code).lower(), str(e))
                    continue
                self._pending.pop(rid)  # complete meanwhile, and now ours
                self._take_complete(req, spec)

    def _take_complete(self, req: ReceivedRequest, spec: LoadSpec) -> None:
        """Land a complete transfer; its pool bytes are released once nothing reads them:
        at once on CPU, after the device copies and the arrival hashes on a GPU. (The
        deadline check once released a GPU landing's bytes while its copies still read them,
        and never reported the load.)"""
        landing = None
        try:
            landing = self._land(req, spec)
        finally:
            if landing is None:
                with contextlib.suppress(XdcError, OSError):
                    req.release()
            else:
                self._landing[req.rid] = landing


@dataclass
class Landing:
    """A load whose device copies (and arrival hashes) are in flight."""

    spec: LoadSpec
    req: ReceivedRequest
    copies: list[Copy]
    hashes: list[Future[str | None]] = field(default_factory=list)


def _verdict(h: Future[str | None]) -> str | None:
    e = h.exception()
    if e is not None:
        return f"the arrival hash failed: {type(e).__name__}: {e}"
    return h.result()
