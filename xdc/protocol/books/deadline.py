"""A transfer's deadline, which moves with the transfer's progress.

A request's KV streams while its prefill is still running, so how long the transfer lives is
the prefill's business, not the link's: a long prompt, a slow model or a busy prefill engine
can keep handing layers over for minutes. A deadline fixed at BEGIN failed every such request
however healthy its link (CI: a 3,073-token hybrid prefill on a loaded 2-core machine was 55%
handed over at 30 s and failed DEADLINE on an idle link), and the decode then recomputed the
whole prompt locally. So a request fails when *nothing moves* for ``window_s``:

- the sender counts from the last thing that moved: the engine handing bytes over, or the
  receiver acknowledging them;
- the receiver cannot see the engine (a chunk goes out only once all its bytes are final, so
  chunks may pause for a whole prefill). Its sender, which sees it, says KEEP for each live
  request every third of a window (at least every second), and stops when the request ends
  there; the receiver counts from the last chunk verified, END or KEEP. So a CANCEL lost
  with its connection still frees the request a window later.

``cap`` bounds a request however it moves, so that an engine or a peer dripping a byte at a
time cannot hold pool space forever.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Deadline:
    window_s: float  # the longest a request may go without progress
    cap: float  # the latest it may end, whatever its progress (clock time)
    at: float  # when it fails unless it progresses first (clock time)

    @classmethod
    def start(cls, now: float, window_s: float, max_s: float) -> Deadline:
        cap = now + max(window_s, max_s)
        return cls(window_s, cap, min(cap, now + window_s))

    def progress(self, now: float) -> None:
        """Something moved at ``now``: the request may stall ``window_s`` from here."""
        self.at = min(self.cap, max(self.at, now + self.window_s))

    def passed(self, now: float) -> bool:
        return now > self.at

    def why(self, created: float) -> str:
        """Why a request that began at ``created`` failed when ``at`` passed."""
        if self.at >= self.cap:
            return f"not done within its limit of {self.cap - created:.1f}s"
        return f"no progress for {self.window_s:.1f}s"
