"""The decode side's landing of a GPU load, against real daemons with a copier whose loads
land late (a GPU's side-stream copies): reported only after the copies and the arrival
hashes are in, byte-exact; a block off its digest fails the load; a load the deadline check
finds complete lands like any other; stopping leaves no hashing thread. The driver runs in
the vLLM venv (torch): tests/landing_checks.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.paths import TESTS
from tests.vllm_fixtures import passed, run_checks_against_daemons

pytestmark = pytest.mark.vllm

CHECKS = TESTS / "landing_checks.py"


@pytest.fixture(scope="module", params=["threads", "helpers"])
def cases(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Every case twice: the arrival hashes in the loader's threads, and in two helper
    processes (xdc.integrations.hash_helpers; "auto" starts none below 8 cores)."""
    helpers = "2" if request.param == "helpers" else "0"
    return run_checks_against_daemons(CHECKS, tmp_path_factory.mktemp("landing"), args=(helpers,))


def test_a_late_load_is_reported_after_its_copies_byte_exact(cases: Any) -> None:
    passed(cases, "reported_after_the_copies_byte_exact")


def test_an_arrived_block_off_its_digest_fails_the_load(cases: Any) -> None:
    passed(cases, "an_arrived_block_off_its_digest_fails_the_load")


def test_a_load_the_deadline_check_finds_complete_lands_like_a_poll(cases: Any) -> None:
    passed(cases, "the_deadline_check_lands_like_a_poll")


def test_stopping_the_loader_leaves_no_hashing_thread(cases: Any) -> None:
    passed(cases, "stop_leaves_no_hashing_thread")


def test_more_loads_pending_than_one_await_names_still_land(cases: Any) -> None:
    passed(cases, "more_pending_than_one_await_names")


def test_a_transfer_id_the_receiver_cannot_take_fails_only_its_load(cases: Any) -> None:
    passed(cases, "a_bad_transfer_id_fails_only_its_load")


def test_a_transfer_of_another_prompts_kv_is_refused_before_a_block_is_written(
    cases: Any,
) -> None:
    passed(cases, "another_prompts_kv_is_refused")


def test_a_killed_hash_helper_leaves_loads_to_the_others(
    cases: Any, request: pytest.FixtureRequest
) -> None:
    _helpers_only(cases, request, "a_killed_helper_leaves_loads_to_the_others")


def test_a_stopped_hash_helper_fails_its_load_in_time_and_threads_take_over(
    cases: Any, request: pytest.FixtureRequest
) -> None:
    _helpers_only(cases, request, "a_stopped_helper_fails_its_load_then_threads_hash")


def test_stopping_the_loader_leaves_no_helper_process(
    cases: Any, request: pytest.FixtureRequest
) -> None:
    _helpers_only(cases, request, "stop_leaves_no_helper_process")


def _helpers_only(cases: Any, request: pytest.FixtureRequest, name: str) -> None:
    """A case of the helpers' run; the threads' run starts no helper and must not have it."""
    if request.node.callspec.params["cases"] == "threads":
        assert name not in cases, name
    else:
        passed(cases, name)
