"""When a decode engine gives a remote-prefill request its KV blocks: the pure verdict
(admission.py) and the scheduler's gate (admit_gate.py) against a real receiver and sender
pair: it looks without claiming, admits once every transfer is complete, and tells the
receiver about a request it gave up on or that was aborted while waiting."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient

from tests.transport_fixtures import PairFactory, intact, produce
from xdc.integrations.vllm.admission import Admit, Verdict, Waiting, left_s, verdict
from xdc.integrations.vllm.admit_gate import AdmissionGate
from xdc.integrations.vllm.parts import transfer_names

W = Waiting(("r#0/2", "r#1/2"), since=100.0, arrival_s=10.0, timeout_s=60.0)


@pytest.mark.parametrize(
    ("states", "now", "want"),
    [
        ({}, 101.0, Verdict(Admit.WAIT)),  # nothing began yet
        ({"r#0/2": "complete"}, 101.0, Verdict(Admit.WAIT)),  # one part still to come
        ({"r#0/2": "complete", "r#1/2": "receiving"}, 150.0, Verdict(Admit.WAIT)),
        ({"r#0/2": "complete", "r#1/2": "complete"}, 101.0, Verdict(Admit.LOAD)),
        # an end the load must name (the worker's load meets it and reports it)
        ({"r#0/2": "complete", "r#1/2": "failed"}, 101.0, Verdict(Admit.LOAD)),
        ({"r#0/2": "discarded", "r#1/2": "done"}, 101.0, Verdict(Admit.LOAD)),
        ({"r#0/2": "unreachable", "r#1/2": "unreachable"}, 101.0, Verdict(Admit.LOAD)),
    ],
)
def test_a_request_waits_while_any_of_its_transfers_is_still_to_come(
    states: dict[str, str], now: float, want: Verdict
) -> None:
    assert verdict(W, states, now) == want


def test_a_request_is_recomputed_when_its_transfer_never_began_or_never_completed() -> None:
    v = verdict(W, {"r#0/2": "complete"}, 110.5)
    assert (v.admit, v.reason) == (Admit.RECOMPUTE, "never_arrived") and "10s" in v.why
    # both began: the arrival wait is over, the total one is not
    assert verdict(W, {"r#0/2": "receiving", "r#1/2": "allocating"}, 159.0).admit is Admit.WAIT
    v = verdict(W, {"r#0/2": "receiving", "r#1/2": "complete"}, 160.5)
    assert (v.admit, v.reason) == (Admit.RECOMPUTE, "timeout")
    assert left_s(W, 130.0) == 30.0 and left_s(W, 170.0) == 1.0


def test_a_decode_engine_reads_one_transfer_per_distinct_copy() -> None:
    assert transfer_names("r", [1]) == ("r",)
    assert transfer_names("r", [1, 1]) == ("r",)  # MLA at two ranks: one copy
    assert transfer_names("r", [2, 2]) == ("r#0/2", "r#1/2")
    assert transfer_names("r", [1, 2]) == ("r", "r#0/2", "r#1/2")  # Kimi Linear's shape


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "the gate's thread never got there"
        time.sleep(0.01)


def _check(gate: AdmissionGate, req: str, name: str) -> Verdict:
    return gate.check(req, (name,), arrival_s=4.0, timeout_s=30.0)[0]


def test_the_gate_admits_once_complete_claiming_nothing_and_discards_what_it_gave_up(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(connections=2).start()
    clock = _Clock()
    gate = AdmissionGate(p.rx_sock, clock=clock)
    try:
        # not begun: kept out; past its arrival wait: recomputed, and the receiver told
        assert _check(gate, "q1", "never").admit is Admit.WAIT
        _until(lambda: gate.looks >= 1)
        clock.now = 4.5
        v = _check(gate, "q1", "never")
        assert (v.admit, v.reason) == (Admit.RECOMPUTE, "never_arrived")
        with DecodeClient(p.rx_sock) as rx:
            _until(lambda: rx.look(["never"]) == {"never": "discarded"})
        # a transfer that completes: kept out while it arrives, then admitted, unclaimed
        clock.now = 10.0
        assert _check(gate, "q2", "late").admit is Admit.WAIT
        with PrefillClient(p.tx_sock) as tx:
            produce(tx, "late", [64 << 10, 64 << 10])
        with DecodeClient(p.rx_sock) as rx:
            _until(lambda: rx.look(["late"])["late"] == "complete")
            # the gate's thread saw it too: two looks more, since one under way now may have
            # asked before the request completed (CI saw the gate still say WAIT after one)
            looked = gate.looks
            _until(lambda: gate.looks >= looked + 2)
            clock.now = 12.0
            v, left = gate.check("q2", ("late",), arrival_s=4.0, timeout_s=30.0)
            assert v.admit is Admit.LOAD and left == 28.0
            assert rx.look(["late"]) == {"late": "complete"}  # the load claims it, not the gate
            intact(rx, "late")
        assert gate.held == {}
        # aborted while waiting: its transfer is refused when it comes
        _check(gate, "q3", "aborted")
        gate.forget("q3")
        with DecodeClient(p.rx_sock) as rx:
            _until(lambda: rx.look(["aborted"]) == {"aborted": "discarded"})
    finally:
        gate.close()
    p.assert_clean()


def test_a_paused_receiver_never_stalls_the_scheduler_and_looks_are_paced(
    pair_factory: PairFactory,
) -> None:
    """The scheduler also runs the engine's decoding requests: ``check`` only reads what the
    gate's thread last saw, while the receiver is SIGSTOPped too. Fifty requests met at once
    cost the receiver a look every 5 ms at most, each naming them all, not one per request."""
    p = pair_factory(connections=2).start(sender=False)
    gate = AdmissionGate(p.rx_sock)
    try:
        assert _check(gate, "q0", "r0").admit is Admit.WAIT
        _until(lambda: gate.looks >= 1)
        os.kill(p.receiver.proc.pid, signal.SIGSTOP)
        try:
            t = time.perf_counter()
            for i in range(50):
                assert _check(gate, f"b{i}", f"burst-{i}").admit is Admit.WAIT
            took = time.perf_counter() - t
            time.sleep(0.3)
            assert took < 0.1, took  # no call waited on the receiver
        finally:
            os.kill(p.receiver.proc.pid, signal.SIGCONT)
        before, t0 = gate.looks, time.monotonic()
        _until(lambda: gate.looks > before)
        time.sleep(0.5)
        rate = (gate.looks - before) / (time.monotonic() - t0)
        assert rate <= 1 / 0.005 + 10, rate
        for i in range(50):
            gate.forget(f"b{i}")
        gate.forget("q0")
    finally:
        gate.close()


def test_a_gate_that_cannot_reach_its_receiver_admits_and_tries_again_each_second(
    pair_factory: PairFactory,
) -> None:
    """The worker's load then meets the same receiver and names the trouble
    (``receiver_gone``); the gate neither holds requests nor retries at every look."""
    p = pair_factory(connections=2).start(sender=False)
    gate = AdmissionGate(p.rx_sock)
    try:
        p.receiver.stop()
        assert _check(gate, "q1", "r1").admit is Admit.WAIT  # not looked at yet
        _until(lambda: gate.down)
        assert _check(gate, "q1", "r1").admit is Admit.LOAD and gate.held == {}
        assert _check(gate, "q2", "r2").admit is Admit.LOAD
        tries = gate.tries
        time.sleep(0.5)
        assert gate.tries <= tries + 1  # once a second, not every 5 ms
        p.start(sender=False)  # the receiver is back
        assert _check(gate, "q3", "r3").admit is Admit.LOAD or not gate.down
        _until(lambda: not gate.down, timeout=5)
        assert _check(gate, "q4", "r4").admit is Admit.WAIT
        gate.forget("q3")
        gate.forget("q4")
    finally:
        gate.close()


def test_a_gate_whose_daemon_does_not_answer_looks_admits_at_once_for_good(
    pair_factory: PairFactory,
) -> None:
    """A receiver from before ``Look`` answers BAD_OP (as a sender's socket does: the op is
    not served there): requests are scheduled at once, as before, and never asked about."""
    p = pair_factory(connections=2).start(receiver=False)
    gate = AdmissionGate(p.tx_sock)
    try:
        _check(gate, "q1", "r1")
        _until(lambda: bool(gate.disabled))
        assert "does not answer looks" in gate.disabled
        for i in range(5):
            assert _check(gate, f"q{i}", "r").admit is Admit.LOAD
        time.sleep(0.2)
        assert gate.tries == 1
    finally:
        gate.close()
