"""Hybrid-attention models through xdc on real vLLM CPU engines (issue 27): a Qwen3-Next-shaped
model (gated-delta-net linear attention beside full attention) whose linear-attention state
(conv and recurrent state) moves beside the full-attention blocks.

The reference splits the prompt as xdc does. vLLM's CPU gated-delta-net runs only in bf16, and
there its tokens depend on where a prefill is cut into chunks: a plain engine prefilling a
33-token prompt in one step decodes other tokens than one prefilling 32 and then 1 (seen:
[806, 791, 990, ...] against [806, 431, 569, ...]). xdc's producer prefills all but the last
token (a state can not be rewound; blocks.py) in chunks of ``CHUNK`` and the decode computes
the last one, so the reference is a plain engine with the same chunk budget and the prompts
are ``CHUNK * k + 1`` tokens long: both cut the prompt at the same places, and the tokens must
be equal, token for token.
"""

from __future__ import annotations

import re
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from xdc.transport.engine import DecodeClient
from xdc.transport.launcher import DaemonProcess, local_pair_config

from tests.vllm_fixtures import Engine, hybrid_model, need_vllm, prompt
from xdc.config import Config

CHUNK = 32  # the producer's and the reference's prefill budget per step
BLOCK_TOKENS = 160  # vLLM raises the attention block to fit the state's page (bf16)
STATE_BYTES = 68608  # conv (3 x 512 bf16) + recurrent (4 x 64 x 64 fp32) state, per layer
ATTN_BLOCK_BYTES = 81920  # 160 tokens x 2 KV heads x (64 K + 64 V) x 2 bytes


