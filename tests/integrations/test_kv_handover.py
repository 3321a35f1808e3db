"""The producer's hand-over when copies land late (a GPU's side-stream copies): real sender
and receiver daemons, the connector's ``saves.Handover`` driven by copies that complete on
their own timers. Nothing is handed over before it landed, a request's order holds, the
digest layer goes last, a device error is reported. The driver runs in the vLLM venv
(torch): tests/handover_checks.py."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.paths import TESTS
from tests.vllm_fixtures import PY, need_vllm

CHECKS = TESTS / "handover_checks.py"


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    need_vllm()
    from xdc.transport.launcher import DaemonProcess, local_pair_config

    wd = tmp_path_factory.mktemp("handover")
    tx_cfg, rx_cfg, _ = local_pair_config(wd)
    rx = DaemonProcess("receiver", rx_cfg, wd)
    tx = None
    try:
        rx.wait_ready()
        tx = DaemonProcess("sender", tx_cfg, wd)
        tx.wait_ready()
        res = subprocess.run(
            [str(PY), str(CHECKS), tx_cfg.sender.control_socket, rx_cfg.receiver.control_socket],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert res.returncode == 0, res.stderr[-3000:] + tx.log()[-2000:]
        out = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        return {c["case"]: c for c in out}
    finally:
        for d in (tx, rx):
            if d is not None:
                d.stop()


def _passed(cases: dict[str, dict[str, Any]], name: str) -> None:
    assert name in cases, f"case {name} did not run: {sorted(cases)}"
    assert cases[name]["ok"], cases[name]["detail"]


def test_late_copies_keep_their_order_and_the_digests_go_last(cases: Any) -> None:
    _passed(cases, "order_kept_and_digests_last")


def test_the_engine_and_the_completion_thread_share_one_client(cases: Any) -> None:
    _passed(cases, "client_shared_under_one_lock")


def test_a_copy_that_fails_on_the_device_is_reported_and_never_handed_over(cases: Any) -> None:
    _passed(cases, "device_error_reported")
