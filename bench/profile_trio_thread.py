"""Where each daemon's event-loop (trio) thread spends its samples, apart from its data
threads, from a py-spy raw profile (issue 30).

    XDC_SENDER__DATA_THREADS=on XDC_RECEIVER__DATA_THREADS=on py-spy record -s [-g] -r 200 \\
        -f raw -o prof.txt -- python3 -m xdc bench transfer --rates "" --repeats 1 --seconds 8
    python bench/profile_trio_thread.py prof.txt [TOP]

A sample is the trio thread's when its stack runs trio's loop and not a worker thread of
trio's thread cache. Without ``-g`` a sample in a socket call is mostly the thread waiting to
take the GIL back after the call; with ``-g`` only samples that hold the GIL count.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

ROLE = re.compile(r"-m xdc (sender|receiver)\b")
LINE = re.compile(r":\d+\)$")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    stats: dict[tuple[str, str], tuple[list[int], Counter[str], Counter[str]]] = {}
    with open(sys.argv[1]) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            role = next((m.group(1) for x in frames if (m := ROLE.search(x))), None)
            if role is None:
                continue
            code = [x for x in frames if not x.startswith(("process ", "thread "))]
            pooled = any("_thread_cache" in x for x in code)
            trio = any("unrolled_run" in x for x in code) and not pooled
            kind = "trio" if trio else ("thread" if pooled else "other")
            tot, own, anyw = stats.setdefault((role, kind), ([0], Counter(), Counter()))
            n = int(count)
            tot[0] += n
            own[LINE.sub(")", code[-1]) if code else "?"] += n
            for x in {LINE.sub(")", x) for x in code}:
                anyw[x] += n
    for (role, kind), (tot, own, anyw) in sorted(stats.items()):
        print(f"== {role} {kind}: {tot[0]} samples")
        if kind != "trio":
            continue
        for x, c in own.most_common(top):
            print(f"   own {100 * c / tot[0]:5.1f}%  {x}")
        for x, c in anyw.most_common(top + 20):
            if "xdc" in x or "trio" in x:
                print(f"   any {100 * c / tot[0]:5.1f}%  {x}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
