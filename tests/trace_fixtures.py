"""The Mooncake synthetic trace the profile and replay tests use, shipped with the tests
(tests/data, gzipped: 3,993 requests, 295 KB) instead of read from a path outside the repo."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

TRACE_GZ = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"


@pytest.fixture(scope="session")
def mooncake_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "mooncake_synthetic_trace.jsonl"
    out.write_bytes(gzip.decompress(TRACE_GZ.read_bytes()))
    return out
