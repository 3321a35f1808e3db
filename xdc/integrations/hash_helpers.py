"""Arrival hashes of a GPU load in helper processes, off the engine's GIL.

A GPU decode checks that the bytes it copies to the device are the ones the producer copied:
the xxh3-64 of every block in the receiver's pool, against the digests the transfer carries
(``vllm.blocks``). In threads of the engine's own process that ran at one core's speed,
whatever the thread count (device machine, H200 with 16 cores, 2026-11-30: 1.07 GB of 64 KiB
blocks in 142 ms on one thread, 146 ms on four), and it took the GIL from the engine's own
thread meanwhile: python-xxhash keeps the GIL for inputs of 64 KiB or less. A helper
(``hash_helper``) hashes under a GIL of its own.

Each helper answers one check at a time, in order; checks go to the helper with the fewest
outstanding. A helper that dies, or answers what is not an answer, fails its outstanding
checks (a failed check is a recompute, never a decode) and is not used again; when none is
left, ``usable`` says so and the caller hashes in threads as before.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from xdc.errors import LocalConnectionError
from xdc.integrations.hash_frames import FrameReader, frame

log = logging.getLogger("xdc.hash_helpers")

EXIT_GRACE_S = 5.0  # a helper is killed if it has not exited this long after its channel ended


class HashHelperGone(LocalConnectionError):
    """The helper that held a check exited or broke its protocol before answering it."""


def helpers_for(cores: int, ranks: int = 1) -> int:
    """Helpers a GPU decode's process starts: none below 8 usable cores (on fewer, the
    engine's own threads need them), else half of them, at most 8. On the H200 machine (16
    cores, 2026-11-30, bench/gpu_kvcopy.py) 8 helpers hashed a 32K-token load's 4.29 GB in
    82 ms, as fast as its copies (81 ms); 4 took 147 ms. They are busy only while a load
    lands. ``ranks``: the engine's tensor-parallel ranks, each a process of its own with its
    own helpers, which the host's cores are shared among."""
    share = cores // max(1, ranks)
    return 0 if share < 8 else min(8, share // 2)


_shared_lock = threading.Lock()
_shared: HashHelpers | None = None
_shared_users = 0


def acquire(count: int) -> HashHelpers:
    """This process's helpers, started by the first caller with ``count`` (a later count is
    ignored): a decode's loaders (one per part of its KV) share them. Give each back with
    ``release``; the last one back stops them."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None:
            _shared = HashHelpers(count)
        _shared_users += 1
        return _shared


def release(helpers: HashHelpers) -> None:
    global _shared, _shared_users
    with _shared_lock:
        if helpers is not _shared:
            helpers.close()  # not the shared ones (already stopped): nothing else holds them
            return
        _shared_users -= 1
        if _shared_users > 0:
            return
        _shared = None
    helpers.close()


class _Helper:
    def __init__(self, index: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "xdc.integrations.hash_helper",
                    "--fd",
                    str(theirs.fileno()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.index = index
        self.alive = True
        # ident -> the check's future and when it was asked (monotonic)
        self.pending: dict[int, tuple[Future[int], float]] = {}
        self.lock = threading.Lock()
        self.reader = threading.Thread(
            target=self._read, name=f"xdc-hash-helper-{index}", daemon=True
        )
        self.reader.start()

    def send(self, ident: int, msg: list[Any], fut: Future[int]) -> None:
        with self.lock:
            if not self.alive:
                raise HashHelperGone(f"hash helper {self.index} is gone")
            self.pending[ident] = (fut, time.monotonic())
        try:
            self.sock.sendall(frame(msg))
        except OSError as e:
            self._fail_all(f"hash helper {self.index}: {e}")

    def _read(self) -> None:
        reader = FrameReader()
        why = "its channel ended"
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                for ident, result, error in reader.feed(data):
                    with self.lock:
                        asked = self.pending.pop(ident, None)
                    if asked is None:
                        raise ValueError(f"an answer to {ident!r}, which it was not asked")
                    fut = asked[0]
                    if result == -2:
                        fut.set_exception(HashHelperGone(f"hash helper {self.index}: {error}"))
                    else:
                        fut.set_result(int(result))
        except (OSError, ValueError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
        self._fail_all(f"hash helper {self.index} stopped answering: {why}")

    def _fail_all(self, why: str) -> None:
        with self.lock:
            self.alive = False
            pending, self.pending = self.pending, {}
        for fut, _t in pending.values():
            if not fut.done():
                fut.set_exception(HashHelperGone(why))

    def oldest_s(self, now: float) -> float:
        """How long its oldest unanswered check has waited (0: none)."""
        with self.lock:
            return now - min(t for _f, t in self.pending.values()) if self.pending else 0.0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the helper sees its channel end and exits
        self.reader.join(timeout=EXIT_GRACE_S)
        self.sock.close()
        try:
            self.proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HashHelpers:
    """``count`` helper processes, started now; ``close`` stops them and waits."""

    def __init__(self, count: int) -> None:
        self._ids = itertools.count()
        self._helpers: list[_Helper] = []
        try:
            for i in range(count):
                self._helpers.append(_Helper(i))
        except BaseException:
            self.close()
            raise

    @property
    def usable(self) -> bool:
        return any(h.alive for h in self._helpers)

    def pids(self) -> list[int]:
        return [h.proc.pid for h in self._helpers]

    def check(
        self,
        segment: str,
        offset: int,
        bb: int,
        positions: np.ndarray[Any, np.dtype[np.int64]],
        expected: np.ndarray[Any, np.dtype[np.uint64]],
    ) -> Future[int]:
        """A future of the index (into ``positions``) of the first block at ``offset +
        position * bb`` of the pool ``segment`` that does not hash to its expected digest,
        or -1; it fails with HashHelperGone when no helper can answer."""
        fut: Future[int] = Future()
        live = [h for h in self._helpers if h.alive]
        if not live:
            fut.set_exception(HashHelperGone("no hash helper is left"))
            return fut
        helper = min(live, key=lambda h: len(h.pending))
        ident = next(self._ids)
        msg = [
            ident,
            segment,
            int(offset),
            int(bb),
            positions.astype("<i8", copy=False).tobytes(),
            expected.astype("<u8", copy=False).tobytes(),
        ]
        try:
            helper.send(ident, msg, fut)
        except HashHelperGone as e:
            fut.set_exception(e)
        return fut

    def reap(self, max_wait_s: float) -> list[int]:
        """Kill every helper whose oldest unanswered check has waited over ``max_wait_s``
        (stopped, wedged, or starved of a core): its checks fail as if it had died, instead
        of holding their loads, and the engine's stop, forever. The pids killed."""
        now = time.monotonic()
        killed = []
        for h in self._helpers:
            waited = h.oldest_s(now) if h.alive else 0.0
            if waited > max_wait_s:
                log.warning(
                    "xdc: hash helper %d (pid %d) has not answered for %.1f s: killed",
                    h.index,
                    h.proc.pid,
                    waited,
                )
                with contextlib.suppress(ProcessLookupError):
                    h.proc.kill()
                killed.append(h.proc.pid)
        return killed

    def close(self) -> None:
        for h in self._helpers:
            h.close()
        self._helpers = []
