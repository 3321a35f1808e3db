"""The cross-cluster link of the replay simulator: a fluid, max-min fair pipe.

A PrfaaS prefill streams its KV layer by layer while it computes, so a transfer's bytes become
*available* at a steady rate (``bytes / prefill_time``) between prefill start and end, not all
at once. Modelling that production cap is what makes the link behave like the real one: on a
healthy link each transfer keeps up with its producer and finishes the moment prefill ends
(TTFT = prefill), the link carries a smooth average load instead of short full-rate bursts,
and a standing backlog of produced-but-unsent bytes appears only when the link is really too
slow. That backlog is the simulator's congestion signal, as loss and retransmits are for the
real congestion monitor.

Between events every rate is constant, so the state advances exactly (no time steps): flows
that are caught up with their producer take ``min(production rate, fair share)``, backlogged
flows share what is left equally (water-filling, i.e. TCP-like max-min fairness across the
multi-connection transfers). Events are a flow finishing, a backlogged flow catching up with
its producer, and capacity changes, which the caller applies with ``set_capacity``.

Pure state over explicit times; the simulator owns the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A flow within this many bytes of a boundary (done, caught up) is at it; absorbs float drift.
_EPS_BYTES = 1e-3
_EPS_REL = 1e-9
# ... or within this many seconds of reaching it at its current rate (float time resolution).
_EPS_S = 1e-9
# Events processed at one instant before the model is declared stuck (a bug, not a workload).
_MAX_SAME_INSTANT = 100_000


@dataclass(slots=True)
class _Flow:
    key: int
    nbytes: float
    start: float
    end: float  # production ends (prefill done); == start for data that already exists
    cap: float  # production rate in bytes/s; inf when everything is already produced
    sent: float = 0.0
    rate: float = 0.0
    caught: bool = True  # sent == produced and the flow is limited by its producer

    def produced(self, t: float) -> float:
        if t >= self.end or not math.isfinite(self.cap):
            return self.nbytes
        return min(self.cap * max(t - self.start, 0.0), self.nbytes)

    def eps(self) -> float:
        return _EPS_BYTES + _EPS_REL * self.nbytes


class FluidLink:
    """One direction of the link; flows are keyed by the caller's integer ids."""

    def __init__(self, capacity_bps: float, now: float = 0.0) -> None:
        if not (math.isfinite(capacity_bps) and capacity_bps >= 0):
            raise ValueError(f"capacity_bps must be finite and >= 0, got {capacity_bps}")
        self.capacity_bps = capacity_bps
        self.now = now
        self._flows: dict[int, _Flow] = {}
        self._next = math.inf
        self.bytes_sent = 0.0  # cumulative, for utilisation and egress figures
        self.capacity_bits = 0.0  # integral of capacity over time, bits
        self.flows_done = 0

    # -- queries

    def __len__(self) -> int:
        return len(self._flows)

    def next_event(self) -> float:
        """When the link next changes on its own (a flow finishes or catches up); inf if idle."""
        return self._next

    def backlog_bytes(self) -> float:
        """Bytes already produced but not yet sent, at ``self.now``: the standing queue."""
        t = self.now
        return sum(max(f.produced(t) - f.sent, 0.0) for f in self._flows.values())

    def throughput_bps(self) -> float:
        """Current sending rate in bits/s."""
        return 8.0 * sum(f.rate for f in self._flows.values())

    # -- changes

    def add_flow(self, now: float, key: int, nbytes: float, produce_s: float = 0.0) -> list[int]:
        """Start a transfer whose bytes are produced evenly over the next ``produce_s`` seconds.

        Returns flows that finished while advancing to ``now`` (see ``advance``); a zero-byte
        flow finishes immediately and is included.
        """
        if key in self._flows:
            raise ValueError(f"flow {key} already on the link")
        if not (math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"nbytes must be finite and >= 0, got {nbytes}")
        done = self.advance(now)
        if nbytes <= 0:
            done.append(key)
            self.flows_done += 1
            return done
        end = now + max(produce_s, 0.0)
        # Production too short to register on the clock counts as data that already exists.
        cap = nbytes / produce_s if end > now else math.inf
        self._flows[key] = _Flow(key, float(nbytes), now, end, cap, caught=math.isfinite(cap))
        self._allocate()
        return done

    def set_capacity(self, now: float, capacity_bps: float) -> list[int]:
        if not (math.isfinite(capacity_bps) and capacity_bps >= 0):
            raise ValueError(f"capacity_bps must be finite and >= 0, got {capacity_bps}")
        done = self.advance(now)
        self.capacity_bps = capacity_bps
        self._allocate()
        return done

    def advance(self, now: float) -> list[int]:
        """Move the fluid state to ``now``; keys of flows that finished on the way, in order.

        Every finish happens exactly at an internal event time, which the caller learns from
        ``next_event`` beforehand; a finish is reported by the first ``advance`` at or after it.
        """
        if not math.isfinite(now):
            raise ValueError(f"time must be finite, got {now}")
        if now < self.now:
            raise ValueError(f"time went backwards: {now} < {self.now}")
        done: list[int] = []
        same = 0
        while self._next <= now:
            t = self._next
            same = same + 1 if t <= self.now else 0
            if same > _MAX_SAME_INSTANT:
                raise RuntimeError(f"fluid link made no progress at t={t}")
            self._move(t)
            done.extend(self._settle())
            self._allocate()
        self._move(now)
        return done

    # -- internals

    def _move(self, t: float) -> None:
        dt = t - self.now
        if dt <= 0:
            return
        moved = 0.0
        for f in self._flows.values():
            if f.rate <= 0:
                continue
            if f.caught:
                new = f.produced(t)
                moved += new - f.sent
                f.sent = new
            else:
                step = min(f.rate * dt, max(f.produced(t) - f.sent, 0.0))
                moved += step
                f.sent += step
        self.bytes_sent += moved
        self.capacity_bits += self.capacity_bps * dt
        self.now = t

    def _settle(self) -> list[int]:
        """Retire finished flows and mark backlogged flows that have caught their producer."""
        t = self.now
        done: list[int] = []
        for f in list(self._flows.values()):
            eps = f.eps()
            left = f.nbytes - f.sent
            if f.caught:
                finished = t >= f.end  # in step with its producer: ends exactly with it
            else:
                all_made = t >= f.end or f.produced(t) >= f.nbytes - eps
                near = left <= eps or (f.rate > 0 and left / f.rate <= _EPS_S)
                finished = all_made and near
            if finished:
                self.bytes_sent += left
                del self._flows[f.key]
                done.append(f.key)
                continue
            if not f.caught and t < f.end:
                produced = f.produced(t)
                gap = produced - f.sent
                if gap <= eps or (f.rate > f.cap and gap / (f.rate - f.cap) <= _EPS_S):
                    self.bytes_sent += produced - f.sent
                    f.sent = produced
                    f.caught = True
        self.flows_done += len(done)
        return done

    def _allocate(self) -> None:
        """Max-min fair rates for the current flows, then the time of the next event."""
        t = self.now
        flows = list(self._flows.values())
        if not flows:
            self._next = math.inf
            return
        cap_bytes = self.capacity_bps / 8.0
        limited = sorted(
            (f for f in flows if f.caught and t < f.end and math.isfinite(f.cap)),
            key=lambda f: f.cap,
        )
        remaining = cap_bytes
        left = len(flows)
        level = remaining / left
        granted: set[int] = set()
        for f in limited:
            if f.cap <= level:
                f.rate = f.cap
                remaining -= f.cap
                left -= 1
                granted.add(f.key)
                level = remaining / left if left else 0.0
            else:
                break
        nxt = math.inf
        for f in flows:
            if f.key not in granted:
                f.rate = level
                # Share below production (or production over): backlogged from here on.
                f.caught = False
            nxt = min(nxt, self._event_of(f, t))
        self._next = nxt

    @staticmethod
    def _event_of(f: _Flow, t: float) -> float:
        if f.caught:
            return f.end  # keeps pace with the producer and finishes when production ends
        if f.rate <= 0:
            return math.inf
        finish = t + (f.nbytes - f.sent) / f.rate
        if t < f.end and f.rate > f.cap:
            catch = t + (f.produced(t) - f.sent) / (f.rate - f.cap)
            if catch < f.end and catch < finish:
                return max(catch, t)
        return max(finish, t)


__all__ = ["FluidLink"]
