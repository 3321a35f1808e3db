"""Where each xdc daemon spends its samples, from a py-spy raw profile (issue 30).

    py-spy record -s [-g] -r 100 -f raw -o prof.txt -- python3 -m xdc bench transfer ...
    python bench/profile_summary.py prof.txt [--top 20]

``-s`` follows the daemons the bench starts; ``-g`` keeps only samples that hold the GIL, which
is what caps a daemon whose data threads wait for it. Prints, per daemon (sender, receiver),
the functions with the most samples of their own (the leaf frame) and the most samples
anywhere on the stack, as shares of that daemon's samples.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

ROLE = re.compile(r"-m xdc (sender|receiver)\b")
LINE = re.compile(r":\d+\)$")


def summarize(lines: list[str]) -> dict[str, tuple[int, Counter[str], Counter[str]]]:
    """role -> (samples, own samples per leaf frame, samples per frame anywhere on a stack)."""
    out: dict[str, tuple[int, Counter[str], Counter[str]]] = {}
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        role = next((m.group(1) for f in frames if (m := ROLE.search(f))), "other")
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        total, own, anywhere = out.get(role, (0, Counter[str](), Counter[str]()))
        n = int(count)
        own[code[-1] if code else "?"] += n
        for f in {LINE.sub(")", f) for f in code}:
            anywhere[f] += n
        out[role] = (total + n, own, anywhere)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    try:
        lines = a.profile.read_text().splitlines()
    except OSError as e:
        ap.error(f"{a.profile}: {e.strerror}")
    roles = summarize(lines)
    if not roles:
        print(f"{a.profile}: no samples", file=sys.stderr)
        return 1
    for role in ("sender", "receiver", "other"):
        if role not in roles:
            continue
        total, own, anywhere = roles[role]
        print(f"== {role}: {total} samples")
        print("  own (leaf frame):")
        for frame, n in own.most_common(a.top):
            print(f"    {n / total:6.1%}  {frame[:150]}")
        print("  anywhere on the stack:")
        for frame, n in anywhere.most_common(a.top):
            print(f"    {n / total:6.1%}  {frame[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
