"""Congestion is a queue, not loss: the real daemons and a real router across the
three-namespace bottleneck lab (sender in a, a forwarding middle namespace whose egress is
the bottleneck, receiver in b).

- 1% random loss on a short queue: the monitor reports the loss (cause random_loss) but the
  link stays ok, and the router's offload threshold does not move;
- a standing queue built by someone else's bulk flows (iperf3, reno) in a deep buffer:
  congested (cause queue) within 1 s of the queue forming (tc's backlog in the middle
  namespace passing 1 MiB), the router's threshold rises within 1 s, and the link is ok
  again within 5 s of the bulk traffic ending;
- ECN: CE marks set on the way (the middle namespace rewrites the ECN bits; this kernel has
  no AQM qdisc) reach the sender's tcp_info and make the link congested, cause ecn, within 1 s;
- the sender's response keeps the queue it builds itself short: a latency probe sharing a
  deep buffer with a full-speed xdc transfer waits < 20 ms with the response on, and the
  whole buffer (> 50 ms) with it off.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from xdc.transport.launcher import DaemonProcess, free_port, local_pair_config

from xdc.lab.netlab import BottleneckLab
from xdc.lab.transfer_load import Streamer

if TYPE_CHECKING:
    from tests.netlab_fixtures import Blaster

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.serial]
MIB = 1 << 20
PROBE = [sys.executable, "-m", "xdc.lab.latency_probe"]
ROUTER = [sys.executable, "-m", "xdc", "router", "--host", "127.0.0.1"]
TOKEN = ("--set", "router.daemon_token=dm")


@dataclass
class Rig:
    lab: BottleneckLab
    tx_sock: str
    rx_sock: str
    router_port: int
    procs: list[DaemonProcess] = field(default_factory=list)

    def router_state(self) -> dict[str, Any] | None:
        text = self.lab.http("a", f"http://127.0.0.1:{self.router_port}/v1/state", timeout=3)
        return json.loads(text) if text else None


@pytest.fixture
def rig_factory(bottleneck_lab: BottleneckLab) -> Iterator[Callable[..., Rig]]:
    """Receiver in b, sender in a publishing link state to a real router (also in a)."""
    wd = Path(tempfile.mkdtemp(prefix="xdc-cong-"))
    made: list[Rig] = []

    def make(congestion_control: bool = True, tcp: str = "") -> Rig:
        lab = bottleneck_lab
        port = free_port()
        router = lab.popen(
            "a",
            [*ROUTER, "--port", str(port), *("--set", "router.gateway_token=gw"), *TOKEN],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert router.stdout is not None
        assert router.stdout.readline().startswith("xdc router listening")
        tx, rx, _ = local_pair_config(wd, connections=4, send_pool=128 * MIB, recv_pool=256 * MIB)
        rx.receiver.listen_host = lab.addr_b
        tx.sender.peer_host = lab.addr_b
        tx.sender.congestion_control = congestion_control
        tx.sender.tcp_congestion = tcp
        tx.monitor.sample_hz = 10
        tx.monitor.link_capacity_bps = 1e9
        tx.monitor.router_url = f"http://127.0.0.1:{port}"
        tx.monitor.router_token = "dm"
        r = Rig(lab, tx.sender.control_socket, rx.receiver.control_socket, port)
        made.append(r)
        d = DaemonProcess("receiver", rx, wd, netns=lab.ns_b)
        r.procs.append(d)
        d.wait_ready()
        d = DaemonProcess("sender", tx, wd, netns=lab.ns_a)
        r.procs.append(d)
        d.wait_ready()
        return r

    try:
        yield make
    finally:
        for r in made:
            for p in r.procs:
                p.stop()
            for p in r.procs:
                if p.proc.returncode not in (0, None):
                    print(p.log())
        shutil.rmtree(wd, ignore_errors=True)


class RouterWatch:
    """Polls the router's /v1/state from inside namespace a: (time, effective t, link)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.seen: list[tuple[float, float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            st = self.rig.router_state()
            if st is not None:
                t = float(st["threshold"]["effective_t"])
                self.seen.append((time.time(), t, st["links"].get("prfaas->pd") or {}))

    def stop(self) -> list[tuple[float, float, dict[str, Any]]]:
        self._stop.set()
        self._t.join(10)
        return self.seen


