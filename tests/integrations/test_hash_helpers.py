"""Arrival hashes in helper processes (xdc.integrations.hash_helpers): real processes over a
real shared-memory segment. A right block answers -1, a wrong one its index; a helper that
dies or is given what it cannot read fails its checks by name and leaves the others working;
a hostile frame on a helper's channel ends that helper, not its parent; closing leaves no
process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import xxhash
from xdc.transport.shm import Segment

from xdc.integrations.hash_frames import MAX_FRAME, FrameReader, frame
from xdc.integrations.hash_helper import first_mismatch
from xdc.integrations.hash_helpers import (
    HashHelperGone,
    HashHelpers,
    acquire,
    helpers_for,
    release,
)

BB = 64 * 1024
BLOCKS = 32
OFFSET = 4096  # the layer starts inside the pool, as a request's layers do


@pytest.fixture
def pool() -> Iterator[tuple[Segment, np.ndarray]]:
    seg = Segment.create(OFFSET + BLOCKS * BB, prefix="xdc-test-hash")
    try:
        view = np.frombuffer(seg.view, dtype=np.uint8)
        view[:] = np.random.default_rng(7).integers(0, 256, size=len(view), dtype=np.uint8)
        digests = np.array(
            [
                xxhash.xxh3_64_intdigest(view[OFFSET + p * BB : OFFSET + (p + 1) * BB].data)
                for p in range(BLOCKS)
            ],
            dtype=np.uint64,
        )
        del view
        yield seg, digests
    finally:
        seg.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_frames_round_trip_and_refuse_what_is_not_a_frame() -> None:
    r = FrameReader()
    data = frame([1, "seg", 2, b"\x00" * 3]) + frame([2])
    assert r.feed(data[:5]) == []
    assert r.feed(data[5:]) == [[1, "seg", 2, b"\x00" * 3], [2]]
    with pytest.raises(ValueError, match="frame of"):
        FrameReader().feed((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="not msgpack"):
        FrameReader().feed(b"\x00\x00\x00\x01\xc1")  # 0xc1: never used in msgpack
    with pytest.raises(ValueError, match="non-empty array"):
        body = msgpack.packb({"a": 1})
        FrameReader().feed(len(body).to_bytes(4, "big") + body)


def test_first_mismatch_names_the_first_block_off_its_digest(
    pool: tuple[Segment, np.ndarray],
) -> None:
    seg, digests = pool
    positions = np.array([5, 0, 31, 17], dtype=np.int64)
    want = digests[positions]
    assert first_mismatch(seg.view, OFFSET, BB, positions.tobytes(), want.tobytes()) == -1
    wrong = want.copy()
    wrong[2] ^= np.uint64(1)
    assert first_mismatch(seg.view, OFFSET, BB, positions.tobytes(), wrong.tobytes()) == 2
    with pytest.raises(ValueError, match="outside the pool"):
        far = np.array([BLOCKS], dtype=np.int64)
        first_mismatch(seg.view, OFFSET, BB, far.tobytes(), want[:1].tobytes())
    with pytest.raises(ValueError, match="differ in number"):
        first_mismatch(seg.view, OFFSET, BB, positions.tobytes(), want[:2].tobytes())


def test_helpers_check_blocks_of_a_real_pool_and_leave_nothing_when_closed(
    pool: tuple[Segment, np.ndarray],
) -> None:
    seg, digests = pool
    helpers = HashHelpers(2)
    pids = helpers.pids()
    try:
        positions = np.arange(BLOCKS, dtype=np.int64)
        assert helpers.check(seg.name, OFFSET, BB, positions, digests).result(20) == -1
        # flip one byte of block 9 in the pool: the helper reads what is there now
        np.frombuffer(seg.view, dtype=np.uint8)[OFFSET + 9 * BB + 100] ^= 0xFF
        futs = [helpers.check(seg.name, OFFSET, BB, positions, digests) for _ in range(4)]
        assert [f.result(20) for f in futs] == [9] * 4
        # a pool it cannot open: that check fails, naming why; the helper goes on
        bad = helpers.check("xdc-no-such-pool", 0, BB, positions[:1], digests[:1])
        with pytest.raises(HashHelperGone, match="FileNotFoundError"):
            bad.result(20)
        assert helpers.check(seg.name, OFFSET, BB, positions[:9], digests[:9]).result(20) == -1
    finally:
        helpers.close()
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), pids


def test_a_killed_helper_fails_its_checks_and_the_others_answer(
    pool: tuple[Segment, np.ndarray],
) -> None:
    seg, digests = pool
    positions = np.arange(BLOCKS, dtype=np.int64)
    helpers = HashHelpers(2)
    try:
        first, second = helpers.pids()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sum(h.alive for h in helpers._helpers) == 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # the reader thread sees its channel end
        assert [h.alive for h in helpers._helpers] == [False, True]
        assert helpers.usable
        results = [helpers.check(seg.name, OFFSET, BB, positions, digests) for _ in range(3)]
        assert [f.result(20) for f in results] == [-1] * 3
        os.kill(second, signal.SIGKILL)
        while helpers.usable and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not helpers.usable
        with pytest.raises(HashHelperGone, match="no hash helper is left"):
            helpers.check(seg.name, OFFSET, BB, positions, digests).result(5)
    finally:
        helpers.close()


def test_a_hostile_frame_ends_the_helper_not_its_parent() -> None:
    """What is not a frame on a helper's channel: the helper exits at once (1) instead of
    answering garbage or waiting for a frame that never ends."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "xdc.integrations.hash_helper", "--fd", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    try:
        ours.sendall((MAX_FRAME + 1).to_bytes(4, "big") + b"junk")
        assert proc.wait(timeout=20) == 1
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_check_of_a_bad_name_or_geometry_is_answered_not_fatal(
    pool: tuple[Segment, np.ndarray],
) -> None:
    seg, digests = pool
    helpers = HashHelpers(1)
    try:
        one = np.array([0], dtype=np.int64)
        for name, offset, bb in (("../etc/passwd", 0, BB), (seg.name, -1, BB), (seg.name, 0, 0)):
            f = helpers.check(name, offset, bb, one, digests[:1])
            with pytest.raises(HashHelperGone):
                f.result(20)
        assert helpers.check(seg.name, OFFSET, BB, one, digests[:1]).result(20) == -1
    finally:
        helpers.close()


