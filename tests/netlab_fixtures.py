"""pytest fixtures for the network-namespace lab (register with
``pytest_plugins = ["tests.netlab_fixtures"]`` or the module's import path in conftest).

``netlab`` yields a fresh, torn-down-afterwards ``NetLab`` per test, or skips the test with
the reason the lab cannot run here (not root, a tool missing, namespaces refused).
Tests using it should carry ``@pytest.mark.netns``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import IO, Protocol

import pytest

from xdc.lab.netlab import BottleneckLab, NetLab, cleanup_stale, unavailable_reason

_swept: list[bool] = []


def _require_lab() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"netlab unavailable: {reason}")
    if not _swept:
        # Once per session: namespaces left by an earlier run that was killed (SIGKILL, OOM)
        # before its teardown ran.
        removed = cleanup_stale()
        if removed:
            print(f"netlab: removed stale namespaces {removed}")
        _swept.append(True)


@pytest.fixture
def netlab() -> Iterator[NetLab]:
    """A two-namespace lab; ``lab.addr_a`` (sender side) <-> ``lab.addr_b``."""
    _require_lab()
    lab = NetLab()
    with lab:
        yield lab


@pytest.fixture
def bottleneck_lab() -> Iterator[BottleneckLab]:
    """Three namespaces, a -> m -> b, the bottleneck on m's egress (``set_bottleneck``)."""
    _require_lab()
    lab = BottleneckLab()
    with lab:
        yield lab


@pytest.fixture
def iperf3() -> str:
    """Path of iperf3, or skip."""
    path = shutil.which("iperf3")
    if path is None:
        pytest.skip("iperf3 not installed (apt-get install iperf3)")
    return path


LOADGEN = [sys.executable, "-m", "xdc.lab.link_load"]


@contextmanager
def run_blaster(
    lab: NetLab, seconds: float, port: int, conns: int = 4, extra: tuple[str, ...] = ()
) -> Iterator[IO[str]]:
    """Python sink in namespace b, python blaster (with the monitor's sampler) in a.

    Yields the blaster's stdout: one JSON line per 10 Hz snapshot, ``{"link": {...}}``,
    ending when ``seconds`` have passed. The lab kills both on teardown.
    """
    sink = lab.popen(
        "b",
        [*LOADGEN, "sink", "--host", lab.addr_b, "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sink.stdout is not None and json.loads(sink.stdout.readline())["ready"]
    argv = [*LOADGEN, "blast", "--host", lab.addr_b, "--port", str(port)]
    argv += ["--conns", str(conns), "--seconds", str(seconds), *extra]
    blast = lab.popen("a", argv, stdout=subprocess.PIPE, text=True)
    assert blast.stdout is not None and json.loads(blast.stdout.readline())["ready"]
    yield blast.stdout


class Blaster(Protocol):
    def __call__(
        self, lab: NetLab, seconds: float, port: int, conns: int = ..., extra: tuple[str, ...] = ...
    ) -> AbstractContextManager[IO[str]]: ...


@pytest.fixture
def blaster() -> Blaster:
    """``with blaster(lab, seconds, port) as lines:`` (see ``run_blaster``)."""
    return run_blaster
