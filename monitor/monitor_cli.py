"""``xdc monitor``: poll a daemon's ``GET /status`` and print its link state once per interval.

Plain blocking urllib on purpose: one request a second needs no event loop, and the command
should start instantly on an operator's terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        help="daemon status base URL, e.g. http://127.0.0.1:9400 (GET <url>/status is polled)",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between lines")
    parser.add_argument("--count", type=int, default=0, help="stop after N lines (0 = forever)")
    parser.add_argument("--timeout", type=float, default=2.0, help="HTTP timeout, seconds")
    parser.add_argument("--json", action="store_true", help="print the raw link JSON per line")


MAX_STATUS_BYTES = 4 << 20


def status_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/status") else base + "/status"


def fetch_link(url: str, timeout: float) -> dict[str, Any] | None:
    """The ``link`` object of the daemon's status, ``None`` if it has none yet.

    Raises ``OSError`` (urllib's errors included) when the daemon cannot be reached and
    ``ValueError`` when it answers something that is not a JSON object.
    """
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        raw = resp.read(MAX_STATUS_BYTES + 1)  # a status is a few KiB; never read without end
    if len(raw) > MAX_STATUS_BYTES:
        raise ValueError(f"status is over {MAX_STATUS_BYTES} bytes")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ValueError("status is nested deeper than any status is") from None
    if not isinstance(body, dict):
        raise ValueError("status is not a JSON object")
    link = body.get("link")
    if link is not None and not isinstance(link, dict):
        raise ValueError("status 'link' is not a JSON object")
    return link


def _rate(bps: Any) -> str:
    if not isinstance(bps, int | float):
        return "-"
    for unit, scale in (("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} b/s"


def _clock(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts))
    except (OverflowError, ValueError, OSError):  # nan, 1e300: a broken daemon's timestamp
        return "-"


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, int | float) else "-"


def format_line(link: dict[str, Any]) -> str:
    """One human line; tolerant of missing keys so an older daemon still prints."""
    clock = _clock(link.get("updated_at"))
    util = link.get("utilisation")
    return (
        f"{clock} {link.get('state', '?')!s:<9} {link.get('cause', '-')!s:<11} "
        f"queue {_num(link.get('queue_ms'), '.1f')} ms  "
        f"util {_num(util * 100 if isinstance(util, int | float) else None, '5.1f')}%  "
        f"goodput {_rate(link.get('goodput_bps'))}  cap {_rate(link.get('capacity_bps'))}  "
        f"retrans {_num(link.get('retrans_ratio'), '.3%')}  "
        f"rtt {_num(link.get('rtt_ms'), '.2f')} ms (min {_num(link.get('min_rtt_ms'), '.2f')}, "
        f"x{_num(link.get('rtt_inflation'), '.2f')})  "
        f"socks {link.get('active_sockets', '-')}/{link.get('sockets', '-')}"
    )


def watch(url: str, interval: float, count: int, timeout: float, as_json: bool, out: TextIO) -> int:
    target = status_url(url)
    printed = 0
    while True:
        try:
            link = fetch_link(target, timeout)
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            print(f"xdc monitor: cannot read {target}: {reason}", file=sys.stderr)
            return 1
        if link is None:
            line = "(daemon reports no link state yet)"
        else:
            line = json.dumps(link, sort_keys=True) if as_json else format_line(link)
        print(line, file=out, flush=True)
        printed += 1
        if count and printed >= count:
            return 0
        time.sleep(interval)


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.count < 0 or args.timeout <= 0:
        print("xdc monitor: --interval and --timeout must be > 0, --count >= 0", file=sys.stderr)
        return 2
    return watch(args.url, args.interval, args.count, args.timeout, args.json, sys.stdout)
