"""Host-wide TCP counters from /proc/net/snmp and /proc/net/netstat.

Per-socket ``tcp_info`` misses what happens to connections that already closed and to other
traffic sharing the NIC; the kernel's MIB counters see all of it. They are cumulative since
boot (per network namespace: a process inside a namespace reads that namespace's counters),
so only deltas between two reads mean anything.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Counters = dict[str, dict[str, int]]


def parse_counters(text: str) -> Counters:
    """Parse the "Section: names..." / "Section: values..." line pairs of snmp/netstat.

    Tolerant by design: a kernel that adds a counter, a section with a mismatched pair or a
    non-numeric value must not cost us the other counters.
    """
    out: Counters = {}
    lines = [ln for ln in text.splitlines() if ln.strip()]
    i = 0
    while i + 1 < len(lines):
        head, _, names = lines[i].partition(":")
        head2, _, values = lines[i + 1].partition(":")
        if not head or head != head2:
            i += 1
            continue
        section = out.setdefault(head.strip(), {})
        keys, vals = names.split(), values.split()
        try:
            section.update(zip(keys, map(int, vals), strict=True))  # the 10 Hz fast path
        except ValueError:
            for name, value in zip(keys, vals, strict=False):
                with contextlib.suppress(ValueError):
                    section[name] = int(value)
        i += 2
    return out


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _merge(parts: Iterable[Counters]) -> Counters:
    out: Counters = {}
    for part in parts:
        for section, values in part.items():
            out.setdefault(section, {}).update(values)
    return out


@dataclass(frozen=True)
class HostDelta:
    """Counter increments between two reads. Counters that went backwards (a namespace was
    recreated, or a 32-bit counter wrapped) count as 0 rather than a huge negative."""

    counters: Counters = field(default_factory=dict)

    def get(self, section: str, name: str) -> int:
        return self.counters.get(section, {}).get(name, 0)

    @property
    def out_segs(self) -> int:
        return self.get("Tcp", "OutSegs")

    @property
    def retrans_segs(self) -> int:
        return self.get("Tcp", "RetransSegs")

    @property
    def retrans_ratio(self) -> float | None:
        """RetransSegs / OutSegs, or None when nothing was sent."""
        out = self.out_segs
        return self.retrans_segs / out if out > 0 else None

    @property
    def lost_retransmit(self) -> int:
        return self.get("TcpExt", "TCPLostRetransmit")

    @property
    def timeouts(self) -> int:
        return self.get("TcpExt", "TCPTimeouts")

    @property
    def sack_recovery(self) -> int:
        return self.get("TcpExt", "TCPSackRecovery")


@dataclass(frozen=True)
class HostCounters:
    """One read of the kernel's TCP MIB counters (snmp and netstat merged by section)."""

    counters: Counters

    @classmethod
    def read(cls, root: str = "/proc") -> HostCounters:
        net = os.path.join(root, "net")
        parts = (parse_counters(_read(os.path.join(net, name))) for name in ("snmp", "netstat"))
        return cls(_merge(parts))

    def get(self, section: str, name: str) -> int | None:
        return self.counters.get(section, {}).get(name)

    def delta(self, prev: HostCounters) -> HostDelta:
        """``self - prev`` for every counter present in both reads."""
        out: Counters = {}
        for section, now in self.counters.items():
            before: Mapping[str, int] = prev.counters.get(section, {})
            out[section] = {k: max(0, v - before[k]) for k, v in now.items() if k in before}
        return HostDelta(out)
