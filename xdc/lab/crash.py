"""Crashing a lab process group on purpose, and cleaning up what the crash leaves.

A failure test SIGKILLs a component's whole process group. vLLM's processes hold Python
``multiprocessing`` shared memory (``/dev/shm/psm_*``, ~400 MiB for an OpenAI server on this
build) and named semaphores (``/dev/shm/sem.*``) that only their resource tracker unlinks, and
it dies in the same group: every such test left ~400 MiB of RAM-backed files behind (seen:
``test_gateway_e2e`` left two ``psm_`` files of 240 and 160 MiB a run). What the group mapped
from /dev/shm and no live process still maps is removed after the kill. xdc's own segments
have their own sweep (``transport.shm.sweep_stale_segments``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

SHM = "/dev/shm/"
GONE_WITHIN_S = 10.0  # how long a SIGKILLed group may take to let go of its mappings


def _pgid(stat: str) -> int:
    """The process group of a ``/proc/<pid>/stat`` line (its command may hold spaces)."""
    return int(stat.rsplit(")", 1)[1].split()[2])


def _shm_maps(pid_dir: Path) -> set[str]:
    out: set[str] = set()
    for line in (pid_dir / "maps").read_text().splitlines():
        i = line.find(SHM)
        if i >= 0:
            out.add(line[i:].removesuffix(" (deleted)"))
    return out


def _processes() -> list[Path]:
    return [d for d in Path("/proc").iterdir() if d.name.isdigit()]


def shm_mapped_by_group(pgid: int) -> set[str]:
    """The /dev/shm files the processes of group ``pgid`` map now."""
    out: set[str] = set()
    for d in _processes():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if _pgid((d / "stat").read_text()) == pgid:
                out |= _shm_maps(d)
    return out


def shm_mapped_by_anyone() -> set[str]:
    out: set[str] = set()
    for d in _processes():
        with contextlib.suppress(OSError):
            out |= _shm_maps(d)
    return out


def remove_unmapped(held: set[str] | frozenset[str]) -> list[str]:
    """Remove the files of ``held`` that no live process maps; returns their paths.

    A group that exits cleanly leaks too: vLLM's tensor-parallel workers unmap their
    ``vllm_dist_*cpushm_*`` buffers (4 MiB each) and ``sem.mp-*`` semaphores without
    unlinking them, so a caller snapshots what the group mapped before it ends (once it has
    exited it maps nothing) and hands that here afterwards."""
    if not held:
        return []
    still = shm_mapped_by_anyone()
    removed = []
    for path in sorted(set(held) - still):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def kill_group(pgid: int, held: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """SIGKILL the process group ``pgid`` (a crash) and remove the /dev/shm files it mapped
    (now, or in ``held``: what it mapped earlier) that no live process maps any more;
    returns their paths. The caller reaps its child."""
    held = set(held) | shm_mapped_by_group(pgid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    if not held:
        return []
    # a killed process maps nothing once it is gone (or a zombie); until then its files stay
    end = time.monotonic() + GONE_WITHIN_S
    while shm_mapped_by_group(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return remove_unmapped(held)
