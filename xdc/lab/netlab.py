"""A two-namespace network lab on the real kernel: rate limits and loss without netem.

``NetLab`` creates namespaces ``xdc-a-<pid>-<n>`` and ``xdc-b-<pid>-<n>`` joined by one veth
pair, addressed from 10.231.0.0/16 (a /30 per lab). Nothing is added to the host namespace:
the veth ends are created directly inside the lab namespaces and neither namespace has a
default route, so lab traffic cannot leave the pair. Deleting the namespaces deletes the veth
and the namespaces' iptables rules with them; teardown first kills every process still inside
(``ip netns pids``), because a live process would keep a deleted namespace alive.

Shaping, measured on this kernel (6.18, 2 vCPUs, iperf3 over the veth):
- rate: ``tbf`` on the sender's veth egress. With GSO left on, 0.1/1/5 Gbit/s measure
  96/96/95% of the set rate with 0 retransmits, *provided* the burst holds a whole 64 KiB GSO
  packet: with a 32 KiB burst tbf segments every packet and 1 Gbit/s saw 282 retransmits in
  2 s. Turning GSO off (``gso_max_segs 1``) cut unshaped throughput to ~0.5 Gbit/s with
  spurious drops on 2 cores, so offloads stay on and the burst is sized instead.
- loss: ``iptables -m statistic --mode random`` DROP on the data direction (netem is not
  built into this kernel), by default in the *receiving* namespace's INPUT chain. A DROP in
  the sender's OUTPUT chain is reported back to the sending TCP as a local transmit error and
  the segment is simply re-queued: with tbf at 1 Gbit/s, 45 OUTPUT drops gave 0
  retransmits, while 37 INPUT drops gave 1659 retransmitted segments (iperf3, 2 s). With
  GSO a dropped "packet" is a super-packet of up to ~44 segments, so loss comes in bursts:
  1% of packets is ~1% of bytes, in fewer, larger holes.
- the sender's qdisc is local, so TCP small queues keep the tbf backlog short (~1 ms of
  data per socket); there is no propagation delay (min RTT ~10 us). ``BottleneckLab`` puts
  the bottleneck one hop away (a forwarding middle namespace), where a standing queue does
  form: 8 cubic flows fill a 100 ms buffer to ~90 ms.

Python in a namespace runs as a child: ``lab.popen("a", [sys.executable, "-m", ...])``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any, Literal, Self

from xdc.errors import ConfigurationError

_NAME_RE = re.compile(r"^(?P<prefix>[a-z]+)-(?P<side>[abmp])-(?P<pid>\d+)-(?P<n>\d+)$")
_counter = itertools.count()
_open_labs: set[NetLab] = set()  # strong refs: a forgotten lab is still closed at exit
_unavailable: list[str | None] = []

TOOLS = ("ip", "tc", "iptables")


class NetLabError(ConfigurationError, RuntimeError):
    """A lab command failed; the message carries the command and its stderr."""


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    try:
        res = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise NetLabError(f"{' '.join(argv)}: {e}") from e
        return ""
    if check and res.returncode != 0:
        raise NetLabError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
    return res.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Names from ``ip netns list`` (the "(id: N)" suffix stripped)."""
    out = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str) -> None:
    for tok in _sh(["ip", "netns", "pids", ns], check=False).split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_pids(ns)
    _sh(["ip", "netns", "del", ns], check=False)


def cleanup_stale(prefix: str = "xdc") -> list[str]:
    """Delete lab namespaces left by a crashed run: our naming scheme, creator pid dead.

    A namespace whose creator is alive belongs to a running lab and is never touched.
    """
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if m is None or m["prefix"] != prefix or _pid_alive(int(m["pid"])):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


