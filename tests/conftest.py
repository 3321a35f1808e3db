"""Shared pytest set-up. Fixture modules are registered here so each suite can use them."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

pytest_plugins = [
    "tests.transport_fixtures",
    "tests.toxiproxy_fixtures",
    "tests.netlab_fixtures",
    "tests.redis_fixtures",
    "tests.router_fixtures",
    "tests.tls_fixtures",
    "tests.trace_fixtures",
]


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    """Expose each phase's report on the test item so fixtures can print daemon logs on failure."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``vllm`` test under pytest -n fails at once, saying how to run it (tests.vllm_fixtures
    also stops an unmarked one that starts engines)."""
    from tests.vllm_fixtures import SERIAL_ONLY, parallel_workers

    if item.get_closest_marker("vllm") is not None and parallel_workers() > 1:
        pytest.fail(SERIAL_ONLY.format(n=parallel_workers()))
