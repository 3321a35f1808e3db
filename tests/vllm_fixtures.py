"""vLLM for the tests: the lab's rig (xdc.lab.vllm_rig), with a missing vLLM venv a skip (a
failure under XDC_REQUIRE_VLLM=1, as CI sets it) instead of an error."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from xdc.lab import vllm_rig
from xdc.lab.vllm_rig import (
    BLOCK,
    PY,
    VENV,
    Engine,
    KvPair,
    VllmServer,
    close_engines,
    prompt,
    vllm_env,
    vllm_missing,
)

__all__ = [
    "BLOCK",
    "PY",
    "VENV",
    "Engine",
    "KvPair",
    "VllmServer",
    "close_engines",
    "hybrid_model",
    "hybrid_sizes",
    "kv_pair",
    "mla_model",
    "need_vllm",
    "passed",
    "prompt",
    "run_checks_against_daemons",
    "sliding_model",
    "start_engines",
    "test_model",
    "vllm_env",
]


SERIAL_ONLY = (
    "this test starts vLLM engines pinned to cores 0 and 1, and this pytest runs {n} workers "
    "that would share them: mark its module `pytestmark = pytest.mark.vllm` and run it in a "
    "serial pytest (`-m vllm`, no -n; deploy/run-tests.sh runs them so)"
)


def parallel_workers() -> int:
    """How many pytest-xdist workers this run has (1 without xdist)."""
    try:
        return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    except ValueError:
        return 1


def need_vllm() -> None:
    """Skip (fail under XDC_REQUIRE_VLLM=1) without the vLLM venv; fail under parallel
    workers, whose tests would compete for the engines' cores and miss their deadlines."""
    if parallel_workers() > 1:
        pytest.fail(SERIAL_ONLY.format(n=parallel_workers()))
    why = vllm_missing()
    if why is None:
        return
    if os.environ.get("XDC_REQUIRE_VLLM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def test_model() -> Path:
    """The seeded dense test model (a 4-layer Llama)."""
    need_vllm()
    return vllm_rig.test_model()


test_model.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def hybrid_model(full_every: int = 2) -> Path:
    need_vllm()
    return vllm_rig.hybrid_model(full_every)


def sliding_model() -> Path:
    need_vllm()
    return vllm_rig.sliding_model()


def mla_model() -> Path:
    need_vllm()
    return vllm_rig.mla_model()


# (block tokens, state bytes, attention block bytes) of the hybrid test model, whole: the
# recurrent state in float32 (conv 3 x 512 bf16 + recurrent 4 x 64 x 64 fp32; 160 tokens x 2
# KV heads x 128 x 2 bytes) or in bf16 (4 x 64 x 64 bf16; 96-token blocks)
HYBRID_GEOMETRIES = {(160, 68608, 81920), (96, 35840, 49152)}


def hybrid_sizes(log: str, ranks: int = 1) -> tuple[int, int, int]:
    """(attention block tokens, state bytes per layer, attention block bytes per layer) of
    the hybrid test model as an engine's connector reported them (one rank's share under
    tensor parallelism). They depend on the host: where torch sees AVX512-BF16, vLLM keeps
    the recurrent state in float32 (68,608 state bytes, 160-token blocks); elsewhere in bf16
    (35,840, 96-token blocks: an AMD EPYC without it, 2026-11-30)."""
    m = re.search(r"in groups state:[\d,]+;full/bs(\d+):[\d,]+, block bytes \[([\d, ]+)\]", log)
    assert m, log[-3000:]
    bs, sizes = int(m.group(1)), [int(x) for x in m.group(2).split(",")]
    assert len(sizes) in (1, 2), m.group(0)
    # the attention block is a multiple of the tokens (K and V of every head, bf16); the
    # state's page is padded to the attention block's or the block raised to fit it
    attn = max(sizes) if len(sizes) == 1 or max(sizes) % bs == 0 else min(sizes)
    state = next((x for x in sizes if x != attn), attn)
    # one of the two the model can have (not whatever the connector says): each rank holds
    # 1/ranks of the state and of the KV heads
    assert (bs, state * ranks, attn * ranks) in HYBRID_GEOMETRIES, (m.group(0), ranks)
    return bs, state, attn


def kv_pair(*args: Any, **kwargs: Any) -> AbstractContextManager[KvPair]:
    need_vllm()
    return vllm_rig.kv_pair(*args, **kwargs)


def start_engines(*specs: tuple[str, dict[str, Any]]) -> list[Engine]:
    need_vllm()
    return vllm_rig.start_engines(*specs)


def run_checks_against_daemons(
    script: Path, workdir: Path, args: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """Run a checks script (``script TX_SOCK RX_SOCK [ARGS]``, one JSON line per case) in the
    vLLM venv against a real sender and receiver started here; the cases by name."""
    need_vllm()
    from xdc.transport.launcher import DaemonProcess, local_pair_config

    tx_cfg, rx_cfg, _ = local_pair_config(workdir)
    rx = DaemonProcess("receiver", rx_cfg, workdir)
    tx = None
    try:
        rx.wait_ready()
        tx = DaemonProcess("sender", tx_cfg, workdir)
        tx.wait_ready()
        res = subprocess.run(
            [
                str(PY),
                str(script),
                tx_cfg.sender.control_socket,
                rx_cfg.receiver.control_socket,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert res.returncode == 0, res.stderr[-3000:] + tx.log()[-1000:] + rx.log()[-1000:]
        out = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        return {c["case"]: c for c in out}
    finally:
        for d in (tx, rx):
            if d is not None:
                d.stop()


def passed(cases: dict[str, dict[str, Any]], name: str) -> None:
    assert name in cases, f"case {name} did not run: {sorted(cases)}"
    assert cases[name]["ok"], cases[name]["detail"]
