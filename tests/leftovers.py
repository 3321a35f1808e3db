"""What a foreground command left behind when it was stopped (processes, network namespaces,
shared memory), and clearing it: a test that stops `xdc up` or `xdc bench transfer` with a
signal asserts on what it finds, and clears it either way, so a failure does not leave engines
running under the tests after it. Only what is named after the command's own processes is
looked at: tests on other workers make namespaces and pools of their own meanwhile."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from xdc.lab.crash import kill_group


def processes_naming(text: str) -> dict[int, str]:
    """The command line of every process whose command line contains ``text``, by pid."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmd:
                out[int(proc.name)] = cmd[:200]
    return out


def _named_after(names: set[str], pids: set[int]) -> set[str]:
    """Namespaces (``xdcup-a-PID-1``) and pools (``xdc-rx-PID-...``) carry their maker's pid."""
    return {n for n in names if any(f"-{pid}-" in n for pid in pids)}


def namespaces() -> set[str]:
    """Every network namespace's name."""
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()}


@dataclass
class Leftovers:
    processes: dict[int, str]
    namespaces: set[str]
    shm: set[str]

    def none(self) -> bool:
        return not (self.processes or self.namespaces or self.shm)


def clear(marker: str, pids: set[int]) -> Leftovers:
    """What is left of a command: processes whose command line names ``marker``, namespaces
    and xdc shared memory named after any of ``pids`` (the command's and those of its
    processes seen while it ran); then all of it killed, deleted and unlinked."""
    left = processes_naming(marker)
    pids = pids | set(left)
    found = Leftovers(
        left,
        _named_after(namespaces(), pids),
        _named_after(set(os.listdir("/dev/shm")), pids),
    )
    for _ in range(50):  # a process forked as the others died shows up a moment later
        now = processes_naming(marker)
        if not now:
            break
        for pid in now:
            kill_group(pid)  # servers lead process groups of their own
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # and one that does not
        pids |= set(now)
        time.sleep(0.1)
    for ns in _named_after(namespaces(), pids):
        subprocess.run(["ip", "netns", "del", ns], check=False)
    for name in _named_after(set(os.listdir("/dev/shm")), pids):
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")
    return found


def sigterm_mid_run(
    argv: list[str], marker: str, timeout: float = 90, env: dict[str, str] | None = None
) -> tuple[int, str, Leftovers]:
    """Run ``python -m xdc ARGV`` (``env`` added to the environment), send it SIGTERM 2 s
    after both its daemons (processes whose command line names ``marker``, which must be
    this run's own: a workdir, not a prefix other runs share) have their pools, and wait for
    it: its exit status, its stderr, and what it left (cleared either way)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "xdc", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    started: dict[int, str] = {}
    err = ""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            started = processes_naming(marker)
            pools = _named_after(set(os.listdir("/dev/shm")), set(started))
            if {n.split("-")[1] for n in pools} >= {"tx", "rx"}:
                break
            time.sleep(0.1)
        assert any(" sender " in c for c in started.values()), ("no sender daemon", started)
        # past both daemons' start-up: a daemon takes its signals only once it serves, and
        # a SIGTERM before that ends it with its pool left (seen 0.8-1.0 s into a receiver's
        # start, 2026-12-01; the next daemon's start sweeps such pools)
        time.sleep(2)
        assert proc.poll() is None, "it ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = clear(marker, {proc.pid, *started})
    return proc.returncode, err, left
