"""A failure test's crash cleans up after itself: a SIGKILLed process group leaves no shared
memory behind that only it used (``xdc.lab.crash``; test_gateway_e2e left ~400 MiB of vLLM's
``psm_`` files in /dev/shm each run), and keeps what another live process still maps."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from multiprocessing import shared_memory
from pathlib import Path

from xdc.lab.crash import kill_group

# a process that makes two segments, has a child map the first, and waits to be killed
_GROUP = textwrap.dedent(
    """
    import subprocess, sys, time
    from multiprocessing import shared_memory
    own = shared_memory.SharedMemory(create=True, size=1 << 20)
    kept = shared_memory.SharedMemory(create=True, size=1 << 16)
    child = subprocess.Popen([sys.executable, "-c",
        "import sys, time\\nfrom multiprocessing import shared_memory\\n"
        f"s = shared_memory.SharedMemory(name={own.name!r})\\nprint('mapped', flush=True)\\n"
        "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "mapped"
    print(own.name, kept.name, flush=True)
    time.sleep(120)
    """
)


def test_a_killed_group_leaves_no_shared_memory_that_only_it_mapped() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _GROUP],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    other: shared_memory.SharedMemory | None = None
    try:
        assert proc.stdout is not None
        own, kept = proc.stdout.readline().split()
        own_path, kept_path = Path("/dev/shm", own), Path("/dev/shm", kept)
        assert own_path.exists() and kept_path.exists()
        other = shared_memory.SharedMemory(name=kept)  # a live process outside the group
        removed = kill_group(proc.pid)
        proc.wait(10)
        assert removed == [str(own_path)], removed
        assert not own_path.exists()
        assert kept_path.exists()  # still mapped here: not the crash's to remove
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait(10)
        if other is not None:
            other.close()
            other.unlink()
