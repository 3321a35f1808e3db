"""One offline vLLM engine driven line by line: what tests and benchmarks use to run a real
prefill or decode instance with the xdc connector in a process of its own.

    python -m xdc.lab.vllm_offline --model DIR --role producer --sender-socket S

It prints ``{"ready": ...}`` once the engine is up, then answers each JSON line on stdin
``{"prompts": [[ids...]], "params": [kv_transfer_params | null], "max_tokens": n}`` with
``{"outputs": [{"token_ids": [...], "kv_transfer_params": ..., "seconds": t,
"num_cached_tokens": n}]}`` (greedy).
``--role plain`` runs without a connector (the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from xdc.integrations.vllm.serve import WARMUP_PROMPT, bind_to_core, needs_warmup


def build(a: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if a.role != "plain":
        extra: dict[str, Any] = {}
        if a.sender_socket:
            extra["sender_socket"] = a.sender_socket
        if a.receiver_socket:
            extra["receiver_socket"] = a.receiver_socket
        extra.update(json.loads(a.extra or "{}"))
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="XdcConnector",
            kv_connector_module_path="xdc.integrations.vllm.connector",
            kv_role={"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}[
                a.role
            ],
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
        kw["enable_chunked_prefill"] = True
    if a.num_blocks:
        kw["num_gpu_blocks_override"] = a.num_blocks
    if a.attention_backend:
        kw["attention_backend"] = a.attention_backend
    if a.custom_ops:
        kw["compilation_config"] = {"custom_ops": a.custom_ops.split(",")}
    if a.tensor_parallel_size > 1:
        # one worker process per rank, each with its shard of the KV heads (and its own
        # connector worker): what a GPU deployment of a large model runs
        kw["tensor_parallel_size"] = a.tensor_parallel_size
        kw["distributed_executor_backend"] = "mp"
    return LLM(
        model=a.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=a.dtype,
        block_size=a.block_size,
        max_model_len=a.max_model_len,
        enable_prefix_caching=a.prefix_caching,
        seed=0,
        **kw,
    )


ABORTED = "xdc-lab: aborted-0 aborted, its blocks are free"


def _sampling(job: dict[str, Any], p: dict[str, Any] | None) -> Any:
    """Greedy, token ids only, with the request's ``kv_transfer_params`` if it has any."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=int(job.get("max_tokens", 8)),
        temperature=0.0,
        detokenize=False,
        extra_args={"kv_transfer_params": p} if p else None,
    )


def _params(job: dict[str, Any]) -> list[Any]:
    return list(job.get("params") or [None] * len(job["prompts"]))


def _step_until_done(eng: Any, job: dict[str, Any], t0: float) -> dict[str, dict[str, Any]]:
    """Step the engine until no request is left or the job's time is up: each finished
    request's tokens, answer params and finish time (seconds from ``t0``), by request id."""
    done: dict[str, dict[str, Any]] = {}
    deadline = t0 + float(job.get("timeout_s", 120))
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = {
                    "token_ids": list(out.outputs[0].token_ids),
                    "kv_transfer_params": out.kv_transfer_params,
                    "seconds": round(time.monotonic() - t0, 4),
                }
        time.sleep(float(job.get("step_sleep_s", 0)))
    return done


def abort_then_run(llm: Any, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Add the first prompt, step the engine ``abort_first_after_steps`` times, abort it
    (its blocks go back to vLLM's free list), then run the other prompts to the end: what a
    client that gives up on a request waiting for its KV does to the engine's blocks."""
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    prompts, params = job["prompts"], _params(job)
    eng.add_request(
        "aborted-0", TokensPrompt(prompt_token_ids=prompts[0]), _sampling(job, params[0])
    )
    for _ in range(int(job["abort_first_after_steps"])):
        eng.step()
    eng.abort_request(["aborted-0"])
    print(ABORTED, flush=True)  # a rig waits for this line before it lets the KV arrive
    for i, (ids, p) in enumerate(zip(prompts[1:], params[1:], strict=True)):
        eng.add_request(f"after-{i}", TokensPrompt(prompt_token_ids=ids), _sampling(job, p))
    done = _step_until_done(eng, job, time.monotonic())
    return [
        {"token_ids": done.get(f"after-{i}", {}).get("token_ids", [])}
        for i in range(len(prompts) - 1)
    ]


def run_together(llm: Any, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Add every prompt at once and step the engine until all are done (``generate`` runs
    one prompt after another): what a decode instance serving several requests does. Each
    output says when it finished, in seconds from the job's start."""
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    prompts, params = job["prompts"], _params(job)
    t0 = time.monotonic()
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"together-{i}", TokensPrompt(prompt_token_ids=ids), _sampling(job, p))
    done = _step_until_done(eng, job, t0)
    return [done.get(f"together-{i}", {"token_ids": []}) for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=["plain", "producer", "consumer", "both"], default="plain")
    ap.add_argument("--sender-socket", default="")
    ap.add_argument("--receiver-socket", default="")
    ap.add_argument("--extra", default="", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="KV cache blocks (0 = as the memory allows): a small pool makes freed blocks "
        "go to the next request at once",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is split over (the CPU build binds one to each core named in "
        "VLLM_CPU_OMP_THREADS_BIND, as '0|1')",
    )
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="float32 decodes the same after a full prefill and a prefix-cache hit (bf16 on "
        "the CPU build does not): what a differential test needs",
    )
    ap.add_argument(
        "--attention-backend",
        choices=["", "CPU_MLA"],
        default="",
        help="CPU_MLA: vLLM's reference MLA backend also on a host with AMX, whose AMX MLA "
        "backend takes bf16 only (default: the one vLLM picks)",
    )
    ap.add_argument(
        "--custom-ops",
        default="",
        help="vLLM custom-op switches (compilation_config.custom_ops), comma-separated: "
        "'-rotary_embedding' rotates with PyTorch ops instead of the CPU build's kernel, which "
        "misreads MLA's per-head slices (tests/integrations/test_vllm_mla.py)",
    )
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    bind_to_core()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if os.environ.get("XDC_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["XDC_SWITCH_INTERVAL"]))
    t0 = time.monotonic()
    llm = build(a)
    if needs_warmup(a.role, a.dtype):
        llm.generate(
            [TokensPrompt(prompt_token_ids=WARMUP_PROMPT)],
            SamplingParams(max_tokens=1, temperature=0),
            use_tqdm=False,
        )
    print(json.dumps({"ready": round(time.monotonic() - t0, 2)}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if "abort_first_after_steps" in job:
            print(json.dumps({"outputs": abort_then_run(llm, job)}), flush=True)
            continue
        if job.get("together"):
            print(json.dumps({"outputs": run_together(llm, job)}), flush=True)
            continue
        outs = []
        for ids, p in zip(job["prompts"], _params(job), strict=True):
            t = time.monotonic()
            (res,) = llm.generate(
                [TokensPrompt(prompt_token_ids=ids)], _sampling(job, p), use_tqdm=False
            )
            outs.append(
                {
                    "token_ids": list(res.outputs[0].token_ids),
                    "kv_transfer_params": res.kv_transfer_params,
                    "seconds": round(time.monotonic() - t, 4),
                    # prompt tokens vLLM found in its prefix cache (or a connector loaded)
                    "num_cached_tokens": res.num_cached_tokens,
                }
            )
        print(json.dumps({"outputs": outs}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
