"""The producer's hand-over when copies land late (a GPU's side-stream copies): real sender
and receiver daemons, the connector's ``saves.Handover`` driven by copies that complete on
their own timers. Nothing is handed over before it landed, a request's order holds, the
digest layer goes last, a device error is reported. The driver runs in the vLLM venv
(torch): tests/handover_checks.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.paths import TESTS
from tests.vllm_fixtures import passed, run_checks_against_daemons

pytestmark = pytest.mark.vllm

CHECKS = TESTS / "handover_checks.py"


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_checks_against_daemons(CHECKS, tmp_path_factory.mktemp("handover"))


def test_late_copies_keep_their_order_and_the_digests_go_last(cases: Any) -> None:
    passed(cases, "order_kept_and_digests_last")


def test_the_engine_and_the_completion_thread_share_one_client(cases: Any) -> None:
    passed(cases, "client_shared_under_one_lock")


def test_a_copy_that_fails_on_the_device_is_reported_and_never_handed_over(cases: Any) -> None:
    passed(cases, "device_error_reported")