@dataclass
class Hybrid:
    tx: DaemonProcess
    rx: DaemonProcess
    tx_cfg: Config
    rx_sock: str
    workdir: Path
    producer: Engine
    consumer: Engine
    reference: Engine

    def pair(
        self, ids: list[int], *, consumer: Engine | None = None, made_from: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Decode ``ids`` on the consumer with KV the producer makes from ``made_from``
        (default: the same prompt); (consumer output, producer output, rid)."""
        rid = f"hy-{len(ids)}-{uuid.uuid4().hex[:8]}"
        c = consumer or self.consumer
        c.submit([ids], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": len(ids)}])
        made = self.producer.generate(
            [made_from or ids], [{"do_remote_decode": True, "xdc_rid": rid}], 1
        )
        return c.result()[0], made[0], rid

    def want(self, ids: list[int]) -> list[int]:
        return list(self.reference.generate([ids], None, 8)[0]["token_ids"])

    def delivered_bytes(self, rid: str, timeout: float = 10) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(rf"request {re.escape(rid)} delivered: (\d+) bytes", self.tx.log())
            if m:
                return int(m.group(1))
            time.sleep(0.05)
        raise AssertionError(f"{rid} not delivered:\n{self.tx.log()[-2000:]}")


@pytest.fixture(scope="module")
def hy() -> Iterator[Hybrid]:
    need_vllm()
    wd = Path(tempfile.mkdtemp(prefix="xdc-hybrid-"))
    tx_cfg, rx_cfg, _ = local_pair_config(wd, connections=2)
    rx_cfg.receiver.orphan_grace_s = 2.0  # a dead sender's partial request fails fast
    rx = DaemonProcess("receiver", rx_cfg, wd)
    rx.wait_ready()
    tx = DaemonProcess("sender", tx_cfg, wd)
    tx.wait_ready()
    model = hybrid_model()
    engines: list[Engine] = []
    made: Hybrid | None = None
    try:
        producer = Engine(
            "producer",
            core=0,
            sender_socket=tx_cfg.sender.control_socket,
            model=model,
            max_num_batched_tokens=CHUNK,
        )
        engines.append(producer)
        consumer = Engine(
            "consumer",
            core=1,
            receiver_socket=rx_cfg.receiver.control_socket,
            extra={"arrival_timeout_s": 4.0, "timeout_s": 30.0},
            model=model,
            max_num_batched_tokens=CHUNK,  # a local recompute splits as the reference does
        )
        engines.append(consumer)
        reference = Engine("plain", core=1, model=model, max_num_batched_tokens=CHUNK)
        engines.append(reference)
        made = Hybrid(
            tx, rx, tx_cfg, rx_cfg.receiver.control_socket, wd, producer, consumer, reference
        )
        yield made
    finally:
        for e in engines:
            e.close()
        for d in {tx, rx, *((made.tx,) if made is not None else ())}:
            d.stop()


@pytest.mark.parametrize("n", [CHUNK + 1, 10 * CHUNK + 1, 32 * CHUNK + 1])
def test_hybrid_decode_tokens_equal_a_plain_run(hy: Hybrid, n: int) -> None:
    """33 tokens (less than one 160-token attention block), 321 (two blocks and a bit, ten
    prefill steps), 1025 (seven blocks, 32 steps): the decode's tokens are the plain run's, the
    KV and the state moved through xdc, and the transfer is what the groups need: a state per
    linear-attention layer and the blocks of the 2 full-attention layers, nothing more."""
    ids = prompt(n, seed=2700 + n)
    got, made, rid = hy.pair(ids)
    assert got["token_ids"] == hy.want(ids), n
    assert made["kv_transfer_params"]["xdc_num_tokens"] == n  # the whole prompt, for the gateway
    blocks = -(-(n - 1) // BLOCK_TOKENS)  # the decode computes the last token itself
    kv = 2 * STATE_BYTES + 2 * blocks * ATTN_BLOCK_BYTES
    assert hy.delivered_bytes(rid) == kv + (2 + 2 * blocks) * 8  # and the block digests
    assert "prefilling it locally" not in hy.consumer.log()


def test_another_requests_state_and_kv_change_the_tokens(hy: Hybrid) -> None:
    """The equality has teeth: the consumer decodes prompt a from the state and KV the
    producer made for prompt b of the same length (a valid transfer of the wrong bytes)."""
    a, b = prompt(10 * CHUNK + 1, seed=1), prompt(10 * CHUNK + 1, seed=2)
    got, _, rid = hy.pair(a, made_from=b)
    hy.delivered_bytes(rid)
    assert got["token_ids"] != hy.want(a)


def test_a_zeroed_state_changes_the_tokens(hy: Hybrid) -> None:
    """The state alone matters: a consumer that zeroes the linear-attention state after it
    landed (planted fault XDC_CONNECTOR_FAULT=zero_state; the full-attention blocks are
    right) decodes other tokens than the plain run."""
    zero = Engine(
        "consumer",
        core=1,
        receiver_socket=hy.rx_sock,
        extra={"arrival_timeout_s": 4.0, "timeout_s": 30.0},
        model=hybrid_model(),
        max_num_batched_tokens=CHUNK,
        env={"XDC_CONNECTOR_FAULT": "zero_state"},
    )
    try:
        ids = prompt(10 * CHUNK + 1, seed=3)
        got, _, rid = hy.pair(ids, consumer=zero)
        hy.delivered_bytes(rid)
        assert got["token_ids"] != hy.want(ids)
    finally:
        zero.close()


def test_a_dense_consumer_refuses_a_hybrid_transfer_and_recomputes(hy: Hybrid) -> None:
    """The layout covers every group: a decode instance of another model (the dense test
    Llama) never takes the hybrid producer's bytes; the receiver refuses the hand-over and
    the decode prefills locally, with the dense model's own plain tokens."""
    dense = Engine(
        "consumer",
        core=1,
        receiver_socket=hy.rx_sock,
        extra={"arrival_timeout_s": 4.0, "timeout_s": 20.0},
    )
    plain = Engine("plain", core=1)
    try:
        ids = prompt(10 * CHUNK + 1, seed=4)
        got, _, rid = hy.pair(ids, consumer=dense)
        assert got["token_ids"] == plain.generate([ids], None, 8)[0]["token_ids"]
        log = dense.log()
        assert f"transfer {rid}" in log and "layout" in log.lower(), log[-3000:]
    finally:
        dense.close()
        plain.close()


def test_the_sender_killed_mid_transfer_means_local_recompute(hy: Hybrid) -> None:
    """SIGKILL the sender while a hybrid prefill of 64 steps streams its full-attention
    blocks (the state goes only at the end): the decode recomputes with the plain tokens, a
    new sender serves the next transfer. Last in the module: it replaces the sender."""
    ids = prompt(64 * CHUNK + 1, seed=5)
    rid = f"hy-kill-{uuid.uuid4().hex[:6]}"
    n = len(ids)
    hy.consumer.submit([ids], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": n}])
    hy.producer.submit([ids], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
    deadline = time.monotonic() + 60
    while True:  # the transfer has begun: its first blocks are on the way
        with DecodeClient(hy.rx_sock) as c:
            if rid in c.status()["requests"]:  # type: ignore[operator]
                break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    hy.tx.proc.send_signal(signal.SIGKILL)
    hy.tx.proc.wait(10)
    hy.producer.result()
    got = hy.consumer.result()[0]["token_ids"]
    assert got == hy.want(ids)
    assert f"request {rid} delivered" not in hy.tx.log()
    assert f"transfer {rid}" in hy.consumer.log()  # it says why it prefilled locally
    hy.tx = DaemonProcess("sender", hy.tx_cfg, hy.workdir)
    hy.tx.wait_ready()
    again = prompt(10 * CHUNK + 1, seed=6)
    got2, _, rid2 = hy.pair(again)
    assert got2["token_ids"] == hy.want(again)
    hy.delivered_bytes(rid2)
