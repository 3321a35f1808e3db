"""`xdc demo` end to end as a user runs it: real daemons, real TCP, every byte checked."""

from __future__ import annotations

import json
import subprocess
import sys


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
