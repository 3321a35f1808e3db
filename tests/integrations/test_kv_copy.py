"""The connector's block copier (xdc.integrations.kvcopy) on CPU tensors, for every
KVCacheLayout vLLM 0.32 may hand a connector: byte-exact for contiguous, scattered and
partial (later-chunk, null-block) cases, across layouts, and refusals that name what they
found. The cases run in the vLLM venv (torch lives there): tests/kvcopy_checks.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO, TESTS
from tests.vllm_fixtures import PY, need_vllm

pytestmark = pytest.mark.vllm

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
CHECKS = TESTS / "kvcopy_checks.py"


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, Any]]:
    need_vllm()
    res = subprocess.run(
        [str(PY), str(CHECKS)], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {c["case"]: c for c in out}


def _passed(cases: dict[str, dict[str, Any]], name: str) -> None:
    assert name in cases, f"case {name} did not run ({sorted(cases)[:5]}...)"
    assert cases[name]["ok"], cases[name]["detail"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saved_blocks_are_the_blocks_bytes_in_logical_order(cases: Any, layout: str) -> None:
    _passed(cases, f"save_contiguous[{layout}]")
    _passed(cases, f"save_scattered_with_null[{layout}]")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_land_block_for_block_across_layouts(cases: Any, layout: str) -> None:
    _passed(cases, f"round_trip_from_LBHNC[{layout}]")
    _passed(cases, f"round_trip_to_LBNHC[{layout}]")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_later_chunk_lands_only_in_its_kept_blocks(cases: Any, layout: str) -> None:
    _passed(cases, f"load_partial[{layout}]")


def test_a_manager_block_split_into_kernel_blocks_moves_whole(cases: Any) -> None:
    _passed(cases, "save_kernel_blocks[LBHNC]")


def test_what_cannot_be_read_is_refused_by_name(cases: Any) -> None:
    _passed(cases, "refusals_name_what_they_found")
    _passed(cases, "cpu_tensors_get_the_cpu_copier")


def test_the_device_placement_check_compares_bytes_not_numbers(cases: Any) -> None:
    _passed(cases, "same_bytes_sees_one_flipped_byte")


def test_a_block_id_list_is_planned_once_for_all_layers(cases: Any) -> None:
    _passed(cases, "plans_are_made_once_per_id_list")


def test_the_gpu_bench_runs_its_flow_on_cpu_and_round_trips_byte_exact(tmp_path: Path) -> None:
    """bench/gpu_kvcopy.py is run on a GPU machine only now and then: its whole flow (old and
    new copies, loads, the round trip) runs small on CPU here so it stays runnable."""
    need_vllm()
    bench = REPO / "bench" / "gpu_kvcopy.py"
    out = tmp_path / "r.json"
    res = subprocess.run(
        [str(PY), str(bench), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["round_trip_byte_exact"] for r in rows)
    assert {"forward_s", "old_save_scattered_s", "new_save_registered_s", "new_load_s"} <= set(
        rows[0]
    )
