"""The decode scheduler's gate: it keeps remote-prefill requests out of vLLM's schedule until
their KV is complete at the receiver (why: admission.py, which decides; this drives it).

One connection to the receiver per engine, owned by the scheduler (vLLM calls it from one
thread). One ``Look`` names every request the gate holds, at most once per ``LOOK_EVERY_S``
and at most ``1 / LOOK_SHARE`` of the time (a look took 102 us for one name and 1.2 ms for
1,024 on the 2-core VM, and an engine with only waiting requests steps in a tight loop): an
engine with many waiting requests costs the receiver one small call now and then, not one
per request per step. A receiver that cannot be asked admits what it holds: the worker's
load then meets the same trouble and names it (local recompute, ``receiver_gone``).
"""

from __future__ import annotations

import contextlib
import logging
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
        self._rx: DecodeClient | None = None
        self.held: dict[str, Waiting] = {}  # vLLM request id -> its wait
        self._states: dict[str, str] = {}  # transfer -> its state at the last look
        self._looked_at = -float("inf")
        self._every_s = LOOK_EVERY_S
        self.looks = 0  # answered
        self.tries = 0  # asked
        self.down = False  # the last look failed: admit everything until one succeeds
        self.disabled = ""  # why the gate admits everything for good (a receiver too old)

    def check(
        self, req_id: str, names: tuple[str, ...], arrival_s: float, timeout_s: float
    ) -> tuple[Verdict, float]:
        """The request's verdict now, and what is left of its total wait (for its load)."""
        now = self.clock()
        if self.disabled:
            return Verdict(Admit.LOAD), timeout_s
        w = self.held.get(req_id)
        if w is None:
            w = self.held[req_id] = Waiting(names, now, min(arrival_s, timeout_s), timeout_s)
        # a request met between looks waits for the next one (one look per request met
        # would cost a burst of N requests N looks of up to N names each)
        if now - self._looked_at >= self._every_s:
            self._look(now)
        v = verdict(w, dict.fromkeys(names, "unreachable") if self.down else self._states, now)
        if v.admit is not Admit.WAIT:
            del self.held[req_id]
            if v.admit is Admit.RECOMPUTE:
                self.discard(names)
        return v, left_s(w, now)

    def _look(self, now: float) -> None:
        names = [n for w in self.held.values() for n in w.names]
        self._looked_at = now
        self.tries += 1
        try:
            if self._rx is None:
                self._rx = self._connect(self.receiver_socket, LOOK_TIMEOUT_S)
            t = time.perf_counter()
            self._states = self._rx.look(names)
            self._every_s = max(LOOK_EVERY_S, LOOK_SHARE * (time.perf_counter() - t))
            self.looks += 1
        except (XdcError, OSError) as e:
            self._drop_rx()
            if isinstance(e, TransferError) and e.code == ResultCode.BAD_OP:
                self.disabled = f"the receiver does not answer looks ({e})"
                log.warning(
                    "xdc: %s: decode requests get their KV blocks when scheduled", self.disabled
                )
            elif not self.down:  # said once per outage; tried again each RETRY_S
                log.warning(
                    "xdc: cannot ask the receiver where transfers stand (%s): decode requests "
                    "are scheduled at once until it answers",
                    e,
                )
            # admit: the worker's load meets the same receiver and names the trouble
            self.down = True
            self._every_s = RETRY_S
            return
        if self.down:
            log.info("xdc: the receiver answers looks again")
            self.down = False

    def forget(self, req_id: str) -> None:
        """The request finished (aborted) while held: its transfers will never be read."""
        w = self.held.pop(req_id, None)
        if w is not None:
            self.discard(w.names)

    def discard(self, names: tuple[str, ...]) -> None:
        """Best effort: the receiver refuses (or frees) transfers nobody will read; one it
        cannot be told of is freed at its own deadline or unclaimed time."""
        for name in names:
            try:
                if self._rx is None:
                    self._rx = self._connect(self.receiver_socket, LOOK_TIMEOUT_S)
                self._rx.discard(name)
            except TransferError as e:  # refused (e.g. another engine holds it): the next
                log.info("xdc: the receiver kept %s: %s", name, e)
            except (XdcError, OSError) as e:
                log.info("xdc: could not discard %s at the receiver: %s", name, e)
                self._drop_rx()
                return

    def _drop_rx(self) -> None:
        if self._rx is not None:
            with contextlib.suppress(Exception):
                self._rx.close()
            self._rx = None

    def close(self) -> None:
        self._drop_rx()


__all__ = ["LOOK_EVERY_S", "AdmissionGate"]
