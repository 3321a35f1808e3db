"""`xdc bench transfer` refuses bad flags up front, each problem naming its flag, instead of
failing minutes in with a daemon's refusal or a division by zero (a careless operator's run)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from xdc.lab import bench_transfer as bt


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bt.configure(parser)
    return parser.parse_args(list(argv))


def test_the_defaults_pass() -> None:
    assert bt.check_args(_args()) == []
    assert bt.parse_rates(" 1, 5,10 ,") == [1.0, 5.0, 10.0]
    assert bt.parse_rates("") == []


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--connections", "0"], "--connections"),
        (["--connections", "257"], "--connections"),
        (["--chunk-kib", "0"], "--chunk-kib"),
        (["--chunk-kib", "65537"], "--chunk-kib"),
        (["--seconds", "0"], "--seconds"),
        (["--seconds", "nan"], "--seconds"),
        (["--repeats", "0"], "--repeats"),
        (["--request-mib", "0"], "--request-mib"),
        (["--layers", "0"], "--layers"),
        (["--request-mib", "1", "--layers", "257"], "--layers"),
        (["--rates", "abc"], "--rates"),
        (["--rates", "1,-5"], "--rates"),
        (["--rates", "inf"], "--rates"),
    ],
)
def test_each_bad_flag_is_named(argv: list[str], flag: str) -> None:
    problems = bt.check_args(_args(*argv))
    assert len(problems) == 1 and problems[0].startswith(flag + ":"), problems


def test_every_problem_is_reported_at_once() -> None:
    problems = bt.check_args(_args("--connections", "0", "--layers", "0", "--rates", "x"))
    assert [q.split(":")[0] for q in problems] == ["--connections", "--layers", "--rates"]


def test_the_command_exits_2_with_the_problems_and_no_traceback() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "xdc", "bench", "transfer", "--layers", "0", "--rates", "abc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res
    assert "--layers:" in res.stderr and "--rates:" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
