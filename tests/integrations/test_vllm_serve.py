"""Which CPU-build engines prefill once before serving loads (serve.needs_warmup): decode
roles with bf16 KV on a host whose cpuinfo has AMX tiles, where vLLM 0.32's AMX attention
kernel died of SIGILL on a first forward that followed a connector's load."""

from __future__ import annotations

from pathlib import Path

import pytest

from xdc.integrations.vllm.serve import WARMUP_PROMPT, needs_warmup

AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n"
NO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"


@pytest.mark.parametrize(
    ("role", "dtype", "cpu", "want"),
    [
        ("consumer", "bfloat16", AMX, True),
        ("both", "bfloat16", AMX, True),
        ("producer", "bfloat16", AMX, False),  # its first forward is its own prefill
        ("plain", "bfloat16", AMX, False),
        ("consumer", "float32", AMX, False),  # the AMX kernel is bf16's only
        ("consumer", "bfloat16", NO_AMX, False),
    ],
)
def test_only_decode_engines_with_bf16_kv_on_amx_hosts_warm_up(
    tmp_path: Path, role: str, dtype: str, cpu: str, want: bool
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(cpu)
    assert needs_warmup(role, dtype, str(info)) is want


def test_an_unreadable_cpuinfo_means_no_warm_up(tmp_path: Path) -> None:
    assert needs_warmup("consumer", "bfloat16", str(tmp_path / "missing")) is False


def test_the_warm_up_prompt_fills_no_cache_block() -> None:
    """Shorter than the smallest block the lab uses (16): no prefix-cache entry, no KV
    event for the router to see."""
    assert 0 < len(WARMUP_PROMPT) < 16
