"""The engine library's contract with real daemons: partial hand-over of a layer, the KV
layout both engines must agree on, non-blocking polls and bounded waits."""

from __future__ import annotations

import math
import time

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError

from tests.transport_fixtures import PairFactory
from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest

CHUNK = 64 * 1024


def _progress(rx: DecodeClient, rid: str) -> int:
    return int(rx.status()["progress"].get(rid, [0, 0])[0])


def _wait_progress(rx: DecodeClient, rid: str, want: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    got = _progress(rx, rid)
    while got < want and time.monotonic() < deadline:
        time.sleep(0.02)
        got = _progress(rx, rid)
    return got


def _wait_queued(tx: PrefillClient, rid: str, timeout: float = 10.0) -> int:
    """Queued bytes of a request once anything of it is queued (the ACCEPT has arrived)."""
    deadline = time.monotonic() + timeout
    queued = int(tx.status()["queued_bytes"].get(rid, 0))
    while queued == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
        queued = int(tx.status()["queued_bytes"].get(rid, 0))
    return queued


def test_a_layer_handed_over_in_parts_ships_each_final_chunk_at_once(
    pair_factory: PairFactory,
) -> None:
    """Chunked prefill: the part of a layer that is final goes on the wire before the rest
    exists; a chunk that is only partly final waits for the rest of its bytes."""
    p = pair_factory(connections=2, chunk_bytes=CHUNK).start()
    sizes = [8 * CHUNK, 8 * CHUNK]
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("parts", sizes)
        buf = t.layer_buffer(0)
        fill_layer(buf, "parts", 0)
        t.layer_ready(0, upto=3 * CHUNK + CHUNK // 2)  # three whole chunks and half of one
        # chunks are queued once the receiver has accepted the request (a round trip that may
        # still be under way): then what goes is the three whole chunks, not the half one; and
        # once they have landed nothing has added it since (queued stays put)
        assert _wait_queued(tx, "parts") == 3 * CHUNK
        assert _wait_progress(rx, "parts", 3 * CHUNK) == 3 * CHUNK
        assert tx.status()["queued_bytes"]["parts"] == 3 * CHUNK
        assert _progress(rx, "parts") == 3 * CHUNK
        assert t.poll() is None
        t.layer_ready(0, upto=6 * CHUNK)
        assert _wait_progress(rx, "parts", 6 * CHUNK) == 6 * CHUNK
        t.layer_ready(0)  # the rest of layer 0
        del buf
        buf = t.layer_buffer(1)
        fill_layer(buf, "parts", 1)
        del buf
        t.layer_ready(1, upto=sizes[1])  # upto == size is a whole hand-over too
        outcome = t.wait(10)
        assert outcome.ok, outcome
        assert t.poll() is None  # an outcome is handed out once
        req = rx.await_request("parts", timeout=10)
        for i, size in enumerate(sizes):
            assert layer_digest(req.layer(i)) == expected_digest("parts", i, size)
        req.release()
    p.assert_clean()


def test_a_partial_hand_over_that_goes_backwards_or_past_the_layer_is_refused(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    with PrefillClient(p.tx_sock) as tx:
        t = tx.begin("bad-upto", [4 * CHUNK])
        t.layer_buffer(0)
        t.layer_ready(0, upto=2 * CHUNK)
        t.layer_ready(0, upto=CHUNK)  # one-way: the refusal is pushed back
        tx.status()  # a round trip: the daemon answered the hand-over before this
        with pytest.raises(TransferError) as e:
            t.layer_ready(0)
        assert e.value.code == "BAD_REQUEST" and "upto" in e.value.message
        t2 = tx.begin("past-end", [4 * CHUNK])
        t2.layer_buffer(0)
        t2.layer_ready(0, upto=5 * CHUNK)
        tx.status()
        with pytest.raises(TransferError):
            t2.layer_ready(0)
        with pytest.raises(TypeError):
            t2.layer_ready(0, upto=1.5)  # type: ignore[arg-type]
        tx.cancel("bad-upto")
        tx.cancel("past-end")
    p.assert_clean()


def test_a_request_of_another_kv_layout_is_refused_before_any_byte_moves(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    mine = "model=m dtype=bf16 block=32 layers=2"
    theirs = "model=m dtype=bf16 block=16 layers=2"
    sizes = [4 * CHUNK, 4 * CHUNK]
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock, layout=mine) as rx:
        t = tx.begin("other-layout", sizes, layout=theirs)
        outcome = t.wait(10)  # refused at BEGIN: the engine never even got a buffer
        assert not outcome.ok and outcome.code == "LAYOUT_MISMATCH", outcome
        assert "block=16" in outcome.error and "block=32" in outcome.error
        with pytest.raises(TransferError) as e:
            rx.await_request("other-layout", timeout=5)
        assert e.value.code == "LAYOUT_MISMATCH"
        t = tx.begin("no-layout", sizes)  # unlabelled bytes are refused too
        assert t.wait(10).code == "LAYOUT_MISMATCH"
        t = tx.begin("same-layout", sizes, layout=mine)
        for i in range(2):
            buf = t.layer_buffer(i)
            fill_layer(buf, "same-layout", i)
            del buf
            t.layer_ready(i)
        assert t.wait(10).ok
        req = rx.await_request("same-layout", timeout=10)
        assert req.layout == mine
        req.release()
    p.assert_clean()


def test_a_request_delivered_before_its_engine_said_its_layout_is_checked_at_hand_out(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    with PrefillClient(p.tx_sock) as tx:
        t = tx.begin("early", [CHUNK], layout="block=16")
        buf = t.layer_buffer(0)
        fill_layer(buf, "early", 0)
        del buf
        t.layer_ready(0)
        assert t.wait(10).ok  # no decode engine had registered a layout yet
    with DecodeClient(p.rx_sock, layout="block=32") as rx:
        with pytest.raises(TransferError) as e:
            rx.await_request("early", timeout=5)
        assert e.value.code == "LAYOUT_MISMATCH"
        assert rx.status()["pool"]["used"] == 0  # refused and freed, never handed out
    p.assert_clean()


def test_await_with_zero_timeout_only_looks_and_bad_timeouts_are_refused(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory().start()
    with DecodeClient(p.rx_sock) as rx:
        t0 = time.monotonic()
        with pytest.raises(TransferError) as e:
            rx.await_request("nothing-here", timeout=0)
        assert e.value.code == "UNKNOWN_REQUEST" and e.value.rid == "nothing-here"
        with pytest.raises(TransferError) as e:
            rx.await_request(timeout=0)  # any request: nothing complete yet
        assert e.value.code == "TIMEOUT"
        assert time.monotonic() - t0 < 1.0
        for bad in (-1, math.nan, math.inf, 1e12):
            with pytest.raises(ValueError):
                rx.await_request(timeout=bad)
        with pytest.raises(TypeError):
            rx.await_request(timeout="5")  # type: ignore[arg-type]
        assert rx.status()["node"]  # the connection is still good


def test_layout_strings_are_checked_by_the_client(pair_factory: PairFactory) -> None:
    p = pair_factory().start()
    for bad in ("", "x" * 513, "line\nbreak"):
        with pytest.raises(ValueError):
            DecodeClient(p.rx_sock, layout=bad)
    with PrefillClient(p.tx_sock) as tx, pytest.raises(ValueError):
        tx.begin("r", [4096], layout="nul\x00")


def test_await_says_unknown_for_a_request_that_never_began_and_timeout_for_one_arriving(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("arriving", [4 * CHUNK, 4 * CHUNK])
        buf = t.layer_buffer(0)
        fill_layer(buf, "arriving", 0)
        del buf
        t.layer_ready(0)
        _wait_progress(rx, "arriving", 4 * CHUNK)
        with pytest.raises(TransferError) as e:
            rx.await_request("arriving", timeout=0.2)
        assert e.value.code == "TIMEOUT"
        with pytest.raises(TransferError) as e:
            rx.await_request("never-began", timeout=0.2)
        assert e.value.code == "UNKNOWN_REQUEST"
        tx.cancel("arriving")
    p.assert_clean()


def test_await_any_returns_the_first_of_several_requests_and_names_a_failed_one(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    sizes = [2 * CHUNK]
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        with pytest.raises(TransferError) as e:
            rx.await_any(["x", "y"], timeout=0)
        assert e.value.code == "TIMEOUT"
        t = tx.begin("second", sizes)
        buf = t.layer_buffer(0)
        fill_layer(buf, "second", 0)
        del buf
        t.layer_ready(0)
        assert t.wait(10).ok
        req = rx.await_any(["first", "second", "third"], timeout=10)
        assert req.rid == "second"
        assert layer_digest(req.layer(0)) == expected_digest("second", 0, sizes[0])
        req.release()
        failed = tx.begin("doomed", sizes, deadline_s=0.5)
        failed.layer_buffer(0)  # never handed over
        assert failed.wait(10).code == "DEADLINE"
        with pytest.raises(TransferError) as e:
            rx.await_any(["first", "doomed"], timeout=5)
        assert e.value.rid == "doomed" and e.value.code in ("DEADLINE", "CANCELLED")
    p.assert_clean()


def test_discard_stops_a_request_arriving_frees_a_complete_one_and_refuses_a_late_one(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    sizes = [4 * CHUNK, 4 * CHUNK]
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        # arriving: its sender learns it is not wanted
        t = tx.begin("arriving", sizes)
        buf = t.layer_buffer(0)
        fill_layer(buf, "arriving", 0)
        del buf
        t.layer_ready(0)
        _wait_progress(rx, "arriving", 4 * CHUNK)
        rx.discard("arriving")
        outcome = t.wait(10)
        assert not outcome.ok and outcome.code == "CANCELLED" and "gave it up" in outcome.error
        # complete and unclaimed: freed
        t = tx.begin("complete", [CHUNK])
        buf = t.layer_buffer(0)
        fill_layer(buf, "complete", 0)
        del buf
        t.layer_ready(0)
        assert t.wait(10).ok
        rx.discard("complete")
        assert rx.status()["pool"]["used"] == 0
        # not begun yet: refused when it comes, before any byte moves
        rx.discard("late")
        t = tx.begin("late", [CHUNK])
        assert t.wait(10).code == "CANCELLED"
    p.assert_clean()
