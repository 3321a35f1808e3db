"""Hybrid-attention models through xdc on real vLLM CPU engines (issue 27): a Qwen3-Next-shaped
model (gated-delta-net linear attention beside full attention) whose linear-attention state
(conv and recurrent state) moves beside the full-attention blocks.

The reference splits the prompt as xdc does. vLLM's CPU gated-delta-net runs only in bf16, and
there its tokens depend on where a prefill is cut into chunks: a plain engine prefilling a
33-token prompt in one step decodes other tokens than one prefilling 32 and then 1 (seen:
[806, 791, 990, ...] against [806, 431, 569, ...]). That is rounding, not a misread (as
MLA's rotary kernel was, test_vllm_mla.py): the producer's bytes for a 97-token prompt cut
every 32 tokens against uncut differ by at most 0.074 on values up to 4.2 (median 1.3e-2
relative, bf16's step), and cut every 64 tokens they are the same bytes (2026-12-01).
xdc's producer prefills all but the last token (a state can not be rewound; blocks.py) in
chunks of ``CHUNK`` and the decode computes the last one, so the reference is a plain engine
with the same chunk budget and the prompts are ``CHUNK * k + 1`` tokens long: both cut the
prompt at the same places, and the tokens must be equal, token for token.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator

import pytest
from xdc.transport.engine_client import DecodeClient
from xdc.transport.launcher import DaemonProcess

from tests.vllm_fixtures import (
    Engine,
    KvPair,
    hybrid_model,
    hybrid_sizes,
    kv_pair,
    prompt,
    start_engines,
)

pytestmark = pytest.mark.vllm

CHUNK = 32  # the producer's and the reference's prefill budget per step
# vLLM raises the attention block to fit the state's page: 160 tokens where the recurrent
# state is float32 (conv 3 x 512 bf16 + recurrent 4 x 64 x 64 fp32 = 68,608 bytes a layer;
# 160 tokens x 2 KV heads x (64 K + 64 V) x 2 bytes = 81,920), 96 where it is bf16: hosts
# differ (hybrid_sizes). A prefill budget of whole blocks on either: 480 tokens.
WHOLE_BLOCKS = 480
# Every hybrid engine here on one core and thread (serve.bind_to_core), the references too:
# unbound, a producer prefilling beside a consumer that spins while it waits ran 1,025 tokens
# past the consumer's 30 s wait on a host without AVX512-BF16 (alone: 1.4 s)
BOUND = {"bind": True}


@pytest.fixture(scope="module")
def hy() -> Iterator[KvPair]:
    """Chunked prefill at CHUNK tokens on every engine: a consumer that recomputes locally
    cuts the prompt as the reference does."""
    with kv_pair(
        hybrid_model(), engine={"max_num_batched_tokens": CHUNK, **BOUND}, orphan_grace_s=2.0
    ) as made:
        yield made


@pytest.mark.parametrize("n", [CHUNK + 1, 10 * CHUNK + 1, 32 * CHUNK + 1])
def test_hybrid_decode_tokens_equal_a_plain_run(hy: KvPair, n: int) -> None:
    """33 tokens (less than one 160-token attention block), 321 (two blocks and a bit, ten
    prefill steps), 1025 (seven blocks, 32 steps): the decode's tokens are the plain run's, the
    KV and the state moved through xdc, and the transfer is what the groups need: a state per
    linear-attention layer and the blocks of the 2 full-attention layers, nothing more."""
    ids = prompt(n, seed=2700 + n)
    got, made, rid = hy.pair(ids)
    assert got["token_ids"] == hy.want(ids), n
    assert made["kv_transfer_params"]["xdc_num_tokens"] == n  # the whole prompt, for the gateway
    bs, state_bytes, attn_bytes = hybrid_sizes(hy.consumer.log())
    blocks = -(-(n - 1) // bs)  # the decode computes the last token itself
    kv = 2 * state_bytes + 2 * blocks * attn_bytes
    assert hy.delivered_bytes(rid) == kv + (2 + 2 * blocks + 1) * 8  # the block and prompt digests
    assert "prefilling it locally" not in hy.consumer.log()


def test_another_requests_state_and_kv_are_refused_and_recomputed(hy: KvPair) -> None:
    """The consumer is handed the state and KV the producer made for prompt b of the same
    length under prompt a's transfer id (a valid transfer of the wrong bytes): the prompt's
    digest differs and it recomputes a with the plain run's tokens. (That the state does
    change the tokens: the zeroed-state test below.)"""
    a, b = prompt(10 * CHUNK + 1, seed=1), prompt(10 * CHUNK + 1, seed=2)
    got, _, rid = hy.pair(a, made_from=b)
    hy.delivered_bytes(rid)
    assert got["token_ids"] == hy.want(a)
    assert "made from another prompt" in hy.consumer.log(), hy.consumer.log()[-3000:]


def test_a_zeroed_state_changes_the_tokens(hy: KvPair) -> None:
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
        bind=True,
    )
    try:
        ids = prompt(10 * CHUNK + 1, seed=3)
        got, _, rid = hy.pair(ids, consumer=zero)
        hy.delivered_bytes(rid)
        assert got["token_ids"] != hy.want(ids)
    finally:
        zero.close()


def test_a_dense_consumer_refuses_a_hybrid_transfer_and_recomputes(hy: KvPair) -> None:
    """The layout covers every group: a decode instance of another model (the dense test
    Llama) never takes the hybrid producer's bytes; the receiver refuses the hand-over and
    the decode prefills locally, with the dense model's own plain tokens."""
    dense, plain = start_engines(
        (
            "consumer",
            {
                "core": 1,
                "receiver_socket": hy.rx_sock,
                "extra": {"arrival_timeout_s": 4.0, "timeout_s": 20.0},
            },
        ),
        ("plain", {"core": 1}),
    )
    try:
        ids = prompt(10 * CHUNK + 1, seed=4)
        got, _, rid = hy.pair(ids, consumer=dense)
        assert got["token_ids"] == plain.generate([ids], None, 8)[0]["token_ids"]
        log = dense.log()
        assert f"transfer {rid}" in log and "layout" in log.lower(), log[-3000:]
    finally:
        dense.close()
        plain.close()


