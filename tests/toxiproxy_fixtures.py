"""The real toxiproxy server (built from its Go module by deploy/setup-test-env.sh), started on
a free loopback port for the test session and driven only through toxiproxy-python."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from xdc.transport.launcher import free_port


@pytest.fixture(scope="session")
def toxiproxy_server() -> Iterator[Any]:
    binary = shutil.which("toxiproxy-server")
    if binary is None:
        pytest.skip("toxiproxy-server not installed (run deploy/setup-test-env.sh)")
    from toxiproxy import Toxiproxy

    port = free_port()
    proc = subprocess.Popen(
        [binary, "-host", "127.0.0.1", "-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("toxiproxy-server did not start")
                time.sleep(0.05)
        server = Toxiproxy()
        server.update_api_consumer("127.0.0.1", port)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def toxiproxy(toxiproxy_server: Any) -> Iterator[Any]:
    """The server with no proxies left over from an earlier test, and none left after."""
    toxiproxy_server.destroy_all()
    yield toxiproxy_server
    toxiproxy_server.destroy_all()


def proxy_to(server: Any, name: str, upstream_port: int) -> tuple[Any, int]:
    """A proxy on a free loopback port in front of ``upstream_port``; returns (proxy, port)."""
    port = free_port()
    proxy = server.create(
        upstream=f"127.0.0.1:{upstream_port}", name=name, listen=f"127.0.0.1:{port}"
    )
    return proxy, port


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the server carries the ``toxiproxy`` marker (``-m "not
    toxiproxy"`` runs the rest on a machine without it)."""
    for item in items:
        if "toxiproxy_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.toxiproxy)
