"""What the emulated link itself costs, before any tool's own work: iperf3 on loopback and on
the tbf-shaped veth, with the host's congestion control and with cubic, and the machine's
timer interrupts per GB moved (``LOC`` in /proc/interrupts, all CPUs) during each run.

Why it exists: every Python data path here (xdc, bench/bare_tcp.py, Mooncake TE) costs about
twice the CPU per GB on the 10 Gbit/s tbf link that it costs on loopback, for the same bytes
and the same copies. In a VM each timer interrupt is an exit to the hypervisor; on the tbf link
the qdisc's watchdog fires once per GSO packet it releases (a 64 KiB packet every ~52 us at
10 Gbit/s) and BBR's internal pacing (no fq qdisc here) adds its own timers. Whatever process
is running when they fire is charged for them, so this tax is part of every CPU-per-GB figure
measured on that link; this script shows its size on the machine of the day.

    python bench/link_tax.py --repeats 3 --json-out bench/results/link_tax.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from xdc.lab import bench_transfer as bt
from xdc.lab.netlab import shaped_links


def timer_interrupts() -> int:
    """Local timer interrupts so far, summed over CPUs (the ``LOC`` row)."""
    for line in Path("/proc/interrupts").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "LOC:":
            return sum(int(f) for f in fields[1:] if f.isdigit())
    raise RuntimeError("no LOC row in /proc/interrupts")


def one_run(
    host: str, args: argparse.Namespace, ns_srv: str | None, ns_cli: str | None, cc: str
) -> dict[str, float]:
    before = timer_interrupts()
    r = bt.run_iperf3(host, args.connections, args.seconds, ns_srv, ns_cli, congestion=cc)
    ticks = timer_interrupts() - before
    gb = r.gbps * args.seconds / 8
    return {"gbps": r.gbps, "cpu_s_per_gb": r.cpu_s_per_gb, "timer_irqs_per_gb": ticks / gb}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="10", help="shaped link rates in Gbit/s ('' = none)")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--algorithms", default=",cubic", help="'' = the host's default")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    algos = args.algorithms.split(",")
    links: list[tuple[str, str | None, str | None, str]] = [("loopback", None, None, "127.0.0.1")]
    results: list[dict[str, Any]] = []

    def measure(name: str, ns_srv: str | None, ns_cli: str | None, host: str) -> None:
        runs: dict[str, list[dict[str, float]]] = {a: [] for a in algos}
        for rep in range(args.repeats):
            for cc in algos[rep % len(algos) :] + algos[: rep % len(algos)]:
                s = one_run(host, args, ns_srv, ns_cli, cc)
                runs[cc].append(s)
                print(
                    f"  {name:<20} {cc or 'host default':<13} {s['gbps']:6.2f} Gbit/s "
                    f"{s['cpu_s_per_gb']:.3f} CPU s/GB {s['timer_irqs_per_gb']:8.0f} timer irq/GB",
                    file=sys.stderr,
                )
        for cc, samples in runs.items():
            row: dict[str, Any] = {"link": name, "congestion": cc or "host default"}
            for key in ("gbps", "cpu_s_per_gb", "timer_irqs_per_gb"):
                row[key] = [round(s[key], 3) for s in samples]
                row[f"{key}_median"] = round(statistics.median(s[key] for s in samples), 3)
            results.append(row)

    for name, ns_srv, ns_cli, host in links:
        measure(name, ns_srv, ns_cli, host)
    for rate, lab in shaped_links([float(r) for r in args.rates.split(",") if r.strip()]):
        measure(f"veth tbf {rate:g} Gbit/s", lab.ns_b, lab.ns_a, lab.addr_b)
    print(f"\n{'link':<22}{'congestion':<14}{'Gbit/s':>8}{'CPU s/GB':>10}{'timer irq/GB':>14}")
    for r in results:
        print(
            f"{r['link']:<22}{r['congestion']:<14}{r['gbps_median']:>8.2f}"
            f"{r['cpu_s_per_gb_median']:>10.3f}{r['timer_irqs_per_gb_median']:>14.0f}"
        )
    if args.json_out:
        report = {"machine": bt._machine(), "params": vars(args), "links": results}
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