def test_the_sender_killed_mid_transfer_means_local_recompute(hy: KvPair) -> None:
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
            if rid in c.status()["requests"]:
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
    # Right after the restart, the producer's first admission (a fresh connection, a 1 s
    # budget) may refuse on a loaded machine: the answer then says so (xdc_failed) and the
    # decode recomputes, token-equal. The new sender must serve one of the next transfers.
    refused: list[str] = []
    for seed in (6, 7, 8):
        again = prompt(10 * CHUNK + 1, seed=seed)
        got2, made, rid2 = hy.pair(again)
        assert got2["token_ids"] == hy.want(again)
        why = (made.get("kv_transfer_params") or {}).get("xdc_failed")
        if why is None:
            break
        assert why in ("sender_down", "peer_unreachable"), why
        refused.append(why)
    assert len(refused) < 3, f"the restarted sender served nothing: {refused}"
    hy.delivered_bytes(rid2)


@pytest.fixture(scope="module")
def hy_cached() -> Iterator[KvPair]:
    """Prefix caching on the producer, the consumer and the reference (vLLM keeps the state
    position by position then, 'align' mode, and prefills in whole blocks)."""
    engine = {"max_num_batched_tokens": WHOLE_BLOCKS, "prefix_caching": True, **BOUND}
    with kv_pair(hybrid_model(), engine=engine) as made:
        yield made


def test_prefix_caching_on_both_sides_moves_the_state_of_the_whole_prompt(
    hy_cached: KvPair,
) -> None:
    """A prompt, one that shares its first two blocks, and the first again: the producer
    serves the later ones partly from its prefix cache (it says how many tokens) and still
    sends the state after its last computed token; the consumer fills only what its own
    cache lacks. Every decode equals the plain engine's, which saw the same prompts."""
    bs = hybrid_sizes(hy_cached.consumer.log())[0]
    a = prompt(3 * bs + 1, seed=40)
    b = a[: 2 * bs] + prompt(2 * bs + 1, seed=41)
    cached = []
    for ids in (a, b, a):
        got, made, rid = hy_cached.pair(ids)
        assert got["token_ids"] == hy_cached.want(ids)
        hy_cached.delivered_bytes(rid)
        cached.append(made["kv_transfer_params"].get("remote_prefill_cached_tokens", 0))
    assert cached[0] == 0 and cached[1] >= 2 * bs and cached[2] > 0, cached
    assert "prefilling it locally" not in hy_cached.consumer.log()
