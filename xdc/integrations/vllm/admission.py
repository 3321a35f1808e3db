"""When a decode engine gives a remote-prefill request its KV blocks (pure).

A gateway sends the decode request beside its prefill, so the decode engine meets it while
the prefill is still queued at a busy PrfaaS cluster, running, or streaming. Blocks given to
it then sit idle for all of that (seconds, up to the gateway's wait for the prefill) while
running decodes could have used them: on a decode instance, KV memory is what bounds the
batch. So the connector's scheduler side keeps the request out of vLLM's schedule
(``get_num_new_matched_tokens`` answers None: "ask again later") until every transfer this
engine's ranks read for it is complete at the receiver, which it learns by looking
(``Look``, which claims nothing). Then the request is scheduled with its load, and the
worker side lands it at once.

Anything other than a transfer still to come (ended, claimed, discarded) admits the request
too: the worker side's load then meets the receiver's real answer and reports it (local
recompute with its reason), so each failure has one place that names it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

# the receiver's states (Look) of a transfer still to come
COMING: Final = frozenset({"unknown", "allocating", "receiving"})


class Admit(enum.Enum):
    WAIT = "wait"  # keep it out of the schedule: its KV is still to come
    LOAD = "load"  # schedule it with its load (complete, or the load will say why not)
    RECOMPUTE = "recompute"  # waited too long: prefill it here


@dataclass(frozen=True, slots=True)
class Waiting:
    """A request kept out of the schedule: the transfers its ranks read and its waits,
    counted from when the scheduler first met it."""

    names: tuple[str, ...]
    since: float
    arrival_s: float  # for every transfer to begin
    timeout_s: float  # for all of them to be complete


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: Admit
    reason: str = ""  # RECOMPUTE: a metric label (never_arrived, timeout)
    why: str = ""


def verdict(w: Waiting, states: Mapping[str, str], now: float) -> Verdict:
    """What to do with ``w`` now, given the receiver's ``states`` of its transfers (a name
    missing from them is counted as still to come)."""
    seen = [states.get(n, "unknown") for n in w.names]
    if not any(s in COMING for s in seen):
        return Verdict(Admit.LOAD)
    waited = now - w.since
    if waited > w.timeout_s:
        return Verdict(Admit.RECOMPUTE, "timeout", f"not complete within {w.timeout_s:g}s")
    if "unknown" in seen and waited > w.arrival_s:
        return Verdict(
            Admit.RECOMPUTE, "never_arrived", f"no transfer began within {w.arrival_s:g}s"
        )
    return Verdict(Admit.WAIT)


def left_s(w: Waiting, now: float, floor_s: float = 1.0) -> float:
    """What is left of ``w``'s total wait for the load once admitted (at least ``floor_s``:
    a complete transfer is claimed at once, but the worker's poll must get one look)."""
    return max(floor_s, w.timeout_s - (now - w.since))


__all__ = ["COMING", "Admit", "Verdict", "Waiting", "left_s", "verdict"]
