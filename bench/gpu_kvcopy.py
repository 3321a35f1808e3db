"""The connector's KV copies on a GPU: forward-pass slowdown, GB/s and load time, old vs new.

Issue 29's table, measured the way it was measured there: a CUDA KV tensor per layer in
vLLM 0.32's logical layout ``(num_blocks, kv_heads, block_size, 2 x head_dim)`` (8B-shaped:
32 layers, 8 KV heads x 128, bf16, 16-token blocks), a 32-layer "forward" of one MLP-sized
matmul pair per layer, and the daemon's pool as a /dev/shm mapping. Compared side by side in
one run:

- forward alone;
- forward + the old save (a blocking ``copy_`` per run of consecutive blocks, CUDA ->
  pageable pool, inside the forward), contiguous and scattered block ids;
- forward + the new save (``xdc.integrations.kvcopy.CudaCopier``: gather on the engine's
  stream, async copy on a side stream into the pool registered with cudaHostRegister), and
  the same with registration off (pinned staging);
- loading 32 layers into scattered blocks: old ``copy_`` runs from the pageable pool and from
  a pinned one, the new copier (verified on the device), and a plain pinned host-to-device
  copy of the same bytes (the floor the issue's goal is measured against);
- a CUDA round trip, byte-exact: saved from one tensor, loaded into other blocks of another.

Needs torch with CUDA and this repository (no vLLM, no package index): ``python
bench/gpu_kvcopy.py`` from the repository root. ``--cpu-smoke`` runs the same flow small on
CPU tensors (no timing claims) so CI can keep the script working. Prints each step as it
goes; writes JSON (``--out``) and a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import xxhash

from xdc.config import usable_cores
from xdc.integrations.hash_helpers import HashHelpers, helpers_for
from xdc.integrations.kvcopy import (
    BlockCopier,
    BlockShape,
    Copy,
    CpuCopier,
    CudaCopier,
    block_shape,
    runs,
)
from xdc.integrations.vllm.blocks import (
    Piece,
    arrival_mismatch,
    arrival_positions,
    hash_threads,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the copies the connector made before issue 29, as they were ------------------------------


def old_save(src: torch.Tensor, ids: Sequence[int], dst: torch.Tensor, first: int, bb: int) -> None:
    for pos, b, n in runs(ids):
        x = src[b : b + n]
        if not x.is_contiguous():
            x = x.contiguous()
        start = (first + pos) * bb
        dst[start : start + n * bb].copy_(x.view(-1).view(torch.uint8))


def old_load(dst: torch.Tensor, ids: Sequence[int], src: torch.Tensor, first: int, bb: int) -> None:
    for pos, b, n in runs(ids):
        start = (first + pos) * bb
        piece = src[start : start + n * bb].view(dst.dtype).view(n, *dst.shape[1:])
        dst[b : b + n].copy_(piece)


# --- the rig ----------------------------------------------------------------------------------


class ShmPool:
    """The daemon's pool as it is: a shared-memory file mapped into the engine."""

    def __init__(self, nbytes: int) -> None:
        d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        st = os.statvfs(d)
        if st.f_bavail * st.f_frsize < nbytes * 1.1:  # a tmpfs too small would SIGBUS mid-run
            log(f"  {d} has under {nbytes / 1e9:.1f} GB free: the pool is a file in /tmp")
            d = tempfile.gettempdir()
        # not "xdc-...": a daemon's or a test's sweep of stale xdc segments would unlink it
        fd, self.path = tempfile.mkstemp(prefix="bench-kv-pool-", dir=d)
        os.ftruncate(fd, nbytes)
        self.map = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.tensor = torch.from_numpy(np.frombuffer(self.map, dtype=np.uint8))

    def shm_name(self) -> str | None:
        """Its name under /dev/shm, where hash helpers map it (None: it is a file elsewhere)."""
        d, name = os.path.split(self.path)
        return name if d == "/dev/shm" else None

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still alive: the process exit frees it
            self.map.close()
        os.unlink(self.path)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(
    dev: torch.device, fn: Callable[[], Any], repeats: int, engine_view: bool = False
) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` from an idle device. ``engine_view``: until the engine's
    own stream has run its last kernel (side-stream copies may still be in flight), which
    is what the forward pass waits for; otherwise until the whole device is idle."""
    fn()  # warm-up (allocator, kernels, registrations)
    sync(dev)
    ts = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        if engine_view and dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        else:
            sync(dev)
        ts.append(time.perf_counter() - t0)
        sync(dev)  # the next repeat starts from an idle device
    return statistics.median(ts), ts


def handover_run(
    dev: torch.device,
    layers: int,
    forward: Callable[[Callable[[int], Copy | None] | None], list[Copy]],
    save: Callable[[int], Copy],
    side: Any,
    mode: str,
) -> dict[str, float]:
    """One forward whose layers' copies are noticed the way ``mode`` says (issue 29: "layer_ready
    only when the copy's event has completed, from a completion thread or the next call,
    measured for which costs less"). ``thread``: a completion thread waits for each copy in
    order (what saves.Handover does); ``next-call``: each save call polls the copies still
    pending, and what is left when the forward ends is seen only at the engine's next call
    (here: right after the forward; an idle engine makes no next call at all). Returns the
    forward's own time and the lag from each copy's completion on the device to the moment
    the host noticed it."""
    seen = [0.0] * layers
    made = [0.0] * layers
    marks: list[Any] = [None] * layers
    jobs: queue.SimpleQueue[tuple[int, Copy] | None] = queue.SimpleQueue()

    def waiter() -> None:
        while (job := jobs.get()) is not None:
            job[1].wait()
            seen[job[0]] = time.perf_counter()

    pending: list[tuple[int, Copy]] = []

    def poll() -> None:
        for item in list(pending):
            if item[1].done():
                seen[item[0]] = time.perf_counter()
                pending.remove(item)

    def noticed_save(i: int) -> None:
        c = save(i)
        made[i] = time.perf_counter()
        if dev.type == "cuda":  # after the copy on its stream: when it completed, on the GPU
            marks[i] = torch.cuda.Event(enable_timing=True)
            marks[i].record(side)
        if mode == "thread":
            jobs.put((i, c))
        else:
            poll()
            pending.append((i, c))
        return None

    th = threading.Thread(target=waiter, daemon=True) if mode == "thread" else None
    if th is not None:
        th.start()
    sync(dev)
    ref = None
    if dev.type == "cuda":
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
    t0 = time.perf_counter()
    forward(noticed_save)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    t_fwd = time.perf_counter() - t0
    left_at_end = len(pending)
    if th is not None:
        jobs.put(None)
        th.join()
    else:
        for _, c in pending:
            c.wait()
        poll()
    sync(dev)
    # on the GPU: when each copy completed there; CPU copies are over when the save returns
    done_at = [t0 + ref.elapsed_time(m) / 1e3 for m in marks] if ref is not None else made
    lags = [max(0.0, seen[i] - done_at[i]) for i in range(layers)]
    return {
        "forward_s": t_fwd,
        "lag_median_s": statistics.median(lags[:-1] or lags),
        "lag_max_s": max(lags[:-1] or lags),
        "last_layer_lag_s": lags[-1],
        "unseen_at_forward_end": float(left_at_end),
    }


def run_size(args: argparse.Namespace, tokens: int, dev: torch.device) -> dict[str, Any]:
    L, H, D, BS = args.layers, args.kv_heads, args.head_dim, args.block
    nblk = tokens // BS
    total_blocks = nblk * 2 + 8  # room for scattered ids and a second set to load into
    dtype = torch.bfloat16
    log(f"{tokens} tokens: {L} layers x {nblk} blocks of ({H}, {BS}, {2 * D}) bf16")
    kv = [torch.randn(total_blocks, H, BS, 2 * D, device=dev, dtype=dtype) for _ in range(L)]
    shape = block_shape(kv[0], total_blocks, "LBHNC")
    assert isinstance(shape, BlockShape), shape
    bb = shape.block_bytes
    layer_bytes = nblk * bb
    kv_bytes = layer_bytes * L
    log(f"  KV {kv_bytes / 1e9:.2f} GB ({bb} B a block)")
    contiguous = list(range(4, 4 + nblk))
    rng = random.Random(29)
    scattered = rng.sample(range(1, total_blocks), nblk)
    hidden = args.hidden
    x0 = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    w1 = torch.randn(hidden, int(hidden * args.ffn_mult), device=dev, dtype=dtype) * 0.01
    w2 = torch.randn(int(hidden * args.ffn_mult), hidden, device=dev, dtype=dtype) * 0.01
    pool = ShmPool(kv_bytes)
    layer_views = [pool.tensor[i * layer_bytes : (i + 1) * layer_bytes] for i in range(L)]
    out: dict[str, Any] = {"tokens": tokens, "kv_bytes": kv_bytes, "block_bytes": bb}
    copier: BlockCopier = CudaCopier(dev) if dev.type == "cuda" else CpuCopier()

    def forward(save: Callable[[int], Copy | None] | None) -> list[Copy]:
        x = x0
        pending: list[Copy] = []
        for i in range(L):
            x = (x @ w1).relu_() @ w2
            if save is not None:
                c = save(i)
                if c is not None:
                    pending.append(c)
        return pending

    try:
        t, _ = timed(dev, lambda: forward(None), args.repeats)
        out["forward_s"] = t
        log(f"  forward alone: {t * 1e3:.1f} ms")
        for name, ids in (("contiguous", contiguous), ("scattered", scattered)):

            def save_old(i: int, ids: list[int] = ids) -> None:
                old_save(kv[i], ids, layer_views[i], 0, bb)

            t, _ = timed(dev, partial(forward, save_old), args.repeats)
            out[f"old_save_{name}_s"] = t
            log(f"  forward + old save, {name} ids: {t * 1e3:.1f} ms ({t / out['forward_s']:.2f}x)")

        # on CPU there is nothing to register: one row (its copies finish as they are made)
        for pinned in (True, False) if dev.type == "cuda" else (True,):
            label = "registered" if pinned else "staged"
            cp: BlockCopier = copier
            if not pinned:
                cp = CudaCopier(dev)  # a copier that never registered the pool
            elif dev.type == "cuda" and not copier.pin(pool.tensor):
                log("  the pool could not be registered: the 'registered' row is staged too")
                out["registration_failed"] = True

            def save_new(i: int, cp: BlockCopier = cp) -> Copy:
                if i == 0:
                    cp.plans.clear()  # each forward a new request: its ids planned anew
                return cp.save(kv[i], shape, scattered, layer_views[i], 0)

            def fwd_new(cp_save: Callable[[int], Copy] = save_new) -> None:
                pending = forward(cp_save)
                for c in pending:
                    c.wait()

            t, _ = timed(dev, fwd_new, args.repeats)
            out[f"new_save_{label}_s"] = t
            # the forward with copies queued, until its own last kernel (the engine's view)
            t_eng, _ = timed(dev, partial(forward, save_new), args.repeats, engine_view=True)
            out[f"new_save_{label}_forward_s"] = t_eng
            gbps = kv_bytes / max(1e-9, t) / 1e9
            out[f"new_save_{label}_gbps"] = gbps
            log(
                f"  forward + new save ({label}, scattered ids): forward {t_eng * 1e3:.1f} ms "
                f"({(t_eng / out['forward_s'] - 1) * 100:+.1f}%), all landed {t * 1e3:.1f} ms, "
                f"{gbps:.1f} GB/s"
            )

        # --- hand-over: who notices that a layer's copy landed ----------------------------
        # (the pool stays registered from the 'registered' save row)
        side = copier.side if isinstance(copier, CudaCopier) else None
        for mode in ("thread", "next-call"):
            runs_ = [
                handover_run(
                    dev,
                    L,
                    forward,
                    lambda i: copier.save(kv[i], shape, scattered, layer_views[i], 0),
                    side,
                    mode,
                )
                for _ in range(max(3, args.repeats))
            ]
            agg = {k: statistics.median(r[k] for r in runs_) for k in runs_[0]}
            out[f"handover_{mode}"] = agg
            log(
                f"  hand-over by {mode}: forward {agg['forward_s'] * 1e3:.1f} ms "
                f"({(agg['forward_s'] / out['forward_s'] - 1) * 100:+.1f}%), lag after landing "
                f"median {agg['lag_median_s'] * 1e3:.2f} ms, max {agg['lag_max_s'] * 1e3:.2f} ms, "
                f"last layer {agg['last_layer_lag_s'] * 1e3:.2f} ms "
                f"({agg['unseen_at_forward_end']:.0f} copies unseen when the forward ended)"
            )

        # --- load: 32 layers into scattered blocks ------------------------------------------
        targets = scattered

        def load_layers(views: list[torch.Tensor]) -> None:
            for i in range(L):
                old_load(kv[i], targets, views[i], 0, bb)

        t, _ = timed(
            dev,
            partial(load_layers, layer_views),
            args.repeats,
        )
        out["old_load_pageable_s"] = t
        log(f"  load, old copies from the pageable pool: {t * 1e3:.1f} ms")
        if dev.type == "cuda":
            pinned_pool = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=True)
            pinned_pool.copy_(pool.tensor)
            pviews = [pinned_pool[i * layer_bytes : (i + 1) * layer_bytes] for i in range(L)]
            t, _ = timed(
                dev,
                partial(load_layers, pviews),
                args.repeats,
            )
            out["old_load_pinned_s"] = t
            log(f"  load, old copies from a pinned pool: {t * 1e3:.1f} ms")
            flat = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
            t, _ = timed(dev, lambda: flat.copy_(pinned_pool, non_blocking=True), args.repeats)
            out["plain_h2d_pinned_s"] = t
            log(f"  plain pinned host-to-device copy of the same bytes: {t * 1e3:.1f} ms")
            # the pool was registered by the 'registered' save row
            if isinstance(copier, CudaCopier) and copier.is_pinned(pool.tensor):
                t, _ = timed(dev, lambda: flat.copy_(pool.tensor, non_blocking=True), args.repeats)
                out["plain_h2d_pool_s"] = t
                log(f"  plain host-to-device copy from the registered pool: {t * 1e3:.1f} ms")
            # the new copier reading torch's pinned memory instead of the registered pool
            if copier.pin(pinned_pool):

                def load_pinned() -> None:
                    cs = [copier.load(kv[i], shape, scattered, pviews[i], 0) for i in range(L)]
                    for c in cs:
                        c.wait()

                t, _ = timed(dev, load_pinned, args.repeats)
                out["new_load_torch_pinned_s"] = t
                log(f"  load, new copier from torch's pinned memory: {t * 1e3:.1f} ms")
                copier.unpin(pinned_pool)
            del flat

        issued: list[float] = []

        def load_new() -> None:
            copier.plans.clear()  # a new request: its ids planned on the first layer
            t0 = time.perf_counter()
            cs = [copier.load(kv[i], shape, targets, layer_views[i], 0) for i in range(L)]
            issued.append(time.perf_counter() - t0)
            for c in cs:
                c.wait()
            assert all(c.verified() for c in cs), "a load did not verify"

        t, _ = timed(dev, load_new, args.repeats)
        out["new_load_s"] = t
        # how long the host took to queue the 32 loads: above the copies' own time, the host
        # sets the pace (it did before the ids were planned once per request)
        out["new_load_issue_s"] = statistics.median(issued)
        log(f"  load, host time to queue {L} layers: {out['new_load_issue_s'] * 1e3:.1f} ms")
        floor = out.get("plain_h2d_pinned_s")
        ratio = f", {t / floor:.2f}x the plain copy" if floor else ""
        log(
            f"  load, new copier (registered pool, verified on the device): {t * 1e3:.1f} ms{ratio}"
        )

        # --- the decode's arrival hash of the same bytes (the integrity check's host half) ----
        out.update(
            arrival_hash(layer_views, bb, len(targets), args.repeats, pool.shm_name(), layer_bytes)
        )
        log(
            f"  arrival hash of the host bytes: {out['arrival_hash_1thread_s'] * 1e3:.1f} ms on "
            f"one thread; {out['arrival_hash_threads_s'] * 1e3:.1f} ms in "
            f"{out['arrival_hash_threads']} threads, the engine's thread busy "
            f"{out['arrival_hash_engine_s'] * 1e3:.2f} ms, its Python steps meanwhile at "
            f"{out['arrival_hash_threads_engine_rate']:.2f}x its rate alone"
        )
        for k in sorted(out):
            if k.startswith("arrival_hash_helpers") and k.endswith("_engine_rate"):
                n = k[len("arrival_hash_helpers") : -len("_engine_rate")]
                took, first = (
                    out[f"arrival_hash_helpers{n}_s"],
                    out[f"arrival_hash_helpers{n}_first_s"],
                )
                busy = out[f"arrival_hash_helpers{n}_engine_s"]
                log(
                    f"  arrival hash in {n} helper processes: {took * 1e3:.1f} ms (the first, "
                    f"the helpers starting and mapping the pool: {first * 1e3:.1f} ms), the "
                    f"engine's thread busy {busy * 1e3:.2f} ms, its Python steps meanwhile at "
                    f"{out[k]:.2f}x its rate alone"
                )

        # --- correctness: a round trip into other blocks of another tensor ------------------
        other = [torch.zeros_like(k) for k in kv[:2]]
        dst_ids = rng.sample(range(1, total_blocks), nblk)
        ok = True
        for i in range(2):
            c = copier.save(kv[i], shape, scattered, layer_views[i], 0)
            c.wait()
            c2 = copier.load(other[i], shape, dst_ids, layer_views[i], 0)
            c2.wait()
            src_rows = kv[i][torch.tensor(scattered, device=dev)]
            dst_rows = other[i][torch.tensor(dst_ids, device=dev)]
            ok = (
                ok
                and c2.verified()
                and torch.equal(src_rows.view(torch.uint8), dst_rows.view(torch.uint8))
            )
        out["round_trip_byte_exact"] = bool(ok)
        log(f"  round trip save -> load into other blocks: {'byte-exact' if ok else 'DIFFERS'}")
    finally:
        # unregister before unmapping, as the connector does: a registration outliving its
        # mapping breaks the next allocation in that address range (seen on an H200 when
        # this bench did not: "CUDA error: resource already mapped" at the next size)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        copier.unpin(pool.tensor)
        pool.close()
        kv.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def second_mapping_pin(dev: torch.device, nbytes: int = 64 << 20) -> dict[str, Any]:
    """Whether a second mapping of one pool registers for DMA too, and both copy right: a
    tensor-parallel decode rank whose KV comes as two parts (connector parts.py) reads them
    on two receiver connections, each mapping the receiver's pool and pinning its mapping.
    Where the second registration is refused, kvcopy falls back to pinned staging (slower,
    still exact): this says which of the two the machine does."""
    out: dict[str, Any] = {}
    d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="xdc-bench-twice-", dir=d)
    maps: list[mmap.mmap] = []
    views: list[torch.Tensor] = []
    copier = CudaCopier(dev)
    try:
        os.ftruncate(fd, nbytes)
        maps = [mmap.mmap(fd, nbytes), mmap.mmap(fd, nbytes)]
        views = [torch.from_numpy(np.frombuffer(m, dtype=np.uint8)) for m in maps]
        views[0].copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        out["first_mapping_pinned"] = bool(copier.pin(views[0]))
        out["second_mapping_pinned"] = bool(copier.pin(views[1]))
        got = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in views]
        for g, v in zip(got, views, strict=True):
            g.copy_(v, non_blocking=True)
        torch.cuda.synchronize(dev)
        out["both_byte_exact"] = bool(
            torch.equal(got[0].cpu(), views[0]) and torch.equal(got[1].cpu(), views[0])
        )
    except Exception as e:  # informative: the rest of the bench stands without it
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        torch.cuda.synchronize(dev)
        for v in views:
            copier.unpin(v)
        views.clear()
        for m in maps:
            with contextlib.suppress(BufferError):
                m.close()
        os.close(fd)
        os.unlink(path)
    log(f"one pool mapped twice, each registered for DMA: {out}")
    return out


def cpu_copy_choice(repeats: int) -> dict[str, float]:
    """What decided the CPU build's copies: gather vs ``copy_`` runs for saves, and
    ``index_copy_`` vs ``copy_`` runs for loads (512 blocks of 64 KiB, one thread)."""
    torch.set_num_threads(1)
    nb, n = 4096, 512
    t = torch.randn(nb, 8, 16, 256).to(torch.bfloat16)
    shape = block_shape(t, nb)
    assert isinstance(shape, BlockShape)
    bb = shape.block_bytes
    buf = torch.empty(n * bb, dtype=torch.uint8)
    cpu = CpuCopier()
    contiguous = list(range(100, 100 + n))
    scattered = random.Random(7).sample(range(1, nb), n)
    dev = torch.device("cpu")
    out: dict[str, float] = {}
    for name, ids in (("contiguous", contiguous), ("scattered", scattered)):
        out[f"save_runs_{name}_s"] = timed(dev, partial(old_save, t, ids, buf, 0, bb), repeats)[0]
        out[f"save_gather_{name}_s"] = timed(
            dev, partial(cpu.save, t, shape, ids, buf, 0), repeats
        )[0]
        idx = torch.tensor(ids)
        rows = buf.view(torch.bfloat16).view(n, 8, 16, 256)
        out[f"load_runs_{name}_s"] = timed(dev, partial(old_load, t, ids, buf, 0, bb), repeats)[0]
        out[f"load_index_copy_{name}_s"] = timed(
            dev, partial(t.index_copy_, 0, idx, rows), repeats
        )[0]
    for k, v in out.items():
        log(f"  {k}: {v * 1e3:.1f} ms")
    return out


def _all_done(futures: Sequence[Future[Any]]) -> bool:
    return all(f.done() for f in futures)


def _python_steps(until: Callable[[], bool], floor_s: float = 0.0) -> float:
    """Steps a second of a small pure-Python step (~50 us), taken on this thread until
    ``until()`` (and at least ``floor_s``): what an engine's own thread gets done meanwhile,
    scheduling and launching kernels being Python work under the same GIL."""
    t0 = time.perf_counter()
    n = 0
    while True:
        s = 0
        for j in range(500):
            s += j
        n += 1
        el = time.perf_counter() - t0
        if el >= floor_s and until():
            return n / el


def arrival_hash(
    views: list[torch.Tensor],
    bb: int,
    nblk: int,
    repeats: int,
    pool_name: str | None = None,
    layer_bytes: int = 0,
) -> dict[str, float | int]:
    """The connector's check that a load's bytes arrived as the producer copied them (xxh3 of
    every block in host memory, ``blocks.arrival_mismatch``): on the engine's thread, as it
    was; in the loader's hashing threads; and in hash helper processes (``hash_helpers``;
    ``pool_name``: the pool's name under /dev/shm, where the helpers map it), each with what
    the engine's own thread gets done meanwhile (``_python_steps``, against its rate alone)."""
    layers = [v.numpy() for v in views]
    digests = np.zeros(len(layers) * nblk, dtype=np.uint64)
    for i, host in enumerate(layers):
        for b in range(nblk):
            digests[i * nblk + b] = xxhash.xxh3_64_intdigest(host[b * bb : (b + 1) * bb].data)
    piece = Piece(0, 0, tuple(range(1, nblk + 1)))

    def one(i: int) -> str | None:
        return arrival_mismatch(layers[i], bb, piece, digests, i * nblk, i)

    alone = _python_steps(lambda: True, 0.2)
    n = hash_threads()
    sync, queued, wall, beside = [], [], [], []
    with ThreadPoolExecutor(n) as pool:
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            assert all(one(i) is None for i in range(len(layers))), "arrival hash differs"
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            futures = [pool.submit(one, i) for i in range(len(layers))]
            queued.append(time.perf_counter() - t0)
            beside.append(_python_steps(partial(_all_done, futures)) / alone)
            assert all(f.result() is None for f in futures), "arrival hash differs"
            wall.append(time.perf_counter() - t0)
    out: dict[str, float | int] = {
        "arrival_hash_1thread_s": statistics.median(sync),
        "arrival_hash_threads_s": statistics.median(wall),
        "arrival_hash_engine_s": statistics.median(queued),
        "arrival_hash_threads": n,
        "arrival_hash_threads_engine_rate": statistics.median(beside),
    }
    if pool_name is None:
        return out
    checks = [arrival_positions(piece, digests, i * nblk) for i in range(len(layers))]
    cores = usable_cores()
    for count in sorted({max(1, helpers_for(cores)), min(8, max(2, cores))}):
        helpers = HashHelpers(count)
        try:
            walls, rates, queued = [], [], []
            for r in range(max(1, repeats) + 1):  # the first maps the pool: reported apart
                t0 = time.perf_counter()
                futs = [
                    helpers.check(pool_name, i * layer_bytes, bb, positions, expected)
                    for i, (positions, expected) in enumerate(checks)
                ]
                q = time.perf_counter() - t0
                rate = _python_steps(partial(_all_done, futs)) / alone
                assert all(f.result(60) == -1 for f in futs), "a helper's arrival hash differs"
                w = time.perf_counter() - t0
                if r == 0:
                    out[f"arrival_hash_helpers{count}_first_s"] = w
                else:
                    walls.append(w)
                    rates.append(rate)
                    queued.append(q)
        finally:
            helpers.close()
        out[f"arrival_hash_helpers{count}_s"] = statistics.median(walls)
        out[f"arrival_hash_helpers{count}_engine_s"] = statistics.median(queued)
        out[f"arrival_hash_helpers{count}_engine_rate"] = statistics.median(rates)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| prompt | forward, no save | old save, contiguous | old save, scattered "
        "| new save, scattered (forward / all landed, GB/s) "
        "| load: old pageable / old pinned / new / plain pinned H2D |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r["forward_s"]

        def ms(k: str, r: dict[str, Any] = r) -> str:
            return f"{r[k] * 1e3:,.1f} ms" if k in r else "-"

        lines.append(
            f"| {r['tokens']:,} tokens ({r['kv_bytes'] / 1e9:.2f} GB) | {ms('forward_s')} "
            f"| {ms('old_save_contiguous_s')} ({r['old_save_contiguous_s'] / f:.1f}x) "
            f"| {ms('old_save_scattered_s')} ({r['old_save_scattered_s'] / f:.1f}x) "
            f"| {ms('new_save_registered_forward_s')} "
            f"({(r['new_save_registered_forward_s'] / f - 1) * 100:+.1f}%) / "
            f"{ms('new_save_registered_s')}, {r['new_save_registered_gbps']:.0f} GB/s "
            f"| {ms('old_load_pageable_s')} / {ms('old_load_pinned_s')} / {ms('new_load_s')} "
            f"/ {ms('plain_h2d_pinned_s')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,32768", help="prompt sizes, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn-mult", type=float, default=3.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="", help="JSON results file")
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the CPU build's copies"
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="the same flow, small, on CPU (no timing claims)"
    )
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.device, args.layers, args.hidden, args.repeats = "cpu", min(args.layers, 4), 256, 1
        args.tokens = "256"
    if args.device == "cpu":
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or --cpu-smoke", file=sys.stderr)
            return 2
        dev = torch.device("cuda")
    sizes = [int(s) for s in args.tokens.split(",") if s.strip()]
    machine = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "host": platform.node(),
    }
    log(f"machine: {machine}")
    rows = [run_size(args, n, dev) for n in sizes]
    print(table(rows))
    result: dict[str, Any] = {"machine": machine, "args": vars(args), "rows": rows}
    if dev.type == "cuda":
        result["second_mapping"] = second_mapping_pin(dev)
    if dev.type == "cpu" and not args.cpu_smoke:
        log("the CPU build's copy choice:")
        result["cpu_copy_choice"] = cpu_copy_choice(args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        log(f"wrote {args.out}")
    bad = [r["tokens"] for r in rows if not r.get("round_trip_byte_exact")]
    if bad:
        print(f"round trip NOT byte-exact at {bad} tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
