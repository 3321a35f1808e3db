"""The README's two-server recipe, run for real: vLLM's OpenAI servers, a prefill (producer)
and a decode (consumer) instance with the xdc connector and a daemon pair between them. A
completion sent to both at once (the decode first, as a gateway overlapping them does) answers
with the plain engine's tokens, and the prefill's response carries the transfer parameters
the decode side needs."""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from xdc.scheduler.vllm_metrics import parse_metrics
from xdc.transport.launcher import DaemonProcess, free_port, local_pair_config

from tests.router_rig import RouterRig
from tests.vllm_fixtures import Engine, VllmServer, need_vllm, prompt

pytestmark = pytest.mark.vllm


def _scraped(rig: RouterRig) -> list[dict[str, Any]]:
    nodes = rig.state()["nodes"]
    rows = nodes if isinstance(nodes, list) else nodes.get("pd", [])
    return [r for r in rows if r.get("name") in ("vllm-p", "vllm-d")]


def test_two_openai_servers_with_xdc_between_them_answer_like_one() -> None:
    need_vllm()
    wd = Path(tempfile.mkdtemp(prefix="xdc-vllm-http-"))
    tx_cfg, rx_cfg, _ = local_pair_config(
        wd, connections=2, send_pool=64 << 20, recv_pool=128 << 20
    )
    daemons: list[DaemonProcess] = []
    servers: list[VllmServer] = []
    reference: Engine | None = None
    try:
        for kind, cfg in (("receiver", rx_cfg), ("sender", tx_cfg)):
            d = DaemonProcess(kind, cfg, wd)
            daemons.append(d)
            d.wait_ready()
        prefill = VllmServer(
            "producer", free_port(), core=0, extra={"sender_socket": tx_cfg.sender.control_socket}
        )
        servers.append(prefill)
        decode = VllmServer(
            "consumer",
            free_port(),
            core=1,
            extra={"receiver_socket": rx_cfg.receiver.control_socket},
        )
        servers.append(decode)
        reference = Engine("plain", core=1, wait=False)  # starts beside the servers
        prefill.wait_ready()
        decode.wait_ready()
        reference.wait_ready()
        for server in servers:  # the engine core was forked, not spawned (api_server says why)
            kids = [" ".join(k.cmdline()) for k in psutil.Process(server.proc.pid).children()]
            assert len(kids) == 1 and "multiprocessing" not in kids[0], kids
        for n in (64, 600):
            ids = prompt(n, seed=500 + n)
            rid = f"http-{n}-{uuid.uuid4().hex[:6]}"
            answer: dict[str, Any] = {}

            def ask_decode(
                ids: list[int] = ids, rid: str = rid, n: int = n, into: dict[str, Any] = answer
            ) -> None:
                kv = {"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": n}
                into.update(decode.complete(ids, 8, kv))

            t = threading.Thread(target=ask_decode)
            t.start()
            pre = prefill.complete(ids, 1, {"do_remote_decode": True, "xdc_rid": rid})
            t.join(120)
            kvp = pre["kv_transfer_params"]
            assert kvp["do_remote_prefill"] is True, pre
            assert (kvp["xdc_rid"], kvp["xdc_num_tokens"]) == (rid, n), pre
            got = answer["choices"][0]["token_ids"]
            want = reference.generate([ids], None, 8)[0]["token_ids"]
            assert got == want, (n, got, want)
            assert f"request {rid} delivered" in daemons[1].log()
        # the router takes node load from the engines' own /metrics
        with RouterRig() as rig:
            rig.start(
                "",
                vllm_metrics=(
                    f"pd/vllm-d@decode=http://127.0.0.1:{decode.port}/metrics",
                    f"pd/vllm-p@prefill=http://127.0.0.1:{prefill.port}/metrics",
                ),
                vllm_metrics_interval_s=0.2,
            )
            rig.wait_for(lambda: len(_scraped(rig)) == 2, timeout=10)
            rows = {r["name"]: r for r in _scraped(rig)}
            assert rows["vllm-p"]["healthy"] is True and rows["vllm-p"]["queue_depth"] == 0, rows
            assert rows["vllm-d"]["healthy"] is True and "decode_load" in rows["vllm-d"], rows
            # a decode whose KV is still to come holds no KV blocks (admit = "complete"),
            # so the engine's KV usage misses it; its count of deferred requests does not
            ids = prompt(300, seed=590)
            late: dict[str, Any] = {}
            kv = {"do_remote_prefill": True, "xdc_rid": f"never-{uuid.uuid4().hex[:6]}"}
            kv |= {"xdc_num_tokens": len(ids), "xdc_arrival_s": 6}
            waiter = threading.Thread(target=lambda: late.update(decode.complete(ids, 2, kv)))
            waiter.start()
            try:
                rig.wait_for(
                    lambda: any(
                        r["name"] == "vllm-d" and r["decode_load"] > 0 for r in _scraped(rig)
                    ),
                    timeout=5,
                )
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{decode.port}/metrics", timeout=10
                ) as r:
                    held = parse_metrics(r.read().decode())
                # waiting, but deferred: no prefill backlog (load_report's queue_depth)
                assert (held.waiting, held.deferred, held.kv_usage) == (1, 1, 0.0), held
            finally:
                waiter.join(60)
            why = (late.get("kv_transfer_params") or {}).get("xdc_recomputed")
            assert why == "never_arrived", late
        # the prompt-length histogram the drift estimator prices each bucket with
        with urllib.request.urlopen(f"http://127.0.0.1:{prefill.port}/metrics", timeout=10) as r:
            load = parse_metrics(r.read().decode())
        assert load.prompt_buckets and math.isinf(load.prompt_buckets[-1][0]), load
        assert load.prompt_buckets[-1][1] == load.prefill_count > 0, load
    finally:
        if reference is not None:
            reference.close()
        for s in servers:
            s.close()
        for d in daemons:
            d.stop()
        shutil.rmtree(wd, ignore_errors=True)
