"""A model split over two tensor-parallel ranks on both sides (real vLLM CPU engines, one
worker process per rank). Each rank holds half of the KV heads and moves its share as a
transfer of its own (``params.shard_rid``: ``rid#rank/ranks``) to the rank of the same number
on the other side; the rank is in the layout string, so a share at the wrong rank is refused.
A hybrid model (half of the KV heads and half of each linear-attention layer's state per
rank), an MLA one (the whole latent per rank), and the hybrid model with one KV head (its
attention KV whole at every rank beside the split state: Kimi Linear's shape, whose latent
vLLM's CPU build can not run); one-rank dense engines are everywhere else.

The decode is sent after the prefill answered (``KvPair.relay``), not beside it: on a 2-core
host a two-rank decode engine that waits for a load keeps its rank workers stepping, and they
starve the two-rank prefill engine's ranks (a plain 700-token prefill took 3.5 s beside an
idle decode engine and 30 s beside a waiting one, until the wait timed out). That is this
host's core count, not the connector: the first version of this support was switched off
for it in e101066, read as a late hand-over."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm_fixtures import KvPair, hybrid_sizes, kv_pair, prompt
from xdc.integrations.vllm.params import shard_rid
from xdc.lab import vllm_rig
from xdc.lab.vllm_rig import Engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

RANKS = 2
# the decode's waits: generous, since two engines of two ranks share two cores
WAITS = {"arrival_timeout_s": 20.0, "timeout_s": 60.0}

CHUNK = 32
# per rank: half of the linear-attention heads' state, one of the two KV heads, as the
# engine reports them (hybrid_sizes: they depend on the host)
LATENT_TOKEN_BYTES = (512 + 64) * 2  # the MLA model's latent per token, bf16


@pytest.fixture(scope="class")
def hybrid_tp() -> Iterator[KvPair]:
    """A hybrid model (linear attention beside full attention) at two ranks; chunked at
    ``CHUNK`` so that the consumer's plain run cuts the prompt where xdc does
    (test_vllm_hybrid.py says why the reference must)."""
    with kv_pair(
        vllm_rig.hybrid_model(),
        engine={"tensor_parallel_size": RANKS, "max_num_batched_tokens": CHUNK},
        consumer={"extra": WAITS},
        reference=False,
    ) as made:
        yield made


@pytest.fixture(scope="class")
def mla_tp() -> Iterator[KvPair]:
    with kv_pair(
        vllm_rig.mla_model(),
        engine={
            "tensor_parallel_size": RANKS,
            "extra": {"deadline_s": 60.0},
            "custom_ops": vllm_rig.MLA_CUSTOM_OPS,  # its rotary kernel misreads MLA's slices
        },
        consumer={"extra": WAITS},
        reference=False,
    ) as made:
        yield made


@pytest.fixture(scope="class")
def whole_beside_split_tp() -> Iterator[KvPair]:
    """The hybrid model with one KV head at two ranks: both ranks hold the same attention KV
    (as Kimi Linear's ranks hold its whole latent), each its half of the state."""
    with kv_pair(
        vllm_rig.hybrid_model(kv_heads=1),
        engine={"tensor_parallel_size": RANKS, "max_num_batched_tokens": CHUNK},
        consumer={"extra": WAITS},
        reference=False,
    ) as made:
        yield made


def _hybrid_consumer(pair: KvPair, kv_heads: int = 2, **kw: Any) -> Engine:
    """Another decode engine of the hybrid model on ``pair``'s receiver, chunked as the
    reference (recomputing, it cuts the prompt where the plain run does)."""
    return Engine(
        "consumer",
        core=1,
        model=vllm_rig.hybrid_model(kv_heads=kv_heads),
        receiver_socket=pair.rx_sock,
        max_num_batched_tokens=CHUNK,
        extra=WAITS,
        **kw,
    )


def _delivered(pair: KvPair, rid: str) -> dict[int, int]:
    """Bytes the sender delivered for each rank's transfer of ``rid`` (``delivered_bytes``
    waits for each, and fails the test when one is not delivered)."""
    return {r: pair.delivered_bytes(shard_rid(rid, r, RANKS)) for r in range(RANKS)}


class TestHybrid:
    @pytest.mark.parametrize("n", [CHUNK + 1, 10 * CHUNK + 1])
    def test_the_state_and_kv_move_per_rank_and_decode_as_a_plain_run(
        self, hybrid_tp: KvPair, n: int
    ) -> None:
        """Each rank moves its half of every linear-attention layer's state and of the
        full-attention blocks, with its own digests; the decode's tokens are the plain run's."""
        ids = prompt(n, seed=2700 + n)
        got, _, rid = hybrid_tp.relay(ids)
        assert "xdc_recomputed" not in (got.get("kv_transfer_params") or {}), got
        assert got["token_ids"] == hybrid_tp.want(ids), n
        bs, state_bytes, attn_bytes = hybrid_sizes(hybrid_tp.consumer.log(), RANKS)
        blocks = -(-(n - 1) // bs)  # the decode computes the last token itself
        kv = 2 * state_bytes + 2 * blocks * attn_bytes
        want = kv + (2 + 2 * blocks + 1) * 8  # the block digests and the prompt's
        assert _delivered(hybrid_tp, rid) == dict.fromkeys(range(RANKS), want)
        for e in (hybrid_tp.producer, hybrid_tp.consumer):
            assert f"rank {RANKS - 1}/{RANKS}" in e.log(), e.log()[-3000:]

    def test_a_decode_split_otherwise_recomputes_at_once(self, hybrid_tp: KvPair) -> None:
        """A one-rank decode handed the two-rank prefill's answer (``xdc_ranks`` 2) can not
        use its transfers (``rid#0/2``, ``rid#1/2``): it recomputes at once, with the reason,
        instead of waiting ``arrival_timeout_s`` for a ``rid`` that never comes."""
        ids = prompt(10 * CHUNK + 1, seed=5)
        one = _hybrid_consumer(hybrid_tp)
        try:
            want = one.generate([ids])[0]["token_ids"]
            got, made, _ = hybrid_tp.relay(ids, consumer=one)
            assert (made.get("kv_transfer_params") or {}).get("xdc_ranks") == RANKS, made
            why = (got.get("kv_transfer_params") or {}).get("xdc_recomputed")
            assert why == "rank_mismatch", got
            assert got["token_ids"] == want
            assert got["seconds"] < WAITS["arrival_timeout_s"], got  # it did not wait
        finally:
            one.close()


class TestMla:
    def test_rank_0_moves_the_latent_once_and_every_decode_rank_reads_it(
        self, mla_tp: KvPair
    ) -> None:
        """MLA's latent is not split by heads: every rank holds all of it. Rank 0 moves it
        once (before, each rank moved its own copy and the link carried it twice), both ranks
        of the decode read that one transfer (the receiver frees it after the second), and
        the tokens are a plain run's: a rank that read nothing, or garbage, decodes wrong or
        recomputes. The reference decodes the last prompt token as the decode instance does
        (test_vllm_mla.py says why)."""
        p = prompt(299, seed=3600)
        out = mla_tp.consumer.generate([p], None, 9)[0]["token_ids"]
        ids, want = [*p, out[0]], list(out[1:])
        got, made, rid = mla_tp.relay(ids)
        assert (made.get("kv_transfer_params") or {}).get("xdc_ranks") == 1, made
        assert "xdc_recomputed" not in (got.get("kv_transfer_params") or {}), got
        assert got["token_ids"] == want
        m = re.search(r"in groups \w+/bs(\d+):", mla_tp.consumer.log())
        assert m, mla_tp.consumer.log()[-3000:]
        block = int(m.group(1))
        whole = 4 * -(-300 // block) * (block * LATENT_TOKEN_BYTES + 8) + 8  # as at one rank
        assert mla_tp.delivered_bytes(rid) == whole
        sent = mla_tp.tx.log()
        assert not any(shard_rid(rid, r, RANKS) in sent for r in range(RANKS)), sent[-2000:]
        assert "rank 0 moves it once" in mla_tp.producer.log()
        rx_log = mla_tp.rx.log()
        assert f"request {rid} released by 1 of its {RANKS} readers" in rx_log, rx_log[-3000:]
        assert f"request {rid} released by {RANKS} of its {RANKS} readers" in rx_log


class TestWholeBesideSplit:
    def test_kv_every_rank_holds_moves_once_the_state_per_rank_and_decodes_as_a_plain_run(
        self, whole_beside_split_tp: KvPair
    ) -> None:
        """Rank 0 moves the attention KV both ranks hold as one transfer (``rid``), which both
        decode ranks read; each rank moves its half of the state as its own (``rid#r/2``).
        Before, each rank moved its own copy of the attention KV with its state and the link
        carried it twice: for Kimi Linear, its latent, the bulk of a long prompt's KV. The
        decode's tokens are a plain run's: a rank that read the wrong part, or only one
        part, decodes wrong or recomputes."""
        pair = whole_beside_split_tp
        n = 10 * CHUNK + 1
        ids = prompt(n, seed=3900)
        got, made, rid = pair.relay(ids)
        assert (made.get("kv_transfer_params") or {}).get("xdc_ranks") == RANKS, made
        assert "xdc_recomputed" not in (got.get("kv_transfer_params") or {}), got
        assert got["token_ids"] == pair.want(ids)
        bs, state_bytes, attn_bytes = hybrid_sizes(pair.consumer.log(), RANKS)
        blocks = -(-(n - 1) // bs)  # the decode computes the last token itself
        whole = 2 * blocks * attn_bytes + (2 * blocks + 1) * 8
        share = 2 * state_bytes + (2 + 1) * 8
        assert pair.delivered_bytes(rid) == whole
        assert _delivered(pair, rid) == dict.fromkeys(range(RANKS), share)
        assert "distinct copies" in pair.producer.log(), pair.producer.log()[-3000:]
        rx_log = pair.rx.log()
        assert f"request {rid} released by {RANKS} of its {RANKS} readers" in rx_log, rx_log[-3000:]

    def test_a_share_at_the_wrong_rank_is_refused_and_the_whole_request_recomputes(
        self, whole_beside_split_tp: KvPair
    ) -> None:
        """A consumer whose ranks each ask for the next rank's share of the state (planted
        fault XDC_CONNECTOR_FAULT=other_shard) while reading the attention KV right. The
        shares are alike in shape, and without the rank in the layout each rank loaded the
        other's heads (seen on a dense model with it taken out): they are refused by layout.
        The attention part lands, and the request must still recompute as a whole (a rank
        reported loaded with half of its KV would decode from a state that is not there)."""
        pair = whole_beside_split_tp
        ids = prompt(10 * CHUNK + 1, seed=3901)
        want = pair.want(ids)
        crossed = _hybrid_consumer(
            pair, 1, tensor_parallel_size=RANKS, env={"XDC_CONNECTOR_FAULT": "other_shard"}
        )
        try:
            got, _, rid = pair.relay(ids, consumer=crossed)
            _delivered(pair, rid)  # both shares arrived, and were refused
            why = (got.get("kv_transfer_params") or {}).get("xdc_recomputed")
            assert why == "layout_mismatch", got
            assert got["token_ids"] == want
        finally:
            crossed.close()