def unavailable_reason() -> str | None:
    """Why a lab cannot run here (not root, a tool missing, netns refused), or None.

    The verdict includes a real probe (add and delete a namespace), so containers without
    CAP_SYS_ADMIN are detected up front instead of failing in the middle of a test. Cached.
    """
    if _unavailable:
        return _unavailable[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "needs root (network namespaces, tc, iptables)"
    else:
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            reason = f"missing tools: {', '.join(missing)} (apt-get install iproute2 iptables)"
        else:
            probe = f"xdc-p-{os.getpid()}-{next(_counter)}"
            try:
                _sh(["ip", "netns", "add", probe])
            except NetLabError as e:
                reason = f"cannot create a network namespace: {e}"
            else:
                _delete_namespace(probe)
    _unavailable.append(reason)
    return reason


Side = Literal["a", "b"]


def ns_http(ns: str, url: str, body: str | None = None, timeout: float = 5.0) -> str | None:
    """GET ``url`` (POST ``body`` as JSON when given) from inside namespace ``ns``, where the
    calling process cannot reach; the answer's text, or None when it did not answer 2xx."""
    code = (
        "import sys,urllib.request as u\n"
        "d=sys.argv[3].encode() if len(sys.argv)>3 else None\n"
        "r=u.Request(sys.argv[1],data=d,headers={'Content-Type':'application/json'})\n"
        "try:\n"
        "  print(u.urlopen(r,timeout=float(sys.argv[2])).read().decode())\n"
        "except Exception:\n"
        "  sys.exit(1)\n"
    )
    argv = ["ip", "netns", "exec", ns, sys.executable, "-c", code, url, str(timeout)]
    if body is not None:
        argv.append(body)
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        return None
    return res.stdout if res.returncode == 0 else None


class NetLab:
    """Two namespaces (``a`` sends, ``b`` receives by convention) joined by one veth pair."""

    dev_a = "xdc-veth-a"
    dev_b = "xdc-veth-b"

    def __init__(self, prefix: str = "xdc") -> None:
        if not re.fullmatch(r"[a-z]+", prefix):
            raise ValueError(f"prefix must be lowercase letters, got {prefix!r}")
        n = next(_counter)
        pid = os.getpid()
        self.prefix = prefix
        self.ns_a = f"{prefix}-a-{pid}-{n}"
        self.ns_b = f"{prefix}-b-{pid}-{n}"
        subnet = n % 256
        self.addr_a = f"10.231.{subnet}.1"
        self.addr_b = f"10.231.{subnet}.2"
        self._procs: list[subprocess.Popen[Any]] = []
        self._loss_rule: tuple[str, list[str]] | None = None
        self._up = False

    # ---- lifecycle -------------------------------------------------------------------

    def up(self) -> Self:
        """Create namespaces, veth pair and addresses; on any failure undo what was done."""
        _open_labs.add(self)
        self._up = True
        try:
            existing = set(list_namespaces())
            for ns in (self.ns_a, self.ns_b):
                if ns in existing:
                    # Our pid and counter are in the name, so this is a leftover of a dead
                    # process that had our pid (cleanup_stale skips it: the pid is alive).
                    _delete_namespace(ns)
            _sh(["ip", "netns", "add", self.ns_a])
            _sh(["ip", "netns", "add", self.ns_b])
            _sh(
                [
                    *("ip", "link", "add", self.dev_a, "netns", self.ns_a, "type", "veth"),
                    *("peer", "name", self.dev_b, "netns", self.ns_b),
                ]
            )
            for ns, dev, addr in (
                (self.ns_a, self.dev_a, self.addr_a),
                (self.ns_b, self.dev_b, self.addr_b),
            ):
                _sh(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
                _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
                _sh(["ip", "-n", ns, "link", "set", dev, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill lab processes, delete both namespaces. Idempotent; never raises."""
        if not self._up:
            return
        self._up = False
        for proc in self._procs:
            self._stop(proc)
        self._procs.clear()
        for ns in (self.ns_a, self.ns_b):
            _delete_namespace(ns)
        _open_labs.discard(self)

    @staticmethod
    def _stop(proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    cleanup_stale = staticmethod(cleanup_stale)

    # ---- running things inside -------------------------------------------------------

    def ns(self, side: Side | str) -> str:
        """Namespace name for ``"a"``/``"b"`` (a full lab namespace name passes through)."""
        if side == "a":
            return self.ns_a
        if side == "b":
            return self.ns_b
        if side in (self.ns_a, self.ns_b):
            return side
        raise ValueError(f"not a namespace of this lab: {side!r}")

    def exec_argv(self, side: Side | str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(side), *argv]

    def run(
        self, side: Side | str, argv: Sequence[str], **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run`` inside a namespace; text mode and captured output by default."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60.0)
        res: subprocess.CompletedProcess[str] = subprocess.run(self.exec_argv(side, argv), **kw)
        return res

    def popen(self, side: Side | str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start a process inside a namespace; ``close()`` kills it (and its process group)."""
        if not self._up:
            raise NetLabError("lab is not up")
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(self.exec_argv(side, argv), **kw)
        self._procs.append(proc)
        return proc

    def http(
        self, side: Side | str, url: str, body: str | None = None, timeout: float = 5.0
    ) -> str | None:
        """``ns_http`` inside this lab's namespace ``side``."""
        return ns_http(self.ns(side), url, body, timeout)

    # ---- shaping -----------------------------------------------------------------------

    def set_rate(
        self,
        gbit: float | None,
        burst: int | None = None,
        latency: float = 0.010,
        *,
        side: Side = "a",
    ) -> None:
        """Token-bucket limit on ``side``'s veth egress (``None`` removes it).

        ``burst`` is in bytes; the default is the larger of 256 KiB and 2 ms at the rate: it
        must hold a full 64 KiB GSO packet (see module docstring) and absorb timer slack at
        10 Gbit/s. ``latency`` (seconds) bounds the tbf queue: rate x latency + burst bytes.
        """
        ns, dev = (self.ns_a, self.dev_a) if side == "a" else (self.ns_b, self.dev_b)
        if gbit is None:
            _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            return
        if gbit <= 0 or latency <= 0:
            raise ValueError(f"rate and latency must be > 0, got {gbit} Gbit/s, {latency} s")
        rate_bits = int(gbit * 1e9)
        size = burst if burst is not None else max(256 * 1024, rate_bits // 8 // 500)
        lat_us = max(1, round(latency * 1e6))
        _sh(
            [
                *("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf"),
                *("rate", f"{rate_bits}bit", "burst", str(size), "latency", f"{lat_us}us"),
            ]
        )

    def set_wire_sized_packets(self, on: bool = True) -> None:
        """Make a's sender hand the veth one MSS per packet (``gso_max_segs 1``), or undo it.

        The loss rule counts the packets iptables sees, and with GSO those are super-packets of
        up to 64 KiB: a 5 MB transfer is only ~400 of them, so 1% loss drops none about 2% of
        the time (a CI run saw exactly that). With one segment per packet the same transfer is
        ~3,300 wire-sized packets and the rule's probability is the per-packet loss of a real
        link. It costs CPU (see module docstring: ~0.5 Gbit/s unshaped on 2 cores), so it is
        for small transfers over a lossy link, not for throughput runs.
        """
        segs = "1" if on else "65535"
        _sh(["ip", "-n", self.ns_a, "link", "set", "dev", self.dev_a, "gso_max_segs", segs])

    def set_loss(self, prob: float | None, *, chain: Literal["INPUT", "OUTPUT"] = "INPUT") -> None:
        """Randomly drop ``prob`` of the a->b packets (``None`` or 0 removes the rule).

        ``INPUT`` drops in namespace b as packets arrive, which TCP sees as path loss.
        ``OUTPUT`` drops in namespace a as they leave, which TCP sees as a local error and
        re-queues without a retransmit (see module docstring). Only packets from addr_a to
        addr_b on the lab veth are matched.
        """
        if self._loss_rule is not None:
            ns, spec = self._loss_rule
            self._iptables(ns, ["-D", *spec])
            self._loss_rule = None
        if prob is None or prob == 0:
            return
        if not 0 < prob <= 1:
            raise ValueError(f"loss probability must be in (0, 1], got {prob}")
        if chain == "OUTPUT":
            ns, iface = self.ns_a, ["-o", self.dev_a]
        else:
            ns, iface = self.ns_b, ["-i", self.dev_b]
        spec = [chain, *iface, "-s", self.addr_a, "-d", self.addr_b]
        spec += ["-m", "statistic", "--mode", "random", "--probability", f"{prob:.6f}"]
        spec += ["-j", "DROP"]
        self._iptables(ns, ["-I", *spec])
        self._loss_rule = (ns, spec)

    def _iptables(self, ns: str, args: list[str]) -> str:
        return _sh(["ip", "netns", "exec", ns, "iptables", "-w", "5", *args])

    def describe(self) -> str:
        """qdiscs and filter rules of both namespaces, for failure messages."""
        parts = []
        for ns in (self.ns_a, self.ns_b):
            parts.append(f"== {ns}")
            parts.append(_sh(["tc", "-n", ns, "qdisc", "show"], check=False))
            parts.append(_sh(["ip", "netns", "exec", ns, "iptables", "-S"], check=False))
        return "\n".join(parts)


class BottleneckLab(NetLab):
    """Three namespaces: ``a`` -> ``m`` (forwards) -> ``b``, with the bottleneck on m's
    egress towards b.

    ``NetLab`` shapes the sender's own veth, where TCP Small Queues keep the tbf backlog at
    ~1 ms per socket: no standing queue ever forms, and no other flow suffers. Here the
    queue sits one hop away, as on a real path: senders in ``a`` see it only through RTT,
    loss and ECN marks, and every flow from ``a`` to ``b`` (bulk or a latency probe) shares
    it. ``addr_a`` / ``addr_b`` and the ``"a"`` / ``"b"`` sides mean what they mean in
    ``NetLab`` (so the transfer benches and ``set_loss`` work unchanged); the two hops use
    different /30s and m has ``ip_forward`` on. Reverse traffic (ACKs) is not shaped.
    """

    dev_ma = "xdc-veth-ma"
    dev_mb = "xdc-veth-mb"

    def __init__(self, prefix: str = "xdc") -> None:
        super().__init__(prefix)
        n = self.ns_a.rsplit("-", 1)[1]
        self.ns_m = f"{prefix}-m-{os.getpid()}-{n}"
        subnet = int(n) % 256
        self.addr_a = f"10.232.{subnet}.1"
        self.addr_ma = f"10.232.{subnet}.2"
        self.addr_mb = f"10.233.{subnet}.1"
        self.addr_b = f"10.233.{subnet}.2"
        self._ce_rules: list[list[str]] = []

    def up(self) -> Self:
        _open_labs.add(self)
        self._up = True
        try:
            existing = set(list_namespaces())
            for ns in (self.ns_a, self.ns_m, self.ns_b):
                if ns in existing:
                    _delete_namespace(ns)
                _sh(["ip", "netns", "add", ns])
            for ns_x, dev_x, ns_y, dev_y in (
                (self.ns_a, self.dev_a, self.ns_m, self.dev_ma),
                (self.ns_m, self.dev_mb, self.ns_b, self.dev_b),
            ):
                _sh(
                    [
                        *("ip", "link", "add", dev_x, "netns", ns_x, "type", "veth"),
                        *("peer", "name", dev_y, "netns", ns_y),
                    ]
                )
            for ns, dev, addr in (
                (self.ns_a, self.dev_a, self.addr_a),
                (self.ns_m, self.dev_ma, self.addr_ma),
                (self.ns_m, self.dev_mb, self.addr_mb),
                (self.ns_b, self.dev_b, self.addr_b),
            ):
                _sh(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
                _sh(["ip", "-n", ns, "link", "set", dev, "up"])
            for ns in (self.ns_a, self.ns_m, self.ns_b):
                _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", self.ns_a, "route", "add", f"{self.addr_b}/32", "via", self.addr_ma])
            _sh(["ip", "-n", self.ns_b, "route", "add", f"{self.addr_a}/32", "via", self.addr_mb])
            _sh(["ip", "netns", "exec", self.ns_m, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._up:
            _delete_namespace(self.ns_m)
        super().close()

    def ns(self, side: Side | str) -> str:
        if side in ("m", self.ns_m):
            return self.ns_m
        return super().ns(side)

    def set_bottleneck(
        self, gbit: float | None, queue_ms: float = 100.0, *, burst: int | None = None
    ) -> None:
        """A ``gbit`` token bucket on m -> b holding up to ``queue_ms`` of data (a deep
        buffer: a loss-based sender fills it and every flow waits behind it); ``None``
        removes it.

        No AQM: this kernel has none of red, codel, fq_codel, pie, fq or sfq ("Specified
        qdisc kind is unknown"), so marking comes from ``set_ce_marking`` instead.
        """
        ns, dev = self.ns_m, self.dev_mb
        _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if gbit is None:
            return
        if gbit <= 0 or queue_ms <= 0:
            raise ValueError(f"rate and queue must be > 0, got {gbit} Gbit/s, {queue_ms} ms")
        rate_bits = int(gbit * 1e9)
        size = burst if burst is not None else max(256 * 1024, rate_bits // 8 // 500)
        limit = int(rate_bits / 8 * queue_ms / 1000) + size
        _sh(
            [
                *("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf"),
                *("rate", f"{rate_bits}bit", "burst", str(size), "limit", str(limit)),
            ]
        )

    def enable_ecn(self) -> None:
        """Let a's TCP ask for ECN (``net.ipv4.tcp_ecn=1``; b accepts it by default) on the
        connections it opens from now on: ECN is negotiated in the handshake."""
        _sh(["ip", "netns", "exec", self.ns_a, "sysctl", "-qw", "net.ipv4.tcp_ecn=1"])

    def set_ce_marking(self, prob: float | None) -> None:
        """Mark ``prob`` of the ECN-capable a -> b packets Congestion Experienced as m
        forwards them (``None`` or 0 removes it). Only connections opened after
        ``enable_ecn`` carry ECN.

        Random marks, not an AQM's queue-driven ones (see ``set_bottleneck``): what they
        show is the signal path, from a CE bit set on the wire to the sender's
        ``tcpi_delivered_ce``. An iptables TOS rewrite of the two ECN bits on ECT(0) and
        ECT(1) packets; with GSO a marked "packet" is a whole super-packet, so the marked
        share of segments comes out several times ``prob``.
        """
        rules = [
            [
                *("FORWARD", "-s", self.addr_a, "-d", self.addr_b),
                *("-m", "ecn", "--ecn-ip-ect", ect, "-m", "statistic", "--mode", "random"),
                *("--probability", f"{prob or 0:.6f}", "-j", "TOS", "--set-tos", "0x03/0x03"),
            ]
            for ect in ("1", "2")
        ]
        for spec in self._ce_rules:
            self._iptables(self.ns_m, ["-t", "mangle", "-D", *spec])
        self._ce_rules = []
        if prob is None or prob == 0:
            return
        if not 0 < prob <= 1:
            raise ValueError(f"marking probability must be in (0, 1], got {prob}")
        for spec in rules:
            self._iptables(self.ns_m, ["-t", "mangle", "-I", *spec])
            self._ce_rules.append(spec)

    def backlog_bytes(self) -> int:
        """Bytes queued at the bottleneck now (tc's backlog of m's root qdisc)."""
        out = _sh(["tc", "-s", "-n", self.ns_m, "qdisc", "show", "dev", self.dev_mb], check=False)
        m = re.search(r"backlog (\d+)b", out)
        return int(m.group(1)) if m else 0

    def describe(self) -> str:
        parts = [super().describe(), f"== {self.ns_m}"]
        parts.append(_sh(["tc", "-s", "-n", self.ns_m, "qdisc", "show"], check=False))
        return "\n".join(parts)


@atexit.register
def _close_open_labs() -> None:
    for lab in list(_open_labs):
        lab.close()


def shaped_links(rates: Sequence[float]) -> Generator[tuple[float, NetLab], None, None]:
    """One lab, shaped to each rate (Gbit/s) in turn, for the benchmarks that compare tools
    link by link. Nothing (and one line on stderr saying why) when a lab cannot run here; the
    lab is torn down when the loop ends, however it ends."""
    if not rates:
        return
    why = unavailable_reason()
    if why:
        print(f"shaped links skipped: {why}", file=sys.stderr)
        return
    with NetLab() as lab:
        for rate in rates:
            lab.set_rate(rate)
            yield rate, lab
