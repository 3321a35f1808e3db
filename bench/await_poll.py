"""What a decode engine's poll costs: one ``DecodeClient.await_any(rids, timeout=0)`` against a
real receiver daemon, for as many waiting transfers as a loader may name (none of them has
arrived: the common case of a poll, which the connector's loader makes once per engine step).

The loader names every waiting transfer in each poll (in slices of ``MAX_AWAIT_RIDS``), so
this is a cost per engine step that grows with the requests a decode engine has waiting.

    python bench/await_poll.py [--counts 16,128,1024] [--calls 300] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from xdc.transport.engine_client import DecodeClient
from xdc.transport.launcher import DaemonProcess, local_pair_config

from xdc.errors import ResultCode, XdcError


def poll_us(client: DecodeClient, n: int, calls: int) -> float:
    """Median microseconds of ``calls`` looks naming ``n`` transfers that have not begun."""
    rids = [f"poll-{n}-{i:06d}-{os.getpid()}" for i in range(n)]
    took = []
    for _ in range(calls):
        t0 = time.perf_counter()
        try:
            client.await_any(rids, timeout=0)
        except XdcError as e:
            if e.code != ResultCode.TIMEOUT:
                raise
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="16,128,1024", help="transfers named per poll")
    ap.add_argument("--calls", type=int, default=300, help="polls per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per count (median)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()
    counts = [int(c) for c in a.counts.split(",")]
    _tx, rx_cfg, wd = local_pair_config()
    rx = DaemonProcess("receiver", rx_cfg, wd)
    rx.wait_ready()
    rows = []
    try:
        with DecodeClient(rx_cfg.receiver.control_socket) as client:
            runs: dict[int, list[float]] = {n: [] for n in counts}
            for _ in range(a.repeats):
                for n in counts:  # interleaved: the machine's noise falls on every count
                    runs[n].append(poll_us(client, n, a.calls))
            for n in counts:
                med = statistics.median(runs[n])
                rows.append({"named": n, "median_us": round(med, 1), "runs_us": runs[n]})
                print(f"{n:6d} transfers named: {med:8.1f} us a poll (median of {a.repeats})")
    finally:
        rx.stop()
    if a.json:
        machine = (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        )
        a.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