def test_helpers_start_only_where_the_cores_spare_them() -> None:
    got = [helpers_for(n) for n in (1, 2, 4, 7, 8, 12, 16, 32, 128)]
    assert got == [0, 0, 0, 0, 4, 6, 8, 8, 8]
    # tensor-parallel ranks are processes of their own, each with helpers: they share cores
    assert [helpers_for(16, 2), helpers_for(16, 4), helpers_for(128, 8)] == [4, 0, 8]


def test_a_process_shares_one_set_of_helpers_until_the_last_user_gives_them_back() -> None:
    """A decode's loaders (one per part of its KV) share its helpers: two parts do not start
    two sets, and one part stopping does not stop the other's."""
    first = acquire(2)
    second = acquire(7)  # a later count is ignored: the set is started
    try:
        assert second is first and len(first.pids()) == 2
        pids = first.pids()
        release(first)
        assert all(not _gone(p) for p in pids) and second.usable
    finally:
        release(second)
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), pids
    again = acquire(1)  # after the last one back, a new set
    try:
        assert again is not first and len(again.pids()) == 1
    finally:
        release(again)


def test_a_helper_that_never_answers_is_reaped_and_its_checks_fail(
    pool: tuple[Segment, np.ndarray],
) -> None:
    """A stopped helper (SIGSTOP) would hold its checks, and so its loads and the engine's
    stop, forever: ``reap`` kills a helper whose oldest check waited too long, and its checks
    fail as a dead helper's do. A helper with nothing asked is never reaped."""
    seg, digests = pool
    positions = np.arange(BLOCKS, dtype=np.int64)
    helpers = HashHelpers(1)
    try:
        (pid,) = helpers.pids()
        assert helpers.check(seg.name, OFFSET, BB, positions, digests).result(20) == -1
        time.sleep(0.3)
        assert helpers.reap(0.1) == []  # idle, not stalled
        os.kill(pid, signal.SIGSTOP)
        stuck = helpers.check(seg.name, OFFSET, BB, positions, digests)
        time.sleep(0.3)
        assert helpers.reap(5.0) == []  # not waited long enough yet
        assert helpers.reap(0.1) == [pid]
        with pytest.raises(HashHelperGone):
            stuck.result(10)
        assert not helpers.usable
        t0 = time.monotonic()
    finally:
        helpers.close()
    assert time.monotonic() - t0 < 5
    assert _gone(pid)
