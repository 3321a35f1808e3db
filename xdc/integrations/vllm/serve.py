"""How to start vLLM's OpenAI server with the xdc connector (argv and environment), shared by
``xdc up`` and the tests so both run the recipe the README gives.

``vllm serve`` does not start from the CPU wheel's venv here, so it is
``python -m vllm.entrypoints.openai.api_server``, through ``xdc.integrations.vllm.api_server``
(the same server, its engine core forked instead of spawned: ready in ~17 s instead of ~30).

Roles: ``plain`` (no connector), ``producer`` (prefill instance: its blocks go to the local
xdc sender), ``consumer`` (decode instance: blocks arrive from the local xdc receiver;
without transfer parameters it prefills and decodes itself, so one instance serves both PD
roles).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


@dataclass
class ServerSpec:
    python: str
    model: str
    port: int
    host: str = "127.0.0.1"
    role: str = "plain"  # plain | producer | consumer | both
    served_name: str = ""
    block_size: int = 32
    max_model_len: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    tokenizer: bool = False  # False: --skip-tokenizer-init (token-id prompts only)
    prefix_caching: bool = True
    kv_events_port: int = 0  # >0: publish KV events on tcp://*:port (replay on port + 1)
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0  # requests running at once (0: vLLM's default)
    # bfloat16, or float32: a long prompt then decodes the same after a full prefill and
    # after a prefix-cache hit (bf16 on the CPU build does not), what a token-by-token
    # comparison with a plain engine needs
    dtype: str = "bfloat16"
    # KV cache blocks (0 = as VLLM_CPU_KVCACHE_SPACE allows): a small pool reuses freed
    # blocks at once and evicts cached prefixes, which tests want to provoke
    num_blocks: int = 0

    def argv(self) -> list[str]:
        args = [
            self.python,
            # vLLM's server, its engine core forked rather than spawned (api_server says why)
            *("-m", "xdc.integrations.vllm.api_server"),
            *("--model", self.model, "--host", self.host, "--port", str(self.port)),
            *("--enforce-eager", "--dtype", self.dtype, "--seed", "0"),
            # one rank: the engine core process is the worker too (see server_env)
            *("--distributed-executor-backend", "uni"),
            *("--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len)),
        ]
        if self.served_name:
            args += ["--served-model-name", self.served_name]
        if not self.tokenizer:
            args.append("--skip-tokenizer-init")
        args.append(
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"
        )
        if self.num_blocks:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_events_port:
            ev = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_events_port}",
                "replay_endpoint": f"tcp://*:{self.kv_events_port + 1}",
            }
            args += ["--kv-events-config", json.dumps(ev)]
        if self.role != "plain":
            kv = {
                "kv_connector": "XdcConnector",
                "kv_connector_module_path": "xdc.integrations.vllm.connector",
                "kv_role": ROLES[self.role],
                "kv_connector_extra_config": self.extra,
                "kv_load_failure_policy": "recompute",
            }
            args += ["--kv-transfer-config", json.dumps(kv)]
        return args


# vLLM's CPU attention splits a long context into parts for short queries (on by default).
# Seen on an AMX host (2026-11-28): with it on, a 673-token prompt decoded other tokens from
# the 4th on after a prefix-cache hit (672 tokens cached, a 1-token query) than after its own
# full prefill, with no xdc involved; a decode fed by a connector takes that path too. With
# it off, both decoded alike. A decode must not depend on where its prefix was computed (the
# differential tests check token equality; cache-aware routing assumes it), so the CPU
# engines xdc starts turn it off.
SPLIT_KV = "0"


def bound_core(env: Mapping[str, str]) -> int | None:
    """The core an engine started with ``env`` binds to: the one ``VLLM_CPU_OMP_THREADS_BIND``
    names, where ``OMP_NUM_THREADS`` is 1 (``server_env(..., bind=True)``); else None."""
    spec = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if env.get("OMP_NUM_THREADS") != "1" or not spec.isdecimal() or int(spec) >= 4096:
        return None
    return int(spec)


def bind_to_core() -> None:
    """Run this process on the one core ``VLLM_CPU_OMP_THREADS_BIND`` names, with one torch
    thread: what that variable promises but vLLM 0.32 does only in its multiprocessing
    executor (``OMPProcessManager``), not for the one-rank engines xdc starts (``uni``), where
    torch keeps a thread per host core, unbound, and vLLM's worker then refuses
    ``torch.set_num_threads``. Two such engines busy at once (a producer prefilling while its
    consumer decodes; a differential test's two references) ran four spinning OpenMP threads
    on two cores: a 1,025-token hybrid prefill took 1.2 s alone and 28 s beside the other
    engine's; bound, 1.4 s and 1.7 s (2026-11-30, 2-core VM). For the lab's offline engines,
    before vLLM builds; servers get ``server_env`` and ``core_binding``.

    Bound engines may decode bf16 differently from unbound ones (seen on an AMD EPYC host: a
    dense 700-token prompt prefilled in 128-token steps and at once decoded alike unbound,
    not bound), so a token comparison binds both sides or neither: ``xdc up`` binds the
    hybrid model's engines (``TestModel.bind``) and the differential test's references for
    it; the others keep vLLM's own behaviour."""
    core = bound_core(os.environ)
    if core is None:
        return
    _bind(core)
    import torch

    torch.set_num_threads(1)


def core_binding(env: Mapping[str, str]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that binds a server started with ``env`` to its one core (None when
    ``env`` names none): what it starts inherits the mask."""
    core = bound_core(env)
    return None if core is None else functools.partial(_bind, core)


def _bind(core: int) -> None:
    with contextlib.suppress(OSError):  # a core outside this process's mask: left unbound
        os.sched_setaffinity(0, {core})


def server_env(
    core: int | None, base: dict[str, str] | None = None, *, bind: bool = False
) -> dict[str, str]:
    """CPU vLLM's environment: 1 GiB of KV cache, ``VLLM_CPU_OMP_THREADS_BIND`` set to
    ``core`` (which vLLM 0.32 ignores for one rank); ``bind``: one OpenMP thread, and the
    caller starts the server with ``core_binding`` (``bind_to_core`` says why); with a core
    but no ``bind``, no ``OMP_NUM_THREADS`` from ``base``: vLLM's own threads.

    The OpenAI server always runs its engine core in a process of its own. With
    multiprocessing on, the CPU build starts the one worker in a third process (it turns
    ``--distributed-executor-backend uni`` into ``mp``); off, the engine core process runs
    the worker itself, pinned as asked. Each spawned process imports torch and vLLM (~10 s
    of one core here), so a server is up sooner: 27.3 s against 36.8 s, alone on this 2-core
    host, and one process fewer when three start side by side (``xdc up``); api_server forks
    the engine core, which saves the second import too."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        TOKENIZERS_PARALLELISM="false",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        VLLM_CPU_ATTN_SPLIT_KV=env.get("VLLM_CPU_ATTN_SPLIT_KV", SPLIT_KV),
    )
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        if bind:
            env["OMP_NUM_THREADS"] = "1"  # torch's pool at import (bind_to_core says why)
        else:  # a caller's OMP_NUM_THREADS=1 would bind it all the same (bound_core)
            env.pop("OMP_NUM_THREADS", None)
    return env


# A prompt shorter than a block: it fills no cache block, so it leaves no KV event and no
# prefix-cache entry behind.
WARMUP_PROMPT = list(range(1, 9))


def warmup_body(model: str) -> str:
    """The OpenAI completion request that prefills WARMUP_PROMPT once (see needs_warmup)."""
    return json.dumps({"model": model, "prompt": WARMUP_PROMPT, "max_tokens": 1})


def needs_warmup(role: str, dtype: str = "bfloat16", cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether a CPU-build engine in this role must prefill once locally before it serves a
    load from xdc.

    vLLM 0.32's CPU attention picks its AMX kernel for bf16 KV on a host with AMX (Intel
    Sapphire Rapids and later). Seen on such a host (2026-11-28, Firecracker VM, torch
    2.13.0, ``amx_tile`` in cpuinfo): a decode engine whose first forward ever is for a
    request whose KV was loaded by a connector dies of SIGILL in
    ``cpu_attention_with_kv_cache``; one local prefill first and the same request decodes
    right, token for token. A vLLM issue, not the connector's (the loaded bytes are
    verified equal), and one a GPU engine does not have: the lab engines and ``xdc up``
    prefill WARMUP_PROMPT once where it applies."""
    if role not in ("consumer", "both") or dtype != "bfloat16":
        return False
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False
