"""`xdc bench transfer` refuses bad flags up front, each problem naming its flag, instead of
failing minutes in with a daemon's refusal or a division by zero (a careless operator's run)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.leftovers import sigterm_mid_run
from xdc.lab import bench_transfer as bt
from xdc.lab.netlab import unavailable_reason


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
        (["--iperf3-procs", "0"], "--iperf3-procs"),
        (["--iperf3-procs", "9"], "--iperf3-procs"),  # more processes than the 8 connections
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


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_iperf3_as_several_processes_sums_their_goodput(monkeypatch: pytest.MonkeyPatch) -> None:
    """The many-core reference: N iperf3 pairs on N ports at once, connections split among
    them. Each must have run (CPU accounted from each) and the sum is what is reported."""
    seen: list[int] = []
    real = bt.run_iperf3

    def counted(
        host: str, n: int, seconds: float, server_ns: str | None, client_ns: str | None
    ) -> bt.Iperf3Run:
        seen.append(n)
        return real(host, n, seconds, server_ns, client_ns)

    monkeypatch.setattr(bt, "run_iperf3", counted)  # the real iperf3 runs; n is recorded
    r = bt.run_iperf3_procs("127.0.0.1", 3, 8, 1.0, None, None)
    assert sorted(seen) == [2, 3, 3]  # 8 connections over 3 processes
    assert r.gbps > 0 and r.cpu_s_per_gb > 0, r


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_a_chunk_past_the_default_limit_runs_and_each_event_loop_is_measured(
    tmp_path: Path,
) -> None:
    """``--chunk-kib 8192`` is past the protocol's default chunk limit (4 MiB): the local
    pair raises it on both daemons (the sender once crashed on its first BEGIN instead). The
    report charges each daemon's event loop, alone, a share of the daemons' CPU."""
    out = tmp_path / "r.json"
    res = subprocess.run(
        [
            *(sys.executable, "-m", "xdc", "bench", "transfer", "--rates", "", "--repeats", "1"),
            *("--seconds", "1", "--request-mib", "16", "--layers", "2", "--chunk-kib", "8192"),
            *("--connections", "2", "--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (link,) = json.loads(out.read_text())["links"]
    assert link["failed_requests"] == 0 and link["xdc_gbps_median"] > 0, link
    loops = link["loop_s_per_gb_median"]
    cpu = link["cpu_s_per_gb_median"]
    assert 0 < loops["sender"] < cpu and 0 < loops["receiver"] < cpu, (loops, cpu)
    assert 0 < loops["sender"] + loops["receiver"] <= cpu * 1.05, (loops, cpu)


def test_sigterm_mid_run_stops_its_daemons_and_deletes_its_namespaces() -> None:
    """`timeout 60 xdc bench transfer` used to end with both daemons still running, their
    pools in /dev/shm and a shaped run's two namespaces left: SIGTERM now unwinds like Ctrl-C
    (exit 130), and the consumer thread ends quietly instead of with a traceback."""
    why = unavailable_reason()
    if why:
        pytest.skip(f"a shaped link needs network namespaces: {why}")
    argv = ["--rates", "1", "--no-loopback", "--repeats", "1", "--seconds", "6"]
    # the daemons' configs lie in the run's temporary directory: under a TMPDIR of this
    # test's own, so another bench run on another worker is neither counted nor cleared (a
    # CI run on three workers counted the pool of the other bench test's receiver); short,
    # since the daemons' unix sockets lie there too
    tmp = tempfile.mkdtemp(prefix="xsig-", dir="/tmp")
    try:
        rc, err, left = sigterm_mid_run(["bench", "transfer", *argv], tmp, env={"TMPDIR": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert rc == 130 and "Traceback" not in err, (rc, err[-3000:])
    assert left.none(), left
