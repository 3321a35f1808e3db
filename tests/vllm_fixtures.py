"""vLLM for the tests: the lab's rig (xdc.lab.vllm_rig), with a missing vLLM venv a skip (a
failure under XDC_REQUIRE_VLLM=1, as CI sets it) instead of an error."""

from __future__ import annotations

import os
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
    "hybrid_model",
    "kv_pair",
    "mla_model",
    "need_vllm",
    "prompt",
    "sliding_model",
    "test_model",
    "vllm_env",
]


def need_vllm() -> None:
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


def kv_pair(*args: Any, **kwargs: Any) -> AbstractContextManager[KvPair]:
    need_vllm()
    return vllm_rig.kv_pair(*args, **kwargs)
