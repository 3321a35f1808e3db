"""deploy/run-tests.sh runs the suite in two pytests: the tests without vLLM engines on
xdist workers, then the ``vllm`` ones serially. These check the rules that keep that safe:
a vLLM test under ``pytest -n`` fails at once with the way to run it (marked or not), and
the script refuses a bad worker count and passes a selection that leaves one half empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

# a vLLM test that fails before it starts anything under -n (its fixture calls need_vllm)
MARKED = (
    "tests/integrations/test_kv_handover.py"
    "::test_late_copies_keep_their_order_and_the_digests_go_last"
)


def _env() -> dict[str, str]:
    """This environment without the xdist worker's own settings (this test may run in one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}


def _pytest(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 1, (res.returncode, res.stdout[-3000:], res.stderr[-2000:])
    return res.stdout


def test_a_vllm_marked_test_under_parallel_workers_fails_saying_how_to_run_it() -> None:
    out = _pytest("-n", "2", MARKED)
    assert "1 error" in out, out[-3000:]  # at set-up, before its fixture starts daemons
    assert "this pytest runs 2 workers" in out and "-m vllm" in out, out[-3000:]


def test_an_unmarked_test_that_needs_vllm_under_parallel_workers_fails_too(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_unmarked.py").write_text(
        "from tests.vllm_fixtures import need_vllm\n\n"
        "def test_it() -> None:\n"
        "    need_vllm()\n"
        "    raise AssertionError('need_vllm let a test under -n go on')\n"
    )
    env = {**_env(), "PYTHONPATH": str(REPO)}
    out = _pytest("-n", "2", "test_unmarked.py", cwd=tmp_path, env=env)
    assert "pytestmark = pytest.mark.vllm" in out, out[-3000:]
    assert "need_vllm let a test" not in out, out[-3000:]


def _run_tests(*args: str, workers: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "deploy" / "run-tests.sh"), "-p", "no:cacheprovider", *args],
        env={**_env(), "XDC_TEST_WORKERS": workers},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("workers", ["two", "-1", "2.5"])
def test_a_worker_count_that_is_not_a_whole_number_is_refused(workers: str) -> None:
    res = _run_tests(workers=workers)
    assert res.returncode == 2, res
    assert f"XDC_TEST_WORKERS must be a whole number, not '{workers}'" in res.stderr


@pytest.mark.parametrize("workers", ["100000", "99999999999999999999"])
def test_a_worker_count_beyond_4_per_core_is_refused_before_any_test_starts(workers: str) -> None:
    res = _run_tests(workers=workers)
    assert res.returncode == 2, res
    assert f"XDC_TEST_WORKERS={workers} is more than 4 per core" in res.stderr
    assert "run-tests: 1/2" not in res.stdout  # refused before pytest ran


def test_a_selection_without_vllm_tests_passes_and_a_failure_in_it_is_the_exit_status(
    tmp_path: Path,
) -> None:
    ok = _run_tests("tests/deploy/test_config.py", workers="2")
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "passed" in ok.stdout and "deselected" in ok.stdout, ok.stdout[-3000:]
    failing = tmp_path / "test_failing.py"
    failing.write_text("def test_it() -> None:\n    assert False\n")
    bad = _run_tests(str(failing), workers="2")
    # the first half failed, the second selected nothing: the script says the first
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert "1 failed" in bad.stdout and "run-tests: 2/2" in bad.stdout, bad.stdout[-3000:]
