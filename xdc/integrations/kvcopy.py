"""Copies of KV blocks between an engine's KV tensors and the daemons' host pools.

Why a module of its own: the copies are the one place where the engine's memory meets
xdc's, and on a GPU they decide whether offloading costs the prefill 2% or 13x (issue 29:
a blocking ``copy_`` per run of blocks from CUDA into pageable memory, inside the forward
pass). It imports torch, never vLLM, so it is tested with CPU tensors alone and benchmarked
on a GPU machine that has no vLLM (``bench/gpu_kvcopy.py``).

What a block is comes from the tensor the engine hands over, never from an assumption.
vLLM 0.32 gives a connector one *logical* view per layer, ``[B, H, N, C]`` whatever the
physical ``KVCacheLayout`` behind it (LBHNC, LBNHC, LHBNC and the cross-layer BLHNC, BLNHC,
BHLNC); the block dimension is first and a block's elements follow in logical order. So a
block moves as its elements in logical order: a gather (``index_select``) over the block
dimension reads any of those layouts, and both ends agree on the bytes even when their
physical layouts differ. A tensor whose first dimension is not the engine's blocks (an older
``(2, num_blocks, ...)`` cache, a kernel block size that does not divide the manager's) is
refused at start-up with a message naming it.

Two copiers, chosen once from the tensors' device:

- :class:`CpuCopier`: save is one gather straight into the pool (``index_select(out=)``),
  measured as fast as a plain ``copy_`` for consecutive blocks and 1.7x faster for
  scattered ones; load copies runs of consecutive blocks (``index_copy_`` measured 2.7x
  slower on CPU). Both finish before they return.
- :class:`CudaCopier`: save gathers the step's blocks on the engine's own stream (so the
  blocks may be reused the moment the engine goes on) into a device staging buffer, then a
  side stream copies it to host memory, asynchronously, after an event. Load copies
  host-to-device on a stream of its own (so one layer's copy overlaps the previous layer's
  scatter), scatters into the engine's blocks on the side stream and checks the
  placement on the GPU (a gather back, compared with what was copied: one flag crosses to
  the host, not the KV). The pool's mapping is registered with ``cudaHostRegister`` so those
  copies are true DMA; where registration fails, pinned staging buffers from torch's caching
  host allocator stand in, and the host side copies from them on completion.

Both turn a block-id list into stretches and index tensors once (:class:`IndexPlans`), not
per layer: every layer of a request is copied with the same ids, and on a GPU the per-layer
Python over every block, not the copies, had set the pace of a load.

A copy is a :class:`Copy`: ``done()`` never waits, ``wait()`` does; the caller hands bytes
to the daemon only once its copy is done.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger("xdc.kvcopy")

NULL_BLOCK = 0  # vLLM's null block: a position the engine does not keep (skipped)

# vLLM 0.32's KVCacheLayout names (vllm/v1/kv_cache_layout.py): the physical orders behind
# the logical [B, H, N, C] per-layer view. Every one of them reads through the logical view.
KNOWN_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True, slots=True)
class BlockShape:
    """One engine block of one layer: ``rows`` rows of the tensor's first dimension (more than
    one where the attention kernel splits a manager block into kernel blocks), each of shape
    ``row_shape`` and type ``dtype``; ``block_bytes`` of them move per block."""

    rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    block_bytes: int


def block_shape(t: Any, num_blocks: int | None, layout: str | None = None) -> BlockShape | str:
    """What a block of this layer's tensor is, or why xdc cannot move it (a message that
    names what it found)."""
    if not isinstance(t, torch.Tensor):
        return f"the layer keeps its cache as a {type(t).__name__}, not a tensor"
    if t.device.type not in ("cpu", "cuda"):
        return f"KV on a {t.device.type} device is not supported (cpu and cuda are)"
    if layout is not None and layout not in KNOWN_LAYOUTS:
        return f"KV cache layout {layout} is not one xdc reads ({', '.join(KNOWN_LAYOUTS)})"
    if t.dim() < 2:
        return f"a {t.dim()}-dimensional KV tensor has no block dimension"
    rows = 1
    if num_blocks is not None and num_blocks > 0:
        if t.shape[0] % num_blocks:
            return (
                f"the tensor's first dimension ({t.shape[0]}) is not the engine's "
                f"{num_blocks} blocks{f' (layout {layout})' if layout else ''}"
            )
        rows = t.shape[0] // num_blocks
    row_shape = tuple(int(d) for d in t.shape[1:])
    return BlockShape(rows, row_shape, t.dtype, rows * math.prod(row_shape) * t.element_size())


def stretches(ids: Sequence[int], rows: int = 1) -> list[tuple[int, list[int]]]:
    """(first position, tensor rows) of each stretch of consecutive positions whose block is
    kept; a null block ends a stretch (its bytes are neither read nor written)."""
    out: list[tuple[int, list[int]]] = []
    prev = -2
    for pos, b in enumerate(ids):
        if b == NULL_BLOCK:
            continue
        block_rows = [b * rows + r for r in range(rows)]
        if pos == prev + 1 and out:
            out[-1][1].extend(block_rows)
        else:
            out.append((pos, block_rows))
        prev = pos
    return out


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first id, count) of each run of consecutive positions with consecutive
    ids; the null block is never part of a run."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if b == NULL_BLOCK:
            continue
        if out and out[-1][1] + out[-1][2] == b and out[-1][0] + out[-1][2] == pos:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, b, 1))
    return out


@dataclass(frozen=True, slots=True)
class IndexPlan:
    """One block-id list made ready to copy: its stretches and, per stretch, the index tensor
    of its rows on the copier's device. ``ready`` (None on CPU) is the event after which the
    indexes are on the device."""

    stretches: list[tuple[int, list[int]]]
    index: list[torch.Tensor]
    ready: Any = None


class IndexPlans:
    """The last few block-id lists' plans, so a list is turned into index tensors once, not
    once per layer.

    Why: the connector copies every layer of a request (of a KV group) with the same block
    ids. Building the stretches and their index tensors per layer was Python work over every
    block on the host, per layer; on an H200 it made the host, not the copies, set the pace
    of an 8K-token load (1.9x a plain pinned copy: 32 layers of 33 MB each take 0.6 ms to
    cross PCIe, less than the host took to issue a layer). A plan is looked up by its ids
    (a tuple's hash: microseconds for thousands of blocks) and kept for the ``keep`` most
    recently used lists; index tensors are never written after they are made, so sharing one
    between layers and streams is safe once ``ready`` has passed."""

    def __init__(
        self,
        make: Callable[[list[list[int]]], tuple[list[torch.Tensor], Any]],
        keep: int = 64,
    ) -> None:
        self._make = make
        self._keep = keep
        self._plans: OrderedDict[tuple[int, tuple[int, ...]], IndexPlan] = OrderedDict()
        self.built = 0  # plans made (a measure of how often the cache missed)

    def get(self, ids: Sequence[int], rows: int) -> IndexPlan:
        key = (rows, tuple(ids))
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        found = stretches(ids, rows)
        index, ready = self._make([r for _, r in found])
        plan = IndexPlan(found, index, ready)
        self.built += 1
        self._plans[key] = plan
        while len(self._plans) > self._keep:
            self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        self._plans.clear()


def _cpu_indexes(lists: list[list[int]]) -> tuple[list[torch.Tensor], None]:
    return [torch.tensor(rows, dtype=torch.long) for rows in lists], None


def rows_of(buf: torch.Tensor, shape: BlockShape, pos: int, n_rows: int) -> torch.Tensor:
    """Rows ``pos .. pos + n_rows`` (tensor rows) of a byte buffer, typed as the layer's."""
    row_bytes = shape.block_bytes // shape.rows
    piece = buf[pos * row_bytes : (pos + n_rows) * row_bytes]
    return piece.view(shape.dtype).view(n_rows, *shape.row_shape)


class Copy(Protocol):
    def done(self) -> bool:
        """Whether the bytes are where they were going (never waits)."""

    def wait(self) -> None:
        """Until ``done()``."""

    def verified(self) -> bool:
        """For a load: whether the engine's blocks now hold exactly what was copied (valid
        once done)."""


class Finished:
    """A copy that completed before it was returned (the CPU copier's; its placement is
    checked by the caller, so it verifies)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def verified(self) -> bool:
        return True


class BlockCopier(Protocol):
    device: str
    plans: IndexPlans

    def pin(self, host: torch.Tensor) -> bool:
        """Make a host buffer (the daemon's pool mapping) a DMA target; whether it is."""

    def unpin(self, host: torch.Tensor) -> None:
        """Undo ``pin`` before the buffer is unmapped (after ``quiesce``)."""

    def quiesce(self) -> None:
        """Until no copy of this copier is in flight (before a pool it used goes away)."""

    def save(
        self,
        src: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        dst: torch.Tensor,
        first: int,
    ) -> Copy:
        """Engine blocks ``ids`` of layer ``src`` -> blocks ``first + j`` of byte buffer ``dst``."""

    def load(
        self,
        dst: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        src: torch.Tensor,
        first: int,
        check_ids: Sequence[int] | None = None,
    ) -> Copy:
        """Blocks ``first + j`` of byte buffer ``src`` -> engine blocks ``ids`` of ``dst``.
        ``check_ids`` (default ``ids``): where the placement check reads the blocks back."""


class CpuCopier:
    device = "cpu"

    def __init__(self) -> None:
        self.plans = IndexPlans(_cpu_indexes)

    def pin(self, host: torch.Tensor) -> bool:
        return False  # nothing to gain: the CPU reads any memory at the same speed

    def unpin(self, host: torch.Tensor) -> None:
        return None

    def quiesce(self) -> None:
        return None  # CPU copies are over when they return

    def save(
        self,
        src: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        dst: torch.Tensor,
        first: int,
    ) -> Copy:
        plan = self.plans.get(ids, shape.rows)
        for (pos, rows), idx in zip(plan.stretches, plan.index, strict=True):
            out = rows_of(dst, shape, (first + pos) * shape.rows, len(rows))
            torch.index_select(src, 0, idx, out=out)
        return Finished()

    def load(
        self,
        dst: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        src: torch.Tensor,
        first: int,
        check_ids: Sequence[int] | None = None,
    ) -> Copy:
        r = shape.rows
        for pos, b, n in runs(ids):
            # written through the tensor's own view: a layer that is a strided view of a
            # shared (cross-layer) buffer is filled in place, never through a temporary
            dst[b * r : (b + n) * r].copy_(rows_of(src, shape, (first + pos) * r, n * r))
        return Finished()  # the caller checks placement by hashing the blocks (host memory)


class _CudaCopy:
    def __init__(
        self,
        event: Any,
        keep: list[torch.Tensor],
        then: Callable[[], None] | None = None,
        flag: torch.Tensor | None = None,
    ) -> None:
        self.event = event
        self._keep = keep  # buffers the copy reads or writes: alive until it completes
        self._then = then  # host work once the device is done (a staged copy's second leg)
        self._flag = flag
        self._finished = False

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self._then is not None:
                self._then()
            self._keep = []

    def done(self) -> bool:
        if self._finished:
            return True
        if not self.event.query():
            return False
        self._finish()
        return True

    def wait(self) -> None:
        self.event.synchronize()  # releases the GIL while it waits
        self._finish()

    def verified(self) -> bool:
        return True if self._flag is None else bool(self._flag.item())


class CudaCopier:
    """Copies that never make the engine's stream wait for the host (see the module doc)."""

    device = "cuda"

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.side = torch.cuda.Stream(device=dev)  # saves' copies out; loads' scatters
        self.copy_in = torch.cuda.Stream(device=dev)  # loads' host -> device copies
        self.meta = torch.cuda.Stream(device=dev)  # the plans' index uploads
        self.plans = IndexPlans(self._upload)
        self._pinned: list[tuple[int, int]] = []  # registered host ranges (address, bytes)
        self._adopted: list[tuple[int, int]] = []  # page-locked by others: never unregistered

    def pin(self, host: torch.Tensor) -> bool:
        if self.is_pinned(host):
            return True
        addr, size = host.data_ptr(), host.numel() * host.element_size()
        if host.is_pinned():
            # page-locked already (torch's pinned allocator, another registration): a second
            # cudaHostRegister would fail and leave CUDA's last error set for torch to trip on
            self._adopted.append((addr, size))
            return True
        try:
            rc = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
        except (RuntimeError, AttributeError) as e:
            log.warning("xdc: cannot register the pool for DMA (%s); pinned staging instead", e)
            return False
        code = int(getattr(rc, "value", rc))
        if code != 0:
            log.warning("xdc: cudaHostRegister answered %d; pinned staging instead", code)
            return False
        self._pinned.append((addr, size))
        return True

    def quiesce(self) -> None:
        self.meta.synchronize()
        self.copy_in.synchronize()
        self.side.synchronize()

    def unpin(self, host: torch.Tensor) -> None:
        key = (host.data_ptr(), host.numel() * host.element_size())
        if key in self._adopted:
            self._adopted.remove(key)
        elif key in self._pinned:
            self._pinned.remove(key)
            try:
                torch.cuda.cudart().cudaHostUnregister(key[0])
            except (RuntimeError, AttributeError) as e:
                log.warning("xdc: cudaHostUnregister failed: %s", e)

    def is_pinned(self, t: torch.Tensor) -> bool:
        a = t.data_ptr()
        end = a + t.numel() * t.element_size()
        return any(base <= a and end <= base + n for base, n in (*self._pinned, *self._adopted))

    def _upload(self, lists: list[list[int]]) -> tuple[list[torch.Tensor], Any]:
        """A plan's index tensors, in one upload on a stream of their own: on the engine's
        stream it would queue behind the forward, on the side stream behind copies."""
        flat = [r for rows in lists for r in rows]
        with torch.cuda.stream(self.meta):
            host = torch.tensor(flat, dtype=torch.long).pin_memory()
            whole = host.to(self.dev, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.meta)
        out, at = [], 0
        for rows in lists:
            out.append(whole[at : at + len(rows)])
            at += len(rows)
        return out, ready

    def _plan_on(self, ids: Sequence[int], rows: int, stream: Any) -> IndexPlan:
        """The ids' plan, usable on ``stream``: it waits for the upload (nothing, once that
        is done), and the allocator will not reuse the indexes' memory before that stream's
        work queued so far is done, should the plan be dropped."""
        plan = self.plans.get(ids, rows)
        stream.wait_event(plan.ready)
        for idx in plan.index:
            idx.record_stream(stream)
        return plan

    def save(
        self,
        src: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        dst: torch.Tensor,
        first: int,
    ) -> Copy:
        keep: list[torch.Tensor] = []
        legs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned staging, pool rows)
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        plan = self._plan_on(ids, shape.rows, torch.cuda.current_stream(self.dev))
        for (pos, rows), idx in zip(plan.stretches, plan.index, strict=True):
            # the gather runs on the engine's stream, after the layer's compute and before
            # anything that may reuse the blocks once the engine frees them
            staging = torch.empty((len(rows), *shape.row_shape), dtype=shape.dtype, device=self.dev)
            torch.index_select(src, 0, idx, out=staging)
            pieces.append((staging, rows_of(dst, shape, (first + pos) * shape.rows, len(rows))))
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            for staging, out in pieces:
                staging.record_stream(self.side)
                if self.is_pinned(out):
                    out.copy_(staging, non_blocking=True)
                else:
                    bounce = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                    bounce.copy_(staging, non_blocking=True)
                    legs.append((bounce, out))
                keep.append(staging)
            done = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, not spins
            done.record(self.side)

        def land() -> None:
            for bounce, out in legs:
                out.copy_(bounce)

        keep.extend(b for b, _ in legs)
        return _CudaCopy(done, keep, land if legs else None)

    def load(
        self,
        dst: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        src: torch.Tensor,
        first: int,
        check_ids: Sequence[int] | None = None,
    ) -> Copy:
        keep: list[torch.Tensor] = []
        fill = self._plan_on(ids, shape.rows, self.side)
        check = fill if check_ids is None else self._plan_on(check_ids, shape.rows, self.side)
        fills = fill.stretches
        # 1. host -> device into fresh staging buffers, on the copy stream. It writes no
        #    engine block, so it need not wait for the engine, and the next layer's copy runs
        #    while this layer is scattered (one stream for both left the DMA engine idle
        #    during every scatter: 32 layers of 8K tokens loaded in 1.9x a plain copy, H200)
        staged: dict[int, torch.Tensor] = {}
        with torch.cuda.stream(self.copy_in):
            for pos, rows in fills:
                host = rows_of(src, shape, (first + pos) * shape.rows, len(rows))
                if not self.is_pinned(host):
                    bounce = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                    bounce.copy_(host)
                    keep.append(bounce)
                    host = bounce
                staging = torch.empty(host.shape, dtype=host.dtype, device=self.dev)
                staging.copy_(host, non_blocking=True)
                staged[pos] = staging
                keep.append(staging)
            arrived = torch.cuda.Event()
            arrived.record(self.copy_in)
        # 2. the scatter into the engine's blocks, on the side stream: the blocks vLLM gave
        #    this load may have been another request's until now, so only after everything
        #    the engine has queued so far, and after the bytes arrived
        engine_now = torch.cuda.Event()
        engine_now.record()
        with torch.cuda.stream(self.side):
            self.side.wait_event(engine_now)
            self.side.wait_event(arrived)
            flag = torch.ones(1, dtype=torch.bool, device=self.dev)
            for (pos, _), idx in zip(fills, fill.index, strict=True):
                staging = staged[pos]
                staging.record_stream(self.side)  # allocated on copy_in, read here
                dst.index_copy_(0, idx, staging)
            # the placement check, on the GPU: the blocks read back where the engine will
            # look for them must be what was copied (a wrong id fails it)
            for (pos, rows), idx in zip(check.stretches, check.index, strict=True):
                want = staged.get(pos)
                if want is None or want.shape[0] != len(rows):
                    flag.zero_()  # read back somewhere nothing was written
                    continue
                back = torch.index_select(dst, 0, idx)
                flag &= same_bytes(back, want)
            host_flag = torch.empty(1, dtype=torch.bool, pin_memory=True)
            host_flag.copy_(flag, non_blocking=True)
            keep.extend([flag, host_flag])
            done = torch.cuda.Event(blocking=True)
            done.record(self.side)
        return _CudaCopy(done, keep, flag=host_flag)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two equally shaped tensors hold the same bytes, as a one-element bool tensor on
    their device (nothing crosses to the host). Compared as 8-byte words where the size
    allows: an eighth of the elements, and of the bool tensor the comparison writes."""
    x, y = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if x.numel() % 8 == 0 and x.data_ptr() % 8 == 0 and y.data_ptr() % 8 == 0:
        x, y = x.view(torch.int64), y.view(torch.int64)
    return (x == y).all().reshape(1)


def pool_tensor(view: memoryview) -> torch.Tensor:
    """A daemon's pool mapping as a byte tensor (no copy), for ``pin``."""
    return torch.frombuffer(view, dtype=torch.uint8)


def copier_for(tensors: Sequence[torch.Tensor]) -> BlockCopier | str:
    """The copier for these KV tensors (one device for all of them), or why there is none."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return f"KV tensors on several devices ({sorted(str(d) for d in devices)})"
    dev = devices.pop()
    if dev.type == "cpu":
        return CpuCopier()
    if dev.type == "cuda":
        return CudaCopier(dev)
    return f"KV on a {dev.type} device is not supported (cpu and cuda are)"
