"""The decode scheduler's gate: it keeps remote-prefill requests out of vLLM's schedule until
their KV is complete at the receiver (why: admission.py, which decides; this drives it).

The scheduler never waits on the receiver here: ``check`` reads the states the gate's own
thread last saw, and that thread does the talking (one connection to the receiver, owned by
it). A paused or wedged receiver must not stall an engine whose running requests are
decoding. The thread's ``Look`` names every request the gate holds, at most once per
``LOOK_EVERY_S`` and spending at most ``1 / LOOK_SHARE`` of its time on it (a look took
102 us for one name and 1.2 ms for 1,024 on the 2-core VM). A receiver that cannot be asked
admits what the gate holds (said once per outage, tried again each ``RETRY_S``): the worker's
load then meets the same trouble and names it (local recompute, ``receiver_gone``); one that
does not answer looks at all (from before ``Look``) turns the gate off for good.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from xdc.errors import ResultCode, TransferError, XdcError
from xdc.integrations.vllm.admission import Admit, Verdict, Waiting, left_s, verdict
from xdc.transport.engine_client import DecodeClient

# under "vllm." so that vLLM's logging configuration shows it (the connector's logger)
log = logging.getLogger("vllm.xdc.connector")

LOOK_EVERY_S = 0.005
LOOK_SHARE = 20  # a look's cost times this is the least time to the next one
LOOK_TIMEOUT_S = 2.0
RETRY_S = 1.0  # after a failed look (receiver down), the next try
PROBE = "xdc-admission-probe"  # what a look names to learn the receiver answers again
IDLE_S = 1.0  # the thread's longest sleep with nothing held (it is woken when work comes)


class AdmissionGate:
    def __init__(
        self,
        receiver_socket: str,
        clock: Callable[[], float] = time.monotonic,
        connect: Callable[[str, float], DecodeClient] = DecodeClient,
    ) -> None:
        self.receiver_socket = receiver_socket
        self.clock = clock
        self._connect = connect
        self._lock = threading.Lock()  # guards everything below that both threads touch
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held: dict[str, Waiting] = {}  # vLLM request id -> its wait
        self._states: dict[str, str] = {}  # transfer -> its state at the last look
        self._discards: list[str] = []  # transfers nobody will read, for the thread to say
        self.looks = 0  # answered
        self.tries = 0  # asked
        self.down = False  # the last look failed: admit everything until one succeeds
        self.disabled = ""  # why the gate admits everything for good (a receiver too old)
        self._rx: DecodeClient | None = None  # the thread's

    # --- the scheduler's side: never waits on the receiver ------------------------------------

    def check(
        self, req_id: str, names: tuple[str, ...], arrival_s: float, timeout_s: float
    ) -> tuple[Verdict, float]:
        """The request's verdict now, and what is left of its total wait (for its load). A
        request first met here waits for the thread's next look. ``arrival_s`` is at most
        ``timeout_s`` (the connector's ``_arrival_s``)."""
        now = self.clock()
        with self._lock:
            if self.disabled:
                return Verdict(Admit.LOAD), timeout_s
            w = self.held.get(req_id)
            if w is None:
                w = self.held[req_id] = Waiting(names, now, arrival_s, timeout_s)
                self._start()
            states = dict.fromkeys(names, "unreachable") if self.down else self._states
            v = verdict(w, states, now)
            if v.admit is not Admit.WAIT:
                del self.held[req_id]
                if v.admit is Admit.RECOMPUTE:
                    self._discard(names)
        return v, left_s(w, now)

    def forget(self, req_id: str) -> None:
        """The request finished (aborted) while held: its transfers will never be read."""
        with self._lock:
            w = self.held.pop(req_id, None)
            if w is not None:
                self._discard(w.names)

    def _discard(self, names: tuple[str, ...]) -> None:
        self._discards.extend(names)
        self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="xdc-admission", daemon=True)
            self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(LOOK_TIMEOUT_S + 1.0)
        self._drop_rx()

    # --- the gate's thread: all the talking --------------------------------------------------

    def _run(self) -> None:
        next_look = 0.0
        while not self._stop.is_set():
            with self._lock:
                names = [] if self.disabled else [n for w in self.held.values() for n in w.names]
                if self.down and not names and not self.disabled:
                    names = [PROBE]  # every request is admitted meanwhile: ask about none
                discards, self._discards = self._discards, []
                self._wake.clear()
            for name in discards:
                self._tell_discard(name)
            if names and time.perf_counter() >= next_look:
                next_look = time.perf_counter() + self._look(names)
            # woken early by a request met or given up; a new request waits for the next look
            self._wake.wait(max(0.0, next_look - time.perf_counter()) if names else IDLE_S)

    def _look(self, names: list[str]) -> float:
        """One look; the least time to the next."""
        self.tries += 1
        try:
            rx = self._client()
            t = time.perf_counter()
            states = rx.look(names)
            cost = time.perf_counter() - t
        except (XdcError, OSError) as e:
            self._drop_rx()
            with self._lock:
                if isinstance(e, TransferError) and e.code == ResultCode.BAD_OP:
                    self.disabled = f"the receiver does not answer looks ({e})"
                    log.warning(
                        "xdc: %s: decode requests get their KV blocks when scheduled",
                        self.disabled,
                    )
                elif not self.down:  # said once per outage
                    log.warning(
                        "xdc: cannot ask the receiver where transfers stand (%s): decode "
                        "requests are scheduled at once until it answers",
                        e,
                    )
                self.down = True
            return RETRY_S
        with self._lock:
            self._states = states
            self.looks += 1
            if self.down:
                log.info("xdc: the receiver answers looks again")
                self.down = False
        return max(LOOK_EVERY_S, LOOK_SHARE * cost)

    def _tell_discard(self, name: str) -> None:
        """Best effort: the receiver refuses (or frees) a transfer nobody will read; one it
        cannot be told of is freed at its own deadline or unclaimed time."""
        try:
            self._client().discard(name)
        except TransferError as e:  # refused (e.g. another engine holds it)
            log.info("xdc: the receiver kept %s: %s", name, e)
        except (XdcError, OSError) as e:
            log.info("xdc: could not discard %s at the receiver: %s", name, e)
            self._drop_rx()

    def _client(self) -> DecodeClient:
        """The thread's connection to the receiver, made when first needed or after a drop."""
        if self._rx is None:
            self._rx = self._connect(self.receiver_socket, LOOK_TIMEOUT_S)
        return self._rx

    def _drop_rx(self) -> None:
        if self._rx is not None:
            with contextlib.suppress(Exception):
                self._rx.close()
            self._rx = None


__all__ = ["LOOK_EVERY_S", "AdmissionGate"]
