"""The pool allocator's bookkeeping under random traffic: the kept used-bytes count always
equals what is allocated, free ranges never overlap an allocation, and freeing everything
gives back one range the size of the pool."""

from __future__ import annotations

import itertools
import random

import pytest
from xdc.transport.allocator import Allocator


def test_used_bytes_matches_the_allocations_through_random_traffic() -> None:
    rng = random.Random(7)
    a = Allocator(64 << 20, align=4096)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            a.free(start)
            del live[start]
        else:
            size = rng.randint(1, 3 << 20)
            start_or_none = a.try_alloc(size)
            if start_or_none is not None:
                live[start_or_none] = a.rounded(size)
        assert a.used_bytes == sum(live.values())
        assert a.free_bytes == a.capacity - a.used_bytes
        assert a.allocations == len(live)
    # no two live ranges overlap
    spans = sorted(live.items())
    for (s1, n1), (s2, _) in itertools.pairwise(spans):
        assert s1 + n1 <= s2
    for start in list(live):
        a.free(start)
    assert a.used_bytes == 0 and a.largest_free == a.capacity


def test_double_free_fails_loudly_and_leaves_the_count_alone() -> None:
    a = Allocator(1 << 20)
    start = a.try_alloc(5000)
    assert start is not None and a.used_bytes == 8192
    a.free(start)
    with pytest.raises(KeyError):
        a.free(start)
    assert a.used_bytes == 0