class BacklogWatch:
    """When the bottleneck queue really began: polls tc's backlog in namespace m (the
    monitor's own view must not be the reference it is judged against)."""

    def __init__(self, lab: BottleneckLab, threshold_bytes: int = 1 << 20) -> None:
        self.lab, self.threshold = lab, threshold_bytes
        self.onset: float | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while self.onset is None and not self._stop.wait(0.02):
            if self.lab.backlog_bytes() >= self.threshold:
                self.onset = time.time()

    def stop(self) -> float | None:
        self._stop.set()
        self._t.join(5)
        return self.onset


def _first(
    states: list[tuple[float, str, dict[str, Any]]], since: float, pred: Any
) -> float | None:
    return next((t for t, st, link in states if t >= since and pred(st, link)), None)


def test_random_loss_is_reported_but_is_not_congestion_and_leaves_t_alone(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory()
    rig.lab.set_bottleneck(1.0, queue_ms=10)
    watch = RouterWatch(rig)
    with Streamer(rig.tx_sock, rig.rx_sock, [MIB] * 4, rate_bps=300e6) as s:
        time.sleep(2.0)
        t_loss = time.time()
        rig.lab.set_loss(0.01)
        time.sleep(4.0)
        stats = s.stop()
    seen = watch.stop()
    assert stats.delivered >= 20 and not stats.failed and not stats.corrupt, stats.failed
    during = [(t, st, link) for t, st, link in stats.states if t >= t_loss]
    assert {st for _t, st, _l in during} == {"ok"}, rig.lab.describe()
    flagged = _first(stats.states, t_loss, lambda _s, link: link.get("cause") == "random_loss")
    assert flagged is not None and flagged - t_loss <= 1.2, "loss not reported as random_loss"
    assert max(link.get("retrans_ratio", 0) for _t, _s, link in during) > 0.002
    # the first report's capacity (1 Gbit/s) replans t once (the long-term loop); from then
    # on, through the loss, it must not move
    base = _t_before(seen, t_loss)
    after = [t for w, t, _l in seen if w >= t_loss]
    assert len(after) >= 10 and set(after) == {base}, f"t moved under random loss: {set(after)}"


def _t_before(seen: list[tuple[float, float, dict[str, Any]]], when: float) -> float:
    """The router's t just before ``when``, once it had a link report."""
    known = [t for w, t, link in seen if w < when and link.get("reporters")]
    assert known, "the router never had the sender's link report"
    return known[-1]


def test_a_queue_built_by_bulk_traffic_is_congestion_within_1s_raises_t_and_clears(
    rig_factory: Callable[..., Rig], iperf3: str
) -> None:
    rig = rig_factory()
    lab = rig.lab
    lab.set_bottleneck(1.0, queue_ms=100)
    port = free_port()
    srv = lab.popen("b", [iperf3, "-s", "-1", "-B", lab.addr_b, "-p", str(port)])
    watch = RouterWatch(rig)
    with Streamer(rig.tx_sock, rig.rx_sock, [MIB] * 4, rate_bps=200e6) as s:
        time.sleep(2.0)
        backlog = BacklogWatch(lab)  # 1 MiB queued = 8 ms at 1 Gbit/s: the queue began
        # 20 ms at 1 Gbit/s: the queue the monitor calls congestion on this short path
        # (rtt_inflation_congested 2.0 over the 10 ms floor); how soon the monitor says so
        # is ours. The bulk flows are reno: cubic's HyStart may leave slow start at the
        # first RTT rise, and from there 4 flows grow a queue by a segment per RTT each,
        # 8 -> 20 ms in seconds (CI saw 1.02 s once, and once no 20 ms queue in the 3 s at
        # all, 0.9 Gbit/s through the 1 Gbit/s bottleneck). Reno's slow start runs to loss
        deep = BacklogWatch(lab, 2_500_000)
        bulk = lab.run(
            "a",
            [iperf3, "-c", lab.addr_b, "-p", str(port), "-t", "3", "-P", "4", "-C", "reno"],
            timeout=20,
        )
        t_end = time.time()
        time.sleep(5.5)
        stats = s.stop()
    seen = watch.stop()
    onset, deep_onset = backlog.stop(), deep.stop()
    srv.wait(5)
    assert bulk.returncode == 0, bulk.stderr
    assert onset is not None, "the bulk flows never built a queue: " + lab.describe()
    assert deep_onset is not None, "the bulk flows never built a 20 ms queue: " + lab.describe()
    assert not stats.failed and not stats.corrupt, stats.failed
    before = [st for t, st, _l in stats.states if t < onset]
    assert set(before) == {"ok"}, before
    t_bulk = deep_onset
    congested = _first(
        stats.states, t_bulk, lambda st, link: st == "congested" and link["cause"] == "queue"
    )
    assert congested is not None and congested - t_bulk <= 1.0, (
        congested and congested - t_bulk,
        [(round(t - t_bulk, 2), st, link.get("queue_ms")) for t, st, link in stats.states[-80:]],
    )
    base = _t_before(seen, onset)
    raised = next((w for w, t, _l in seen if w >= t_bulk and t > base * 1.01), None)
    assert raised is not None and raised - t_bulk <= 1.0, (raised and raised - t_bulk, base)
    back = _first(stats.states, t_end, lambda st, _l: st == "ok")
    assert back is not None and back - t_end <= 5.0, f"ok again {back and back - t_end}s after"
    print(
        f"queue 8 -> 20 ms in {t_bulk - onset:.2f}s; congested {congested - t_bulk:.2f}s after "
        f"it reached 20 ms, t raised after {raised - t_bulk:.2f}s, ok {back - t_end:.2f}s "
        "after the bulk flows ended"
    )


def test_ce_marks_on_the_path_are_congestion_within_1s(
    bottleneck_lab: BottleneckLab, blaster: Blaster
) -> None:
    lab = bottleneck_lab
    lab.set_bottleneck(1.0, queue_ms=10)
    lab.enable_ecn()
    snaps: list[dict[str, Any]] = []
    t_mark = None
    with blaster(lab, seconds=4.0, port=5601) as out:
        t0 = time.time()
        for line in out:
            snaps.append(json.loads(line)["link"])
            if t_mark is None and time.time() - t0 > 1.5:
                lab.set_ce_marking(0.01)
                t_mark = time.time()
    assert t_mark is not None
    before = [s for s in snaps if s["updated_at"] < t_mark]
    assert before and {s["state"] for s in before} == {"ok"}
    assert all(not s["ce_ratio"] for s in before), [s["ce_ratio"] for s in before]
    hit = next((s for s in snaps if s["state"] == "congested" and s["cause"] == "ecn"), None)
    assert hit is not None, [(s["state"], s["cause"], s["ce_ratio"]) for s in snaps]
    assert hit["updated_at"] - t_mark <= 1.0 and hit["ce_ratio"] > 0.01, hit


def _probe_under_xdc(rig: Rig, seconds: float = 5.0) -> tuple[float, float]:
    """Median probe RTT (ms) over the middle of a full-speed transfer, and its goodput."""
    lab = rig.lab
    probe = lab.popen(
        "a",
        [*PROBE, "probe", "--host", lab.addr_b, "--port", "5301", "--seconds", str(seconds + 2)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.2)
    with Streamer(rig.tx_sock, rig.rx_sock, [4 * MIB] * 8, fill=False) as s:
        time.sleep(1.0)  # slow start and the first queue
        t0 = time.time()
        time.sleep(seconds - 1.0)
        t1 = time.time()
        stats = s.stop()
    out, _ = probe.communicate(timeout=30)
    rtts = [
        j["rtt_ms"]
        for j in (json.loads(line) for line in out.splitlines() if '"rtt_ms"' in line)
        if t0 <= j["t"] <= t1
    ]
    assert len(rtts) >= 20 and not stats.failed, (len(rtts), stats.failed)
    goodput = statistics.median(
        link["goodput_bps"] for t, _s, link in stats.states if t0 <= t <= t1 and link
    )
    return statistics.median(rtts), goodput


@pytest.mark.parametrize("response", ["on", "off"])
def test_the_response_keeps_the_queue_it_builds_short(
    rig_factory: Callable[..., Rig], response: str
) -> None:
    rig = rig_factory(congestion_control=response == "on", tcp="cubic")
    lab = rig.lab
    lab.set_bottleneck(1.0, queue_ms=100)
    serve = lab.popen(
        "b",
        [*PROBE, "serve", "--host", lab.addr_b, "--port", "5301"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert serve.stdout is not None and json.loads(serve.stdout.readline())["ready"]
    rtt, goodput = _probe_under_xdc(rig)
    print(f"response {response}: probe RTT median {rtt:.1f} ms, xdc {goodput / 1e9:.3f} Gbit/s")
    sender = next(p for p in rig.procs if p.kind == "sender")
    print("\n".join([line for line in sender.log().splitlines() if "pacing" in line][:40]))
    if response == "on":
        assert rtt < 20.0 and goodput >= 0.85e9, (rtt, goodput)
    else:
        assert rtt > 50.0, (rtt, goodput)  # cubic fills the deep buffer: the lab is real
