"""A failure test's crash cleans up after itself: a SIGKILLed process group leaves no shared
memory behind that only it used (``xdc.lab.crash``; test_gateway_e2e left ~400 MiB of vLLM's
``psm_`` files in /dev/shm each run), and keeps what another live process still maps."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory
from pathlib import Path

from xdc.lab.crash import kill_group, remove_unmapped, shm_mapped_by_group

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


def _end(proc: subprocess.Popen[str]) -> None:
    """A group a failed test left running: killed, with what it mapped."""
    if proc.poll() is None:
        kill_group(proc.pid)
        proc.wait(10)


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
        _end(proc)
        if other is not None:
            other.close()
            other.unlink()


# maps two /dev/shm files it made (as vLLM's rank workers map their buffers), then on a line
# of input unmaps both and exits cleanly without unlinking them
_CLEAN_EXIT = textwrap.dedent(
    """
    import mmap, os, sys
    maps = []
    for name in sys.argv[1:]:
        fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 16)
        maps.append(mmap.mmap(fd, 1 << 16))
        os.close(fd)
    print("mapped", flush=True)
    sys.stdin.readline()
    for m in maps:
        m.close()
    """
)


def test_a_cleanly_exited_group_leaves_nothing_only_it_mapped(tmp_path: Path) -> None:
    tag = tmp_path.name
    own, kept = Path(f"/dev/shm/xdc-test-own-{tag}"), Path(f"/dev/shm/xdc-test-kept-{tag}")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLEAN_EXIT, str(own), str(kept)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    other = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "mapped"
        held = shm_mapped_by_group(proc.pid)
        assert {str(own), str(kept)} <= held
        other = kept.open("r+b")  # a live process outside the group maps this one
        other_map = mmap.mmap(other.fileno(), 1 << 16)
        proc.stdin.write("exit\n")
        proc.stdin.close()
        assert proc.wait(10) == 0
        assert own.exists()  # the clean exit left it (the leak this mends)
        assert remove_unmapped(held) == [str(own)]
        assert not own.exists()
        assert kept.exists()  # still mapped here
        other_map.close()
        assert remove_unmapped(held) == [str(kept)]
    finally:
        _end(proc)
        if other is not None:
            other.close()
        own.unlink(missing_ok=True)
        kept.unlink(missing_ok=True)
