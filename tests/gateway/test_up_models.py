"""What ``xdc up`` needs to serve each test model, without engines: the block size the router
hashes by comes from the engines' own metrics, the engines are bound to one core each
(vLLM 0.32 does not, for one-rank engines), the hybrid model's rules (bf16, one request at a
time in fixed chunks) reach the engines, and the differential workload keeps a hybrid
prompt's cuts where a plain engine makes them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xdc.gateway.up import HYBRID_CHUNK, MODELS, LocalSystem, UpError, UpOptions, cache_block_size
from xdc.integrations.vllm.serve import ServerSpec, bound_core, core_binding, server_env
from xdc.lab.differential import compared, make_workload, model_run
from xdc.lab.vllm_rig import vllm_env

# the line vLLM 0.32's OpenAI server printed for the hybrid test model (shortened), with the
# fields that end in "block_size" beside the one that counts
VLLM_LINE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="96",cache_dtype="auto",'
    'effective_attention_block_size="96",hash_block_size="None",mamba_block_size="96",'
    'mamba_cache_mode="align",num_gpu_blocks="10922"} 1.0'
)


def test_the_block_size_is_read_from_vllms_cache_config_metric() -> None:
    text = f"# HELP vllm:cache_config_info Information\n{VLLM_LINE}\nvllm:num_requests 0\n"
    assert cache_block_size(text) == 96
    assert cache_block_size(VLLM_LINE.replace('block_size="96"', 'block_size="32"', 1)) == 32


@pytest.mark.parametrize(
    "text",
    [
        "",
        "vllm:num_requests_running 0\n",
        'vllm:cache_config_info{hash_block_size="16",mamba_block_size="96"} 1.0',
        'vllm:cache_config_info{block_size="0"} 1.0',
        'vllm:cache_config_info{block_size="99999999"} 1.0',
        '# vllm:cache_config_info{block_size="32"} 1.0',
    ],
)
def test_metrics_without_a_usable_block_size_give_none(text: str) -> None:
    assert cache_block_size(text) is None


@pytest.mark.parametrize(
    ("spec", "core"), [("1", 1), ("0", 0), ("0|1", None), ("auto", None), ("", None), ("-1", None)]
)
def test_only_a_single_named_core_is_bound_and_only_with_one_thread(
    spec: str, core: int | None
) -> None:
    """'0|1' binds tensor-parallel ranks (vLLM's executor does that itself); 'auto' and
    'nobind' are vLLM's own modes; without OMP_NUM_THREADS=1 an engine is left as vLLM
    leaves it (the lab's unbound engines)."""
    assert bound_core({"VLLM_CPU_OMP_THREADS_BIND": spec, "OMP_NUM_THREADS": "1"}) == core
    assert bound_core({"VLLM_CPU_OMP_THREADS_BIND": spec}) is None
    assert bound_core({"VLLM_CPU_OMP_THREADS_BIND": spec, "OMP_NUM_THREADS": "2"}) is None


def test_a_server_started_with_a_core_runs_on_it_with_one_thread() -> None:
    env = server_env(0, base={"PATH": "/usr/bin:/bin"}, bind=True)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["OMP_NUM_THREADS"] == "1"
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=core_binding(env),
        check=True,
    ).stdout
    assert out.strip() == "[0]"
    for unbound in (
        server_env(None, base={"PATH": "/usr/bin:/bin"}, bind=True),
        server_env(0, base={"PATH": "/usr/bin:/bin"}),
        server_env(0, base={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}),
    ):
        assert "OMP_NUM_THREADS" not in unbound and core_binding(unbound) is None


def test_a_lab_engine_is_bound_only_when_asked_whatever_the_session_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lab's engines share serve.server_env: a test session's OMP_NUM_THREADS=1 must not
    bind an engine that was not asked to be (nor a session's KV cache space grow it)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    unbound, bound = vllm_env(1), vllm_env(1, bind=True)
    assert bound_core(unbound) is None and "OMP_NUM_THREADS" not in unbound
    assert bound_core(bound) == 1
    assert unbound["VLLM_CPU_KVCACHE_SPACE"] == bound["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_the_hybrid_models_rules_reach_the_engines_command_line() -> None:
    m = MODELS["hybrid"]
    argv = ServerSpec(
        "python", "/m", 8100, max_num_batched_tokens=m.chunk, max_num_seqs=m.max_num_seqs
    ).argv()
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(HYBRID_CHUNK)
    assert argv[argv.index("--max-num-seqs") + 1] == "1"
    assert "--max-num-seqs" not in ServerSpec("python", "/m", 8100).argv()


def test_the_hybrid_model_in_float32_is_refused_before_anything_starts() -> None:
    with pytest.raises(UpError, match="hybrid model runs in bfloat16"):
        LocalSystem(UpOptions(model="hybrid", dtype="float32"))
    with pytest.raises(UpError, match="is not one of"):
        LocalSystem(UpOptions(model="mamba"))


def test_a_hybrid_workload_cuts_every_prompt_where_a_plain_engine_does() -> None:
    """Every prompt the engines take is k * HYBRID_CHUNK + 1 tokens, on both sides of the
    router's threshold; unaligned (the dense and sliding runs), lengths fall anywhere."""
    run = model_run("hybrid")
    assert (run.dtype, run.align, run.chunk) == ("bfloat16", HYBRID_CHUNK, HYBRID_CHUNK)
    assert run.bind and not model_run("dense").bind  # bound as xdc up binds its engines
    assert model_run("dense").dtype == "float32" and model_run("sliding").align == 1
    waves = make_workload(26, 7, 2048, per_wave=3, max_tokens=16, align=run.align)
    taken = [c for w in waves for c in w.cases if not c.refused]
    assert taken and all((len(c.ids) - 1) % HYBRID_CHUNK == 0 for c in taken)
    assert all(len(c.ids) <= 4096 - 16 for c in taken)
    lengths = sorted(len(s) for s in compared(waves))
    assert lengths[0] < 2048 < lengths[-1]  # both sides of the router's threshold
    plain = make_workload(26, 7, 2048, per_wave=3, max_tokens=16)
    assert any((len(c.ids) - 1) % HYBRID_CHUNK for w in plain for c in w.cases)


@pytest.mark.parametrize("align", [0, -32, 129])
def test_a_workload_alignment_out_of_range_is_refused_with_its_value(align: int) -> None:
    with pytest.raises(ValueError, match=f"not {align}"):
        make_workload(26, 1, 2048, align=align)
