"""`xdc demo` end to end as a user runs it: real daemons, real TCP, every byte checked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.leftovers import sigterm_mid_run


def test_demo_streams_intact_and_reports() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "demo", "-n", "6", "--scale", "0.01", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout[r.stdout.index("{") :])
    assert summary["requests"] == 6 and summary["delivered_intact"] == 6
    assert summary["lost"] == 0 and summary["corrupted"] == 0 and summary["failed"] == 0
    assert summary["bytes"] > 0 and summary["goodput_gbps"] > 0
    assert summary["tail_ms_p50"] is not None


def test_demo_rejects_bad_flags() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "demo", "--scale", "0"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "scale" in r.stderr


def _demo(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xdc", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_bad_flag_is_named_at_once_without_a_traceback() -> None:
    r = _demo("--connections", "0", "--chunk-kib", "0", "--timeout", "0", "--layers", "0")
    assert r.returncode == 2, r
    for flag in ("--connections:", "--chunk-kib:", "--timeout:", "--layers:"):
        assert flag in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    for workdir in ("/etc/passwd", "/proc/1"):  # a file; a directory nothing can be written to
        r = _demo("--workdir", workdir)
        assert r.returncode == 2 and "--workdir" in r.stderr and "Traceback" not in r.stderr, r


def test_the_timeout_ends_the_demo_with_what_was_not_done_reported() -> None:
    """--timeout is when to give up: the demo stops producing, says which requests failed and
    exits 1, instead of blocking on a pool nobody drains any more (it used to hang)."""
    t0 = time.monotonic()
    r = _demo("--timeout", "1.5", "--json", timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads(r.stdout[r.stdout.index("{") :])
    assert summary["failed"] >= 1 and summary["corrupted"] == 0
    assert summary["delivered_intact"] + summary["failed"] + summary["lost"] == summary["requests"]
    assert took < 30, took


def test_sigterm_mid_demo_stops_its_daemons_quietly(tmp_path: Path) -> None:
    """SIGTERM (`timeout`, `kill`) unwinds like Ctrl-C: exit 130, both daemons stopped with
    their pools, and the decode thread ends without a traceback when its daemon goes."""
    wd = tmp_path / "wd"
    rc, err, left = sigterm_mid_run(["demo", "-n", "400", "--workdir", str(wd)], str(wd))
    assert rc == 130 and "Traceback" not in err, (rc, err[-3000:])
    assert left.none(), left
