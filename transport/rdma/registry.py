"""Memory-region bookkeeping: each buffer registered once, every registration released once.

A leaked registration pins memory until the process exits, and a double deregistration is a
use-after-free in the driver; both are easy to get wrong on error paths, so one object owns
every MR of an endpoint and ``close`` (also on exceptions, via the context manager) releases
them all, continuing past individual failures and re-raising the first afterwards.
"""

from __future__ import annotations

from types import TracebackType

from xdc.transport.rdma.verbs import Access, Handle, Mr, Verbs, VerbsError


class MrRegistry:
    def __init__(self, verbs: Verbs, pd: Handle) -> None:
        self._verbs = verbs
        self._pd = pd
        self._mrs: dict[str, Mr] = {}
        self._by_rkey: dict[int, str] = {}
        self.closed = False

    def register(self, name: str, buf: memoryview, access: Access) -> Mr:
        if self.closed:
            raise VerbsError(f"registry closed; cannot register {name!r}")
        if name in self._mrs:
            raise VerbsError(f"{name!r} is registered already (register a buffer once)")
        mr = self._verbs.reg_mr(self._pd, buf, access)
        self._mrs[name] = mr
        self._by_rkey[mr.rkey] = name
        return mr

    def get(self, name: str) -> Mr:
        return self._mrs[name]

    def by_rkey(self, rkey: int) -> Mr | None:
        name = self._by_rkey.get(rkey)
        return None if name is None else self._mrs[name]

    def deregister(self, name: str) -> None:
        mr = self._mrs.pop(name)
        del self._by_rkey[mr.rkey]
        self._verbs.dereg_mr(mr)

    def __len__(self) -> int:
        return len(self._mrs)

    def close(self) -> None:
        """Deregister everything; safe to call again. The first failure is re-raised."""
        self.closed = True
        first: BaseException | None = None
        for name in list(self._mrs):
            try:
                self.deregister(name)
            except BaseException as exc:  # keep going: the others must not leak
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> MrRegistry:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
