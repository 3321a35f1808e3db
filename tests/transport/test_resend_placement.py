"""Where a chunk lost with its connection goes next (``peer_link.pick_for``), without
sockets: not back onto the connection it was lost on while another it was not lost on is
up. The daemons' side of it is the stalled-chunk case of test_transport_faults."""

from __future__ import annotations

from collections import deque

from xdc.transport.peer_link import LOST_ON_SCAN, Work, pick_for


def _w(offset: int, *lost_on: int) -> Work:
    return Work("r", 0, offset, 1, lost_on=frozenset(lost_on))


def test_a_fresh_chunk_goes_to_whichever_connection_asks_first() -> None:
    q = deque([_w(0), _w(1)])
    assert pick_for(q, 3, [0, 1, 2, 3]) == 0


def test_a_chunk_lost_on_a_connection_is_left_to_the_others() -> None:
    q = deque([_w(0, 1), _w(1)])
    assert pick_for(q, 1, [0, 1, 2, 3]) == 1  # connection 1 takes the next one instead
    assert pick_for(q, 0, [0, 1, 2, 3]) == 0
    assert pick_for(deque([_w(0, 1)]), 1, [0, 1, 2, 3]) is None  # nothing for 1 now


def test_a_chunk_lost_on_every_other_live_connection_may_go_back() -> None:
    q = deque([_w(0, 1, 3)])
    assert pick_for(q, 1, [1, 3]) == 0  # both slow paths: no better place than either
    assert pick_for(q, 1, [0, 1, 3]) is None  # 0 is up and clean
    assert pick_for(q, 1, [1]) == 0  # the only connection up takes it


def test_a_writer_looks_only_so_far_for_a_chunk_of_its_own() -> None:
    lost = [_w(i, 2) for i in range(LOST_ON_SCAN)]
    assert pick_for(deque([*lost, _w(999)]), 2, [0, 2]) is None
    assert pick_for(deque([*lost[:-1], _w(999)]), 2, [0, 2]) == LOST_ON_SCAN - 1
