"""The congestion response side by side with iperf3, in the three-namespace bottleneck lab
(sender namespace -> forwarding namespace whose egress is the bottleneck -> receiver
namespace; xdc.lab.netlab.BottleneckLab). Root only.

Scenarios (each repeat runs every sender back to back on the same lab):

- ``random-loss``: 1 Gbit/s bottleneck with a short (10 ms) queue and 1% random drops. Loss
  that is not congestion: the response must cost nothing.
- ``deep-buffer``: 1 Gbit/s bottleneck with a 100 ms buffer, shared with a latency probe
  (64-byte request/response every 20 ms, xdc.lab.latency_probe). Loss-based TCP fills
  the buffer and the probe waits behind it; the response should keep it short while xdc
  keeps its share (the whole link: the probe's traffic is negligible).
- ``bulk-competition``: the deep buffer shared with 4 iperf3 flows at once (someone else's
  bulk transfer). The queue is not ours: xdc must keep a fair share rather than starve.

    python bench/congestion.py --repeats 3 --json-out bench/results/congestion_netns_2core.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from xdc.lab import bench_transfer as bt
from xdc.lab.netlab import BottleneckLab, unavailable_reason

PROBE = [sys.executable, "-m", "xdc.lab.latency_probe"]
PROBE_PORT = 5301

SCENARIOS: dict[str, dict[str, Any]] = {
    "random-loss": {"queue_ms": 10.0, "loss": 0.01, "bulk": False},
    "deep-buffer": {"queue_ms": 100.0, "loss": 0.0, "bulk": False},
    "bulk-competition": {"queue_ms": 100.0, "loss": 0.0, "bulk": True},
}
SENDERS = ("iperf3", "xdc response off", "xdc response on")


def _retrans(ns: str) -> tuple[int, int]:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "nstat", "-az"], capture_output=True, text=True
    ).stdout
    vals = {
        p[0]: int(p[1])
        for p in (ln.split() for ln in out.splitlines())
        if len(p) >= 2 and p[1].isdigit()
    }
    return vals.get("TcpRetransSegs", 0), vals.get("TcpOutSegs", 0)


class Probe:
    """The latency probe running in namespace a for the length of one measurement."""

    def __init__(self, lab: BottleneckLab, seconds: float) -> None:
        self.proc = lab.popen(
            "a",
            [
                *(*PROBE, "probe", "--host", lab.addr_b, "--port", str(PROBE_PORT)),
                *("--seconds", str(seconds), "--timeout", "10"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

    def rtts(self, t0: float, t1: float) -> list[float]:
        """RTTs (ms) of the probes sent between wall times t0 and t1."""
        out, _ = self.proc.communicate(timeout=120)
        rows = [json.loads(line) for line in out.splitlines() if '"rtt_ms"' in line]
        return sorted(r["rtt_ms"] for r in rows if t0 <= r["t"] <= t1)


def _p(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def _measure(
    lab: BottleneckLab, name: str, args: argparse.Namespace, base: argparse.Namespace, bulk: bool
) -> dict[str, Any]:
    """One sender for ``args.seconds``, with the probe alongside (and the bulk flows)."""
    probe = Probe(lab, args.seconds + 40)
    bulk_gbps: list[float] = []
    bulk_t = None
    if bulk:
        bulk_t = threading.Thread(
            target=lambda: bulk_gbps.append(
                bt.run_iperf3(lab.addr_b, 4, args.seconds + 2, lab.ns_b, lab.ns_a, "cubic").gbps
            ),
            daemon=True,
        )
        bulk_t.start()
        time.sleep(1.0)
    r0 = _retrans(lab.ns_a)
    if name == "iperf3":
        t_start = time.time()
        gbps = bt.run_iperf3(lab.addr_b, 8, args.seconds, lab.ns_b, lab.ns_a, args.tcp).gbps
        t_end = time.time()
        window = (t_start + 1.0, t_end - 0.3)
    else:
        base.congestion_control = "on" if name.endswith("on") else "off"
        base.tcp_congestion = args.tcp
        gbps = bt.run_xdc(base, lab.ns_a, lab.ns_b, lab.addr_b).gbps
        t_end = time.time()
        window = (t_end - args.seconds, t_end - 1.0)
    r1 = _retrans(lab.ns_a)
    if bulk_t is not None:
        bulk_t.join(args.seconds + 60)
    probe.proc.terminate()
    rtts = probe.rtts(*window)
    return {
        "gbps": gbps,
        "retrans_pct": 100 * (r1[0] - r0[0]) / max(1, r1[1] - r0[1]),
        "probe_ms_median": statistics.median(rtts) if rtts else None,
        "probe_ms_p90": _p(rtts, 0.9),
        "probes": len(rtts),
        "bulk_gbps": bulk_gbps[0] if bulk_gbps else None,
    }


def _idle_probe(lab: BottleneckLab) -> float:
    probe = Probe(lab, 2.0)
    t0 = time.time()
    probe.proc.wait(30)
    rtts = probe.rtts(t0, t0 + 10)
    return statistics.median(rtts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1.0, help="bottleneck rate, Gbit/s")
    ap.add_argument("--loss", type=float, default=0.01, help="random drops in random-loss")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=", ".join(SCENARIOS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--tcp", default="cubic", help="TCP congestion control for all senders")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    unknown = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.repeats < 1 or args.seconds < 3:
        ap.error("--repeats >= 1 and --seconds >= 3")
    why = unavailable_reason()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser()
    bt.configure(parser)
    base = parser.parse_args(["--seconds", str(args.seconds), "--connections", "8"])
    report: dict[str, Any] = {
        "rate_gbps": args.rate,
        "connections": 8,
        "repeats": args.repeats,
        "tcp": args.tcp,
    }
    for scen in args.scenarios.split(","):
        spec = SCENARIOS[scen]
        loss = args.loss if spec["loss"] else 0.0
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in SENDERS}
        with BottleneckLab() as lab:
            lab.set_bottleneck(args.rate, queue_ms=spec["queue_ms"])
            lab.set_loss(loss or None)
            serve = lab.popen(
                "b",
                [*PROBE, "serve", "--host", lab.addr_b, "--port", str(PROBE_PORT)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert serve.stdout is not None and json.loads(serve.stdout.readline())["ready"]
            idle = _idle_probe(lab)
            for rep in range(args.repeats):
                for name in SENDERS:
                    row = _measure(lab, name, args, base, bool(spec["bulk"]))
                    rows[name].append(row)
                    print(
                        f"{scen} repeat {rep + 1} {name:<17} {row['gbps']:6.3f} Gbit/s, "
                        f"{row['retrans_pct']:.2f}% retransmitted, probe median "
                        f"{row['probe_ms_median']} ms"
                        + (f", bulk {row['bulk_gbps']:.3f} Gbit/s" if spec["bulk"] else ""),
                        file=sys.stderr,
                    )
        ip = statistics.median(r["gbps"] for r in rows["iperf3"])
        out: dict[str, Any] = {
            "loss": loss,
            "queue_ms": spec["queue_ms"],
            "idle_probe_ms": idle,
            "runs": rows,
        }
        for name, runs in rows.items():
            g = statistics.median(r["gbps"] for r in runs)
            meds = [r["probe_ms_median"] for r in runs if r["probe_ms_median"] is not None]
            p90s = [r["probe_ms_p90"] for r in runs if r["probe_ms_p90"] is not None]
            bulks = [r["bulk_gbps"] for r in runs if r["bulk_gbps"] is not None]
            out[name] = {
                "gbps_median": g,
                "ratio_vs_iperf3": g / ip if ip else None,
                "ratio_vs_iperf3_per_repeat": [
                    x["gbps"] / i["gbps"] for x, i in zip(runs, rows["iperf3"], strict=True)
                ],
                "retrans_pct_median": statistics.median(r["retrans_pct"] for r in runs),
                "probe_added_ms_median": statistics.median(meds) - idle if meds else None,
                "probe_added_ms_p90": statistics.median(p90s) - idle if p90s else None,
                "bulk_gbps_median": statistics.median(bulks) if bulks else None,
            }
        report[scen] = out
        print(
            f"\n{scen} ({args.rate} Gbit/s bottleneck, {spec['queue_ms']:.0f} ms buffer, loss "
            f"{loss}, {args.tcp}; idle probe RTT {idle:.2f} ms; medians of {args.repeats})"
        )
        head = f"{'':<18}{'Gbit/s':>8}{'vs iperf3':>11}{'retrans %':>11}"
        head += f"{'probe +ms med':>15}{'p90':>8}"
        print(head + ("  bulk Gbit/s (its own 8 s)" if spec["bulk"] else ""))
        for name in SENDERS:
            r = out[name]

            def f(v: float | None, fmt: str) -> str:
                return "-" if v is None else format(v, fmt)

            line = (
                f"{name:<18}{r['gbps_median']:>8.3f}{f(r['ratio_vs_iperf3'], '.2f'):>11}"
                f"{r['retrans_pct_median']:>11.2f}{f(r['probe_added_ms_median'], '.1f'):>15}"
                f"{f(r['probe_added_ms_p90'], '.1f'):>8}"
            )
            print(line + (f"  {f(r['bulk_gbps_median'], '.3f'):>11}" if spec["bulk"] else ""))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
