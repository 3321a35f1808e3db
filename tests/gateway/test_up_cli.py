"""`xdc up` refuses what it cannot run with one line and exit 2, before it starts anything:
no traceback, and no namespace left behind (a careless operator's flags)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_an_unusable_interpreter_or_workdir_is_one_line_and_leaves_no_namespace(
    tmp_path: Path,
) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(f"xdc up needs network namespaces: {why}")
    before = _namespaces()
    not_python = tmp_path / "not-python"
    not_python.write_text("not an interpreter\n")  # exists, but cannot be run
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, says in (
        (["--vllm-python", str(not_python)], "no vLLM interpreter"),
        (["--vllm-python", sys.executable, "--workdir", str(a_file)], "--workdir"),
    ):
        r = _up(*argv)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r
    assert _namespaces() == before
