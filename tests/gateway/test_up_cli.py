"""`xdc up` refuses what it cannot run with one line and exit 2, before it starts anything:
no traceback, and no namespace left behind (a careless operator's flags)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from xdc.transport.launcher import free_port

from tests.vllm_fixtures import need_vllm
from xdc.gateway.up import PROFILE, _signals_deferred
from xdc.lab.netlab import unavailable_reason


def _up(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xdc", "up", *argv], capture_output=True, text=True, timeout=60
    )


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--port", "70000"], "--port"),
        (["--rate-gbit", "nan"], "--rate-gbit"),
        (["--loss", "0.5"], "--loss"),
        (["--model", "mamba"], "--model"),
    ],
)
def test_a_bad_flag_is_one_line(argv: list[str], says: str) -> None:
    r = _up(*argv)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r


def test_an_unusable_interpreter_workdir_profile_or_port_is_one_line_and_leaves_no_namespace(
    tmp_path: Path,
) -> None:
    """Each refused in seconds, before the engines' minute: a bad profile used to be found
    by the router after both vLLM servers had started, a port in use after everything had."""
    why = unavailable_reason()
    if why:
        pytest.skip(f"xdc up needs network namespaces: {why}")
    before = _namespaces()
    not_python = tmp_path / "not-python"
    not_python.write_text("not an interpreter\n")  # exists, but cannot be run
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    not_toml = tmp_path / "profile.toml"
    not_toml.write_text("[pd\nprefill_s = oops\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    try:
        for argv, says in (
            (["--vllm-python", str(not_python)], "no vLLM interpreter"),
            (["--vllm-python", sys.executable, "--workdir", str(a_file)], "--workdir"),
            (["--profile", str(tmp_path / "missing.toml")], "--profile"),
            (["--profile", str(not_toml)], "--profile"),
            (["--port", port], f"cannot listen on 127.0.0.1:{port}"),
        ):
            t0 = time.monotonic()
            r = _up(*argv)
            took = time.monotonic() - t0
            assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r
            assert "ready" not in r.stdout, r  # refused before anything started
            assert took < 20, (argv, took)
    finally:
        busy.close()
    assert _namespaces() == before


def _processes_naming(text: str) -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmd:
                out.append(f"{proc.name}: {cmd[:200]}")
    return out


def _clear_leftovers(wd: str, ns_before: str, shm_before: set[str]) -> tuple[list[str], set[str]]:
    """What a run of `xdc up` in ``wd`` left (processes naming it, namespaces), then cleared
    with its shared memory: a failed run must not leave engines behind for the next tests."""
    left = _processes_naming(wd)
    names = {ln.split()[0] for ln in ns_before.splitlines() if ln.strip()}
    left_ns = {ln.split()[0] for ln in _namespaces().splitlines() if ln.strip()} - names
    for _ in range(50):  # a process forked as the others died shows up a moment later
        now = _processes_naming(wd)
        if not now:
            break
        for entry in now:
            pid = int(entry.split(":")[0])
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # the servers lead groups of their own
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for ns in left_ns:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    for name in set(os.listdir("/dev/shm")) - shm_before:
        if name.startswith("xdc-"):
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
    return left, left_ns


@pytest.mark.vllm
def test_sigterm_while_up_starts_stops_everything_it_had_started(tmp_path: Path) -> None:
    """`timeout 15 xdc up` (or systemd, or kill) used to end the process and leave the
    namespaces, both daemons and the vLLM servers it had started running: SIGTERM now
    unwinds like a Ctrl-C, through the same clean-up."""
    need_vllm()
    why = unavailable_reason()
    if why:
        pytest.skip(f"xdc up needs network namespaces: {why}")
    before, shm_before = _namespaces(), set(os.listdir("/dev/shm"))
    wd = tmp_path / "wd"
    argv = ["--workdir", str(wd), "--profile", str(PROFILE), "--port", str(free_port())]
    up = subprocess.Popen(
        [sys.executable, "-m", "xdc", "up", *argv, "--no-auth"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        said = []
        assert up.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            said.append(line)
            if "receiver (PD) ready" in line or not line:
                break
        assert "receiver (PD) ready" in said[-1], said
        assert _processes_naming(str(wd)), "the daemons it started are not running"
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=90)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        left, left_ns = _clear_leftovers(str(wd), before, shm_before)
    assert up.returncode == 130 and "interrupted; stopped" in err, (up.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert left == [] and left_ns == set(), (left, left_ns)


def test_a_signal_while_up_stops_is_noted_not_obeyed(capsys: pytest.CaptureFixture[str]) -> None:
    """A second Ctrl-C (or a SIGTERM) while `xdc up` stops its system would cut the clean-up
    short and leave engines and namespaces behind: it is noted and the clean-up goes on; the
    handlers are the caller's again after."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with _signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handlers run between bytecodes, in this thread
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert capsys.readouterr().err.count("xdc up: still stopping") == 2
