"""One daemon setting, A/B: xdc's goodput and CPU per GB with each value of one config field,
interleaved on the same link in the same run (value order rotates each repeat, so a machine
that slows down over the run does not favour one value), medians of the repeats.

This is how a default is chosen before it is changed: measure each candidate side by side,
keep the one that moves the numbers. Optionally iperf3 on the same link each repeat, for the
ratio the README tables use.

    python bench/knob_ab.py sender.notsent_lowat_bytes 524288,2097152 --repeats 3
    python bench/knob_ab.py sender.notsent_lowat_bytes 524288,2097152 --rate 10 --iperf
    python bench/knob_ab.py sender.data_threads+receiver.data_threads off,on --iperf

Fields joined by "+" take the same value together (a setting each daemon has its own copy of).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from xdc.config import ConfigError, SenderConfig, load_config
from xdc.lab import bench_transfer as bt
from xdc.lab.netlab import shaped_links

sys.path.insert(0, str(Path(__file__).parent))
from tls import make_pki  # bench/tls.py: the throwaway mutual-TLS PKI

# fields the benchmark's load is built from (it waits for that many connections, sizes layers
# and pools by the chunk): compared by running the tool once per flag value instead
HARNESS_FLAGS = {"sender.connections": "--connections", "sender.chunk_bytes": "--chunk-kib"}


def parse_values(field: str, values: str) -> list[Any]:
    """Each candidate coerced and range-checked exactly as a config file's value would be
    (for every one of the "+"-joined fields)."""
    out = []
    for raw in values.split(","):
        cfg = load_config(env={}, overrides={f: raw.strip() for f in field.split("+")})
        section, _, name = field.split("+")[0].partition(".")
        out.append(getattr(getattr(cfg, section), name))
    return out


def measure(
    args: argparse.Namespace, base: dict[str, Any], values: list[Any]
) -> tuple[str, dict[str, list[bt.XdcRun]], list[float]] | None:
    """Every value once per repeat, rotating the order; None when the shaped link cannot run."""
    runs: dict[str, list[bt.XdcRun]] = {repr(v): [] for v in values}
    iperf: list[float] = []

    def one_repeat(rep: int, ns_tx: str | None, ns_rx: str | None, host: str) -> None:
        order = values[rep % len(values) :] + values[: rep % len(values)]
        parts = []
        if args.iperf:
            r = bt.run_iperf3(host, args.connections, args.seconds, ns_rx, ns_tx)
            iperf.append(r.gbps)
            parts.append(f"iperf3 {r.gbps:.2f}")
        for v in order:
            ns = argparse.Namespace(**base, overrides={f: v for f in args.field.split("+")})
            x = bt.run_xdc(ns, ns_tx, ns_rx, host)
            if x.failed:
                raise RuntimeError(f"{args.field}={v!r}: {x.failed} requests failed")
            runs[repr(v)].append(x)
            parts.append(f"{v!r}: {x.gbps:.2f} Gbit/s {x.cpu_s_per_gb:.3f} CPU s/GB")
        print(f"repeat {rep + 1}: " + ", ".join(parts), file=sys.stderr)

    if args.rate:
        link = f"veth tbf {args.rate:g} Gbit/s"
        for _, lab in shaped_links([args.rate]):
            for rep in range(args.repeats):
                one_repeat(rep, lab.ns_a, lab.ns_b, lab.addr_b)
        if not any(runs.values()):
            return None
    else:
        link = "loopback"
        for rep in range(args.repeats):
            one_repeat(rep, None, None, "127.0.0.1")
    return link, runs, iperf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "field",
        help="config field, section.name (e.g. sender.notsent_lowat_bytes); a+b sets both",
    )
    ap.add_argument("values", help="comma-separated candidate values")
    ap.add_argument("--rate", type=float, default=0.0, help="tbf veth rate, Gbit/s (0 = loopback)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--request-mib", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-kib", type=int, default=SenderConfig().chunk_bytes // 1024)
    ap.add_argument("--iperf", action="store_true", help="also iperf3, same link, each repeat")
    ap.add_argument(
        "--tls",
        choices=("sealed", "tls"),
        help="mutual TLS with this record layer (bench/tls.py's throwaway CA) instead of plain",
    )
    ap.add_argument("--json-out")
    args = ap.parse_args()
    for field in args.field.split("+"):
        if field.partition(".")[0] not in ("sender", "receiver"):
            print(f"{field}: only sender.* and receiver.* fields", file=sys.stderr)
            return 2
        if field in HARNESS_FLAGS:  # the load itself is sized by these
            print(f"{field}: set by the harness; use {HARNESS_FLAGS[field]}", file=sys.stderr)
            return 2
    try:
        values = parse_values(args.field, args.values)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if len({repr(v) for v in values}) != len(values):
        print(f"{args.values}: each value once", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="xdc-knob-") as pki:
        tls = None
        if args.tls:
            tls = tuple(replace(c, record_layer=args.tls) for c in make_pki(Path(pki)))
        base = vars(args) | {"congestion_control": "on", "tcp_congestion": "", "tls": tls}
        measured = measure(args, base, values)
    if measured is None:
        return 1  # shaped_links said why on stderr
    link, runs, iperf = measured
    rows = []
    for key, xs in runs.items():
        loops = {
            "sender": round(statistics.median(x.sender_loop_s_per_gb for x in xs), 3),
            "receiver": round(statistics.median(x.receiver_loop_s_per_gb for x in xs), 3),
        }
        row: dict[str, Any] = {
            "value": key,
            "gbps_median": round(statistics.median(x.gbps for x in xs), 3),
            "cpu_s_per_gb_median": round(statistics.median(x.cpu_s_per_gb for x in xs), 3),
            "gbps": [round(x.gbps, 3) for x in xs],
            "cpu_s_per_gb": [round(x.cpu_s_per_gb, 3) for x in xs],
            # each daemon's event-loop thread alone: what caps it where cores are plenty
            "loop_s_per_gb_median": loops,
        }
        if iperf:
            row["vs_iperf3_median"] = round(
                statistics.median(x.gbps / i for x, i in zip(xs, iperf, strict=True)), 3
            )
        rows.append(row)
    if args.tls:
        link += f", mutual TLS ({args.tls} records)"
    print(f"\n{link}, {args.field}, medians of {args.repeats}:")
    if iperf:
        print(f"  iperf3 {statistics.median(iperf):.2f} Gbit/s")
    for row in rows:
        ratio = f"  ({row['vs_iperf3_median']:.2f}x iperf3)" if iperf else ""
        print(
            f"  {row['value']:>12}: {row['gbps_median']:6.2f} Gbit/s "
            f"{row['cpu_s_per_gb_median']:.3f} CPU s/GB{ratio}, event loops "
            f"{row['loop_s_per_gb_median']['sender']:.3f} / "
            f"{row['loop_s_per_gb_median']['receiver']:.3f} s/GB"
        )
    if args.json_out:
        report = {
            "machine": bt._machine(),
            "link": link,
            "field": args.field,
            "params": {k: v for k, v in vars(args).items() if k != "json_out"},
            "iperf3_gbps": [round(g, 3) for g in iperf],
            "values": rows,
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
