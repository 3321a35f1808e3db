"""Lab vLLM engines forked from one process that imported vLLM once.

A lab engine (``xdc.lab.vllm_offline``) spent ~11 of its ~14 s start importing vLLM and
torch, in every one of the test suite's engine processes. The fork server imports them once;
each engine is then a ``fork`` of it that runs ``vllm_offline.main`` with the engine's own
argv, environment, working directory and standard streams, and is ready in ~3 s. What the
child runs is the same code on the same interpreter as ``python -m xdc.lab.vllm_offline``:
only the imports are shared. A child is a session (and process group) of its own, as the
rig's ``Popen(start_new_session=True)`` made it, so ``kill_group`` works unchanged.

Nothing imported here may read per-engine settings at import time: the server checks that
the connector (which reads ``XDC_CONNECTOR_FAULT`` on import) is not among what it
imported, so each child imports it under its own environment.

The server talks to the one client that started it over a ``SOCK_SEQPACKET`` socket pair:
one JSON message per request and per answer, the child's three standard streams passed as
file descriptors with a spawn request. It exits when the client's end closes. Children
stay unreaped until the client asks for their status, so a pid the client holds is never
reused under it.

    python -m xdc.lab.vllm_forkserver --fd N     (started by ``ForkServer``)
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

MAX_MESSAGE = 1 << 20
# imported by the server; each must not read per-engine settings at import
WARM = ("vllm", "vllm.config", "vllm.inputs", "torch", "xdc.lab.vllm_offline")
MUST_NOT_WARM = ("xdc.integrations.vllm.loads", "xdc.integrations.vllm.connector")


class ForkServerError(RuntimeError):
    """The fork server did not start or answer."""


# -- the server (runs in the vLLM venv) ------------------------------------------------------


def _warm() -> None:
    import importlib

    for name in WARM:
        importlib.import_module(name)
    from vllm import LLM, SamplingParams  # noqa: F401  (resolves vLLM's lazy attributes)

    held = [m for m in MUST_NOT_WARM if m in sys.modules]
    if held:
        raise ForkServerError(f"fork server imported {held}: they read settings on import")


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the engine process, run it, and never return."""
    rc = 1
    try:
        sock.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import random

        random.seed()  # not the server's sequence, shared by every child
        from xdc.lab import vllm_offline

        sys.argv = [str(vllm_offline.__file__), *req["argv"]]
        rc = vllm_offline.main(list(req["argv"]))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        import atexit

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)


def _status(pid: int) -> int | None:
    """The child's exit code once it ended (and is reaped now), else None."""
    if pid <= 0:  # waitpid would reap any child (-1) or any of the group (0): another's pid
        raise ValueError(f"pid must be > 0, not {pid}")
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1  # not ours, or reaped before: report it ended
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def serve(sock: socket.socket) -> None:
    """Answer requests until the client's end closes."""
    _warm()
    import gc

    gc.collect()
    gc.freeze()  # what the server holds stays shared with the children (no copy on GC)
    sys.stdout.flush()
    sys.stderr.flush()
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
        if not msg:
            return
        try:
            req = json.loads(msg)
            if req["op"] == "spawn":
                if len(fds) != 3:
                    raise ValueError(f"a spawn passes 3 descriptors, not {len(fds)}")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(sock, req, fds)
                answer: dict[str, Any] = {"pid": pid}
            elif req["op"] == "status":
                answer = {"returncode": _status(int(req["pid"]))}
            else:
                raise ValueError(f"unknown op {req['op']!r}")
        except Exception as e:  # a bad request is answered, not fatal
            answer = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(answer).encode())


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fd", type=int, required=True, help="the client's socket (inherited)")
    a = ap.parse_args(argv)
    sock = socket.socket(fileno=a.fd)
    try:
        serve(sock)
    finally:
        sock.close()
    return 0


# -- the client (the test process) -----------------------------------------------------------


class ForkServer:
    """A running fork server and the one connection to it (requests take turns)."""

    def __init__(self, python: str, env: dict[str, str], log: Path, timeout: float = 240):
        """Start the server with ``python`` (the vLLM venv's) and ``env``, its output in
        ``log`` (removed by ``close``); returns once it imported vLLM."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self.log_path = log
        self._log = log.open("w")
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "xdc.lab.vllm_forkserver", "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            self._sock.close()
            self._log.close()
            raise
        finally:
            theirs.close()
        try:
            self._sock.settimeout(timeout)
            self._answer()
        except ForkServerError as e:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)  # what it printed on its way out is the reason
            tail = log.read_text(errors="replace")[-4000:]
            self.close()
            raise ForkServerError(f"{e}:\n{tail}") from None
        except BaseException:
            self.close()
            raise
        self._sock.settimeout(30)

    def _answer(self) -> dict[str, Any]:
        try:
            msg = self._sock.recv(MAX_MESSAGE)
        except TimeoutError as e:
            raise ForkServerError("the fork server gave no answer") from e
        if not msg:
            raise ForkServerError(f"the fork server exited ({self.proc.poll()})")
        answer: dict[str, Any] = json.loads(msg)
        if "error" in answer:
            raise ForkServerError(answer["error"])
        return answer

    def _ask(self, req: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(req).encode()], fds or [])
            return self._answer()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(
        self, argv: list[str], env: dict[str, str], stdin: int, stdout: int, stderr: int
    ) -> int:
        """The pid of a new engine process running ``vllm_offline.main(argv)``."""
        req = {"op": "spawn", "argv": argv, "env": env, "cwd": os.getcwd()}
        return int(self._ask(req, [stdin, stdout, stderr])["pid"])

    def returncode(self, pid: int) -> int | None:
        return self._ask({"op": "status", "pid": pid})["returncode"]  # type: ignore[no-any-return]

    def close(self) -> None:
        """The server exits when its socket closes; the engines it forked are not touched
        (each is its own session, ended by its owner)."""
        self._sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


class ForkedEngineProcess:
    """An engine process from the fork server, with the part of ``subprocess.Popen`` the
    rig uses: text ``stdin``/``stdout`` pipes, ``pid``, ``poll``, ``wait``, signals."""

    def __init__(
        self, server: ForkServer, argv: list[str], env: dict[str, str], stderr: IO[str]
    ) -> None:
        self._server = server
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.pid = server.spawn(argv, env, in_r, out_w, stderr.fileno())
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            raise
        os.close(in_r)
        os.close(out_w)
        self.stdin: IO[str] | None = open(in_w, "w")  # noqa: SIM115  (closed by the rig)
        self.stdout: IO[str] | None = open(out_r)  # noqa: SIM115
        self.returncode: int | None = None
        self.args = argv

    def poll(self) -> int | None:
        if self.returncode is None:
            if not self._server.alive():
                self.returncode = -1  # its server is gone: nothing can tell; it is not ours
            else:
                self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # an unreaped child holds its pid: never another's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    raise SystemExit(main())
