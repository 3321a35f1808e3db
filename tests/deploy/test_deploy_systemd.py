"""deploy/systemd: the units run real `xdc` commands with real flags, stop within their timeout,
and the daemons they run exit 0 on SIGTERM (what Restart=on-failure relies on)."""

from __future__ import annotations

import argparse
import configparser
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from xdc.transport.launcher import free_port

from tests.deploy_fixtures import DEPLOY, load_deploy_config
from xdc.cli import COMMANDS

UNITS = {
    "xdc-sender.service": "sender",
    "xdc-receiver.service": "receiver",
    "xdc-router.service": "router",
}


def parse_unit(name: str) -> configparser.ConfigParser:
    # strict: a key given twice (systemd would merge or override) is an error here
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "systemd" / name).read_text())
    return unit


def seconds(value: str) -> float:
    """systemd time span: "30", "30s", "1min 30s", "2m"."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts, value
    return sum(float(n) * units[u] for n, u in parts)


def cli_parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """Resolve argv the way xdc.cli.main does and parse it with the command's own parser."""
    assert Path(argv[0]).name == "xdc", argv
    name, rest = argv[1], argv[2:]
    if len(argv) > 2 and f"{argv[1]} {argv[2]}" in COMMANDS:
        name, rest = f"{argv[1]} {argv[2]}", argv[3:]
    assert name in COMMANDS, f"{name!r} is not an xdc command"
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"xdc {name}", exit_on_error=False)
    module.configure(parser)
    return name, parser.parse_args(rest)


@pytest.mark.parametrize(("unit_name", "role"), UNITS.items())
def test_unit_runs_a_real_command_and_stops_in_time(
    unit_name: str, role: str, tmp_path: Path
) -> None:
    unit = parse_unit(unit_name)
    svc = unit["Service"]
    assert svc["Type"] == "simple"
    assert svc["KillSignal"] == "SIGTERM"
    assert svc["Restart"] == "on-failure"
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict"
    assert svc["RuntimeDirectory"] == "xdc"
    assert svc["EnvironmentFile"].lstrip("-") == "/etc/xdc/xdc.env"
    rw = svc["ReadWritePaths"].split()
    assert "/run/xdc" in rw
    if role != "router":
        assert "/dev/shm" in rw  # the engine maps the daemon's shared-memory pool
        assert svc.get("PrivateDevices", "no") == "no"  # would hide the host's /dev/shm

    name, args = cli_parse(shlex.split(svc["ExecStart"]))
    assert name == role
    config_file = Path(args.config)
    cfg = load_deploy_config(config_file.name, tmp_path)  # the unit's config is in deploy/
    check, check_args = cli_parse(shlex.split(svc["ExecStartPre"]))
    assert check == "config check" and check_args.file == args.config
    # systemd SIGKILLs after TimeoutStopSec: leave the drain deadline room to run out
    assert seconds(svc["TimeoutStopSec"]) >= cfg.node.shutdown_drain_s + 5
    if role in ("sender", "receiver"):
        sock = getattr(cfg, role).control_socket
        assert any(sock.startswith(p + "/") for p in rw), (sock, rw)
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_seconds_parser() -> None:
    assert seconds("30") == 30 and seconds("1min 30s") == 90 and seconds("500ms") == 0.5


def _wait_for(pred: object, proc: subprocess.Popen[str], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(pred) and pred():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"{what} exited early ({proc.returncode}): {out}\n{err}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{what} did not start within {timeout}s")


def _stop(proc: subprocess.Popen[str], limit: float) -> tuple[int, float, str]:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running {limit}s after SIGTERM:\n{err}")
    return proc.returncode, time.monotonic() - t0, err


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDC_")}
    common = ("--set", "tls.mode=off", "--set", "node.log_json=true")
    return subprocess.Popen(
        [sys.executable, "-m", "xdc", *args, *common],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_daemons_exit_zero_on_sigterm(tmp_path: Path) -> None:
    """Receiver, sender (connected to it) and router on loopback, each stopped by SIGTERM."""
    port = free_port()
    rsock, ssock = tmp_path / "r.sock", tmp_path / "s.sock"
    limit = seconds(parse_unit("xdc-receiver.service")["Service"]["TimeoutStopSec"])
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["receiver"] = _spawn(
            "receiver", "--listen", f"127.0.0.1:{port}", "--control-socket", str(rsock),
            "--pool-mib", "16",
        )  # fmt: skip
        _wait_for(rsock.exists, procs["receiver"], "receiver")
        procs["sender"] = _spawn(
            "sender", "--peer", f"127.0.0.1:{port}", "--control-socket", str(ssock),
            "--connections", "2", "--set", "sender.pool_bytes=16777216",
        )  # fmt: skip
        _wait_for(ssock.exists, procs["sender"], "sender")
        router = procs["router"] = _spawn(
            "router", "--host", "127.0.0.1", "--port", "0",
            "--profile", str(DEPLOY / "profiles" / "small-demo.toml"),
        )  # fmt: skip
        assert router.stdout is not None
        assert "listening on http://127.0.0.1:" in router.stdout.readline()
        for role in ("sender", "receiver", "router"):
            rc, took, err = _stop(procs.pop(role), limit)
            assert rc == 0, f"{role} exited {rc} on SIGTERM:\n{err}"
            assert took < limit
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
    assert not rsock.exists() and not ssock.exists()  # control sockets cleaned up
