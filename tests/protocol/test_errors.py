"""One error tree (issue 31): every exception xdc defines is an XdcError whose type names its
scope (configuration / connection / request) and origin (local / remote), every wire error
code has its result code, and a command meets a configuration error with one line."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from xdc.errors import (
    ConfigurationError,
    ErrorCode,
    LocalConnectionError,
    LocalRequestError,
    Origin,
    RemoteConnectionError,
    RemoteRequestError,
    ResultCode,
    Scope,
    XdcError,
    result_of_wire,
)
from xdc.protocol.engine_control import wire_result

BRANCHES = {
    ConfigurationError: (Scope.CONFIGURATION, Origin.LOCAL),
    LocalConnectionError: (Scope.CONNECTION, Origin.LOCAL),
    RemoteConnectionError: (Scope.CONNECTION, Origin.REMOTE),
    LocalRequestError: (Scope.REQUEST, Origin.LOCAL),
    RemoteRequestError: (Scope.REQUEST, Origin.REMOTE),
}
# modules that need an engine or a device stack this runner lacks (checked where they run)
NEEDS_MORE = (
    "xdc.integrations.vllm.connector",
    "xdc.integrations.vllm.loads",
    "xdc.integrations.vllm.saves",
    "xdc.integrations.kvcopy",
    "xdc.lab.vllm_",
)
# not xdc's own errors: stand-ins for a third-party library's (pyverbs), which xdc wraps
FOREIGN = ("xdc.lab.fake_verbs.FakeRdmaError",)
# the installed layout maps these subpackages to other folders than xdc/: walk each
ROOTS = ("xdc", "xdc.transport", "xdc.scheduler", "xdc.monitor")


def _exception_classes() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {}
    names: set[str] = set()
    for root in ROOTS:
        pkg = importlib.import_module(root)
        names |= {i.name for i in pkgutil.walk_packages(pkg.__path__, f"{root}.")}
    for name in sorted(names):
        if name.startswith(NEEDS_MORE) or name.endswith("__main__"):
            continue
        mod = importlib.import_module(name)
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == mod.__name__
                and not name.startswith("_")
            ):
                out[f"{mod.__name__}.{name}"] = obj
    return out


def test_every_exception_xdc_defines_is_in_the_one_tree_with_a_scope_and_an_origin() -> None:
    classes = _exception_classes()
    assert len(classes) >= 30, sorted(classes)  # the walk found the package's errors
    outside = sorted(
        n for n, c in classes.items() if not issubclass(c, XdcError) and n not in FOREIGN
    )
    assert outside == [], f"exceptions outside XdcError: {outside}"
    for name, cls in classes.items():
        if cls is XdcError or cls in BRANCHES or name in FOREIGN:
            continue
        branch = [b for b in BRANCHES if issubclass(cls, b)]
        assert len(branch) == 1, f"{name} is under {branch}: one branch each"
        assert issubclass(cls, XdcError)
        assert (cls.scope, cls.origin) == BRANCHES[branch[0]], name


def test_every_wire_error_code_reaches_the_engine_as_the_result_code_of_its_name() -> None:
    for code in ErrorCode:
        assert result_of_wire(code) is ResultCode[code.name]
        assert wire_result(int(code)) is ResultCode[code.name]
    assert wire_result(9999) is ResultCode.PROTOCOL  # a code this version has no name for


def test_errors_carry_code_message_and_rid_without_getattr() -> None:
    from xdc.transport.wire import PeerClosed

    from xdc.errors import ProtocolError, TransferError

    e = TransferError("NO_SPACE", "pool full", rid="r1")
    assert (e.code, e.message, e.rid, e.scope, e.origin) == (
        ResultCode.NO_SPACE,
        "pool full",
        "r1",
        Scope.REQUEST,
        Origin.REMOTE,
    )
    closed = PeerClosed("gone")
    assert closed.rid is None and closed.code is ResultCode.FAILED
    assert ProtocolError(ErrorCode.CHECKSUM, "bad", rid="r").request_scoped
    assert not ProtocolError(ErrorCode.VERSION, "old").request_scoped


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["replay", "--trace", "/nonexistent/trace.jsonl"], "trace"),
        (["plan", "--profile", "/nonexistent/profile.toml"], "profile"),
    ],
)
def test_a_command_meets_a_configuration_error_with_one_line(
    argv: list[str], needle: str, tmp_path: Path
) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "xdc", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert needle in res.stderr.lower(), res.stderr
