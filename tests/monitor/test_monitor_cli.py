"""``xdc monitor`` against a real HTTP status endpoint on loopback."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from xdc.monitor.link_estimator import LinkEstimator, Sample
from xdc.monitor.tcpinfo import read_tcp_info

from xdc.cli import main
from xdc.config import MonitorConfig


def real_link_json() -> dict[str, Any]:
    """A snapshot computed from a real loopback transfer, as a daemon would serve it."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    acc, _ = srv.accept()
    with srv, cli, acc:
        est = LinkEstimator(MonitorConfig(link_capacity_bps=10e9))
        info = read_tcp_info(cli)
        assert info is not None
        est.update(Sample(0.0, [info], wall=1700000000.0))
        cli.sendall(b"x" * 200_000)
        got = 0
        while got < 200_000:
            got += len(acc.recv(1 << 20))
        info = read_tcp_info(cli)
        assert info is not None
        link: dict[str, Any] = est.update(Sample(0.1, [info], wall=1700000000.1)).to_json()
        return link


@contextmanager
def status_server(bodies: list[Any]) -> Iterator[str]:
    """Serves ``bodies`` in turn at GET /status (the last one repeats)."""
    hits = [0]

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/status":
                self.send_error(404)
                return
            body = bodies[min(hits[0], len(bodies) - 1)]
            hits[0] += 1
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_prints_one_line_per_poll(capsys: pytest.CaptureFixture[str]) -> None:
    link = real_link_json()
    with status_server([{"role": "sender", "link": link}]) as url:
        rc = main(["monitor", "--url", url, "--count", "3", "--interval", "0.01"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 3
    assert out[0].split()[1] == link["state"] and out[0].split()[2] == link["cause"]
    assert re.search(r"queue \d+\.\d ms", out[0]), out[0]
    assert re.search(r"goodput \d+\.\d\d [kMG]b/s", out[0]), out[0]
    assert "cap 10.00 Gb/s" in out[0]
    assert f"socks {link['active_sockets']}/{link['sockets']}" in out[0]


def test_json_mode_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    link = real_link_json()
    with status_server([{"link": link}]) as url:
        assert main(["monitor", "--url", url + "/status", "--count", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == link


def test_daemon_without_link_state_yet(capsys: pytest.CaptureFixture[str]) -> None:
    with status_server([{"role": "sender"}, {"link": {"state": "warn"}}]) as url:
        assert main(["monitor", "--url", url, "--count", "2", "--interval", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "no link state yet" in lines[0]
    assert lines[1].split()[1] == "warn"  # missing keys print as "-", not a crash
    assert "goodput -" in lines[1]


def test_unreachable_daemon_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    rc = main(["monitor", "--url", f"http://127.0.0.1:{port}", "--count", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"cannot read http://127.0.0.1:{port}/status" in err
    assert "refused" in err.lower()


def test_garbage_status_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with status_server([b"<html>not json</html>"]) as url:
        assert main(["monitor", "--url", url, "--count", "1"]) == 1
    assert "cannot read" in capsys.readouterr().err
    with status_server([[1, 2]]) as url:
        assert main(["monitor", "--url", url, "--count", "1"]) == 1


def test_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", "--url", "http://127.0.0.1:1", "--interval", "0"]) == 2
    assert "--interval" in capsys.readouterr().err


def test_an_endless_or_absurd_status_is_an_error_not_a_hang(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A status that streams without end used to be read until memory ran out; a timestamp of
    1e300 or NaN made time.localtime raise out of the formatter."""
    ls = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def endless() -> None:
        c, _ = ls.accept()
        with c:
            c.recv(65536)
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n[")
            while not stop.is_set():
                try:
                    c.sendall(b"1," * 65536)
                except OSError:
                    return

    t = threading.Thread(target=endless, daemon=True)
    t.start()
    try:
        rc = main(["monitor", "--url", f"http://127.0.0.1:{ls.getsockname()[1]}", "--count", "1"])
    finally:
        stop.set()
        ls.close()
        t.join(5)
    assert rc == 1 and "over 4194304 bytes" in capsys.readouterr().err
    with status_server([{"link": {"state": "ok", "updated_at": 1e300}}]) as url:
        assert main(["monitor", "--url", url, "--count", "1"]) == 0
    assert capsys.readouterr().out.split()[0] == "-"
    with status_server([b'{"link": {"state": "ok", "updated_at": NaN}}']) as url:
        assert main(["monitor", "--url", url, "--count", "1"]) == 0
    assert capsys.readouterr().out.split()[0] == "-"
    with status_server([b"[" * 100000]) as url:  # json.loads raised RecursionError
        assert main(["monitor", "--url", url, "--count", "1"]) == 1
    assert "nested deeper" in capsys.readouterr().err
