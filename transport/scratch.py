"""Scratch buffers for chunk payloads that must not land in place, shared by a daemon.

A payload goes to scratch only when another connection is receiving the same cell in place
right now (a resend racing the original): it is verified there and copied over once. Such
races are rare, so a handful of buffers serves a whole receiver. They used to be one per
connection, kept for the connection's life: one duplicate chunk on each of 200 connections
cost 800 MiB. Now the daemon holds at most ``limit`` at once and keeps ``keep`` for reuse.
"""

from __future__ import annotations


class ScratchPool:
    def __init__(self, size: int, limit: int, keep: int = 2) -> None:
        self.size = size
        self.limit = limit
        self.keep = keep
        self.lent = 0
        self._free: list[bytearray] = []

    def take(self) -> bytearray | None:
        """A buffer of ``size`` bytes, or None when ``limit`` are lent (the caller declines
        the payload and asks for it again later)."""
        if self.lent >= self.limit:
            return None
        self.lent += 1
        return self._free.pop() if self._free else bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        self.lent -= 1
        if len(self._free) < self.keep:
            self._free.append(buf)
