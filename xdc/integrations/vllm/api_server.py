"""vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, same flags), with
its engine core process forked from the server instead of spawned.

The OpenAI server always runs its engine core in a process of its own. vLLM's CPU platform
sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unconditionally, so that process starts a fresh
interpreter and imports torch and vLLM again: ready in 30.6 s spawned against 17.3 s forked,
medians of 4 interleaved, the same tokens in all 8; the forked engine's work within the
spawned one's range, its median 5% slower (``bench/vllm_start.py``, 2 cores). Forking is
vLLM's own default where nothing forbids it (a GPU host with CUDA not yet initialised in
the server process). Only with one rank (``--distributed-executor-backend uni``, which
ServerSpec always passes), where the engine core is the only worker and no further process
inherits the choice; with more, the platform's spawn stands: forked rank workers changed
bf16 tokens and ran 1.6x slower (bench/README.md).
``XDC_VLLM_SPAWN_ENGINE_CORE=1`` restores vLLM's own behaviour.

``python -m xdc.integrations.vllm.api_server --help`` is vLLM's own help."""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any


def _fork_one_rank_engine_core() -> None:
    """Where this vLLM has no such hook (another version), its own behaviour, said once."""
    try:
        from vllm.platforms import cpu

        platform = cpu.CpuPlatform
        original = platform.check_and_update_config.__func__  # a classmethod
    except (ImportError, AttributeError) as e:
        print(f"xdc: engine core spawned as vLLM decides ({e!r})", file=sys.stderr)
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        if vllm_config.parallel_config.world_size == 1:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_and_update_config)


def main() -> None:
    if os.environ.get("XDC_VLLM_SPAWN_ENGINE_CORE", "0") != "1":
        _fork_one_rank_engine_core()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
