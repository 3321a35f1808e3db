"""`xdc up` refuses what it cannot run with one line and exit 2, before it starts anything:
no traceback, and no namespace left behind (a careless operator's flags)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from xdc.transport.launcher import free_port

from tests.leftovers import namespaces, sigterm_mid_run
from tests.vllm_fixtures import need_vllm
from xdc.gateway.up import PROFILE, _signals_deferred
from xdc.lab.netlab import unavailable_reason


def _up(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xdc", "up", *argv], capture_output=True, text=True, timeout=60
    )


def _namespaces() -> set[str]:
    """`xdc up`'s namespaces (``xdcup-...``): tests on other workers make others meanwhile."""
    return {n for n in namespaces() if n.startswith("xdcup-")}


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


@pytest.mark.vllm
def test_sigterm_while_up_starts_stops_everything_it_had_started(tmp_path: Path) -> None:
    """`timeout 15 xdc up` (or systemd, or kill) used to end the process and leave the
    namespaces, both daemons and the vLLM servers it had started running: SIGTERM now
    unwinds like a Ctrl-C, through the same clean-up."""
    need_vllm()
    why = unavailable_reason()
    if why:
        pytest.skip(f"xdc up needs network namespaces: {why}")
    wd = tmp_path / "wd"
    argv = ["--workdir", str(wd), "--profile", str(PROFILE), "--port", str(free_port())]
    rc, err, left = sigterm_mid_run(["up", *argv, "--no-auth"], str(wd))
    assert rc == 130 and "interrupted; stopped" in err, (rc, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert left.none(), left


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
