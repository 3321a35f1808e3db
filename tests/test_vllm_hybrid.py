"""A hybrid-attention model (Qwen3-Next shape: gated-delta-net linear attention beside full
attention) with the xdc connector on real vLLM CPU engines (issue 27, first step).

Before, vLLM turned its hybrid memory allocator off for a connector without SupportsHMA and
the engine died at start-up in unify_hybrid_kv_cache_specs. Now both roles start; until the
connector moves every KV cache group and the linear-attention state, a hybrid request is
served locally (the producer starts no transfer, the consumer prefills itself, with a reason)
and its tokens are the plain engine's."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

from xdc.transport.launcher import DaemonProcess, local_pair_config

from tests.vllm_fixtures import Engine, hybrid_model, need_vllm, prompt


def test_a_hybrid_model_starts_with_the_connector_and_serves_locally_with_the_plain_tokens():
    need_vllm()
    wd = Path(tempfile.mkdtemp(prefix="xdc-hybrid-"))
    tx_cfg, rx_cfg, _ = local_pair_config(wd, connections=2)
    daemons = [DaemonProcess("receiver", rx_cfg, wd)]
    daemons[0].wait_ready()
    daemons.append(DaemonProcess("sender", tx_cfg, wd))
    daemons[1].wait_ready()
    model = hybrid_model()
    engines: list[Engine] = []
    try:
        producer = Engine(
            "producer", core=0, sender_socket=tx_cfg.sender.control_socket, model=model
        )
        engines.append(producer)
        consumer = Engine(
            "consumer",
            core=1,
            receiver_socket=rx_cfg.receiver.control_socket,
            extra={"arrival_timeout_s": 4.0},
            model=model,
        )
        engines.append(consumer)
        plain = Engine("plain", core=1, model=model)
        engines.append(plain)
        for n in (20, 300):
            p = prompt(n, seed=2700 + n)
            rid = f"hybrid-{n}-{uuid.uuid4().hex[:6]}"
            consumer.submit([p], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": n}])
            made = producer.generate([p], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
            got = consumer.result()[0]["token_ids"]
            assert got == plain.generate([p], None, 8)[0]["token_ids"], n
            assert made[0]["kv_transfer_params"] is None  # no transfer was started
        assert "a hybrid model's KV is not carried yet" in consumer.log()
        assert "delivered" not in daemons[1].log()
    finally:
        for e in engines:
            e.close()
        for d in daemons:
            d.stop()
