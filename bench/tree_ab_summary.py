"""Medians per tree from ``bench/tree_ab.sh``'s JSON lines, side by side.

python bench/tree_ab_summary.py out.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Any


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with open(sys.argv[1]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    refs: dict[str, str] = {}
    for r in rows:
        # the A/B script writes "data_threads"; its first use wrote "threads"
        key = (str(r.get("data_threads", r.get("threads"))), int(r["chunk_kib"]))
        groups[key][r["tree"]].append(r)
        refs[r["tree"]] = str(r.get("ref", r["tree"]))
    print("data threads | chunk KiB | tree | runs | Gbit/s | xdc/iperf3 | CPU s/GB | failed")
    for key in sorted(groups):
        for tree in sorted(groups[key]):
            ok = [r for r in groups[key][tree] if "error" not in r]
            if not ok:
                print(f"{key[0]} | {key[1]} | {refs[tree]} | 0 | - | - | - | -")
                continue
            med = {
                m: statistics.median(float(r[m]) for r in ok)
                for m in ("xdc_gbps", "ratio", "cpu_s_per_gb")
            }
            failed = sum(int(r["failed"]) for r in ok)
            print(
                f"{key[0]} | {key[1]} | {refs[tree]} | {len(ok)} | {med['xdc_gbps']:.2f} | "
                f"{med['ratio']:.3f} | {med['cpu_s_per_gb']:.2f} | {failed}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
