"""A model split over two tensor-parallel ranks on both sides (real vLLM CPU engines, one
worker process per rank). Each rank holds half of the KV heads and moves its share as a
transfer of its own (``params.shard_rid``: ``rid#rank/ranks``) to the rank of the same number
on the other side; the rank is in the layout string, so a share at the wrong rank is refused.
A dense model and a hybrid one (half of each linear-attention layer's state per rank).

The decode is sent after the prefill answered (``KvPair.relay``), not beside it: on a 2-core
host a two-rank decode engine that waits for a load keeps its rank workers stepping, and they
starve the two-rank prefill engine's ranks (a plain 700-token prefill took 3.5 s beside an
idle decode engine and 30 s beside a waiting one, until the wait timed out). That is this
host's core count, not the connector: the first version of this support was switched off
for it in e101066, read as a late hand-over."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.vllm_fixtures import KvPair, kv_pair, prompt
from xdc.lab import vllm_rig
from xdc.lab.vllm_rig import Engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RANKS = 2
# the decode's waits: generous, since two engines of two ranks share two cores
WAITS = {"arrival_timeout_s": 20.0, "timeout_s": 60.0}

CHUNK = 32
BLOCK_TOKENS = 160  # the hybrid model's attention block (test_vllm_hybrid.py)
# per rank: half of the linear-attention heads' state, one of the two KV heads
STATE_BYTES_PER_RANK = 68608 // RANKS
ATTN_BLOCK_BYTES_PER_RANK = 81920 // RANKS


@pytest.fixture(scope="module")
def tp() -> Iterator[KvPair]:
    # the consumer's own plain runs are the reference: a third two-rank engine on 2 cores
    # slows everything
    split = {"tensor_parallel_size": RANKS}
    with kv_pair(
        vllm_rig.test_model(),
        engine={**split, "extra": {"deadline_s": 60.0}},
        consumer={"extra": WAITS},
        reference=False,
    ) as made:
        yield made


@pytest.fixture(scope="module")
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


def _delivered(tp: KvPair, rid: str) -> dict[int, int]:
    """Bytes the sender delivered per rank's transfer of ``rid``."""
    pat = rf"request {re.escape(rid)}#(\d+)/{RANKS} delivered: (\d+) bytes"
    return {int(r): int(n) for r, n in re.findall(pat, tp.tx.log())}


def test_each_rank_moves_its_share_of_the_heads_to_the_same_rank(tp: KvPair) -> None:
    for n in (33, 700):
        ids = prompt(n, seed=40 + n)
        got, made, rid = tp.relay(ids)
        handed = made.get("kv_transfer_params") or {}
        assert handed.get("xdc_rid") == rid, made
        assert "xdc_recomputed" not in (got.get("kv_transfer_params") or {}), got
        assert got["token_ids"] == tp.want(ids), n
        per_rank = _delivered(tp, rid)
        # both ranks' shares arrived, the same size (each holds half of the heads)
        assert sorted(per_rank) == list(range(RANKS)), tp.tx.log()[-3000:]
        assert len(set(per_rank.values())) == 1, per_rank
    for e in (tp.producer, tp.consumer):
        assert f"rank {RANKS - 1}/{RANKS}" in e.log(), e.log()[-3000:]


def test_a_share_at_the_wrong_rank_is_refused_by_layout_and_the_decode_recomputes(
    tp: KvPair,
) -> None:
    """A consumer whose ranks each ask for the next rank's share (planted fault
    XDC_CONNECTOR_FAULT=other_shard): the shares are alike in shape, and without the rank in
    the layout each rank would load the other's heads."""
    ids = prompt(300, seed=3)
    want = tp.want(ids)
    crossed = Engine(
        "consumer",
        core=1,
        model=vllm_rig.test_model(),
        receiver_socket=tp.rx_sock,
        tensor_parallel_size=RANKS,
        extra=WAITS,
        env={"XDC_CONNECTOR_FAULT": "other_shard"},
    )
    try:
        got, _, rid = tp.relay(ids, consumer=crossed)
        assert sorted(_delivered(tp, rid)) == list(range(RANKS)), tp.tx.log()[-3000:]
        assert (got.get("kv_transfer_params") or {}).get("xdc_recomputed") == "layout_mismatch", got
        assert got["token_ids"] == want
    finally:
        crossed.close()


@pytest.mark.parametrize("n", [CHUNK + 1, 10 * CHUNK + 1])
def test_a_hybrid_models_state_and_kv_move_per_rank_and_decode_as_a_plain_run(
    hybrid_tp: KvPair, n: int
) -> None:
    """Each rank moves its half of every linear-attention layer's state and of the
    full-attention blocks, with its own digests; the decode's tokens are the plain run's."""
    ids = prompt(n, seed=2700 + n)
    got, _, rid = hybrid_tp.relay(ids)
    assert "xdc_recomputed" not in (got.get("kv_transfer_params") or {}), got
    assert got["token_ids"] == hybrid_tp.want(ids), n
    blocks = -(-(n - 1) // BLOCK_TOKENS)  # the decode computes the last token itself
    kv = 2 * STATE_BYTES_PER_RANK + 2 * blocks * ATTN_BLOCK_BYTES_PER_RANK
    want = kv + (2 + 2 * blocks + 1) * 8  # the block digests and the prompt's
    assert _delivered(hybrid_tp, rid) == dict.fromkeys(range(RANKS), want)
