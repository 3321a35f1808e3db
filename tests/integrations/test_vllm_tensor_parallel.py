"""A model split over two tensor-parallel ranks on both sides (real vLLM CPU engines, one
worker process per rank). Each rank holds half of the KV heads; the connector would move each
rank's share as a transfer of its own (``params.shard_rid``), but on this build a rank's last
layer or digest layer often reached its sender only at the engine's next step, so such engines
are named at start-up and served locally (``params.parallel_split``). Before, every rank began
and awaited the same transfer id: the sender took both, the decode gave it up, the request
hung for minutes, and a producer rank crashed the engine on the refusal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm_fixtures import KvPair, kv_pair, prompt
from xdc.lab import vllm_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RANKS = 2


@pytest.fixture(scope="module")
def tp() -> Iterator[KvPair]:
    # the consumer's own plain runs are the reference: a third two-rank engine on 2 cores
    # slows everything (each idle rank worker busy-polls vLLM's queue after every step)
    split = {"tensor_parallel_size": RANKS}
    with kv_pair(vllm_rig.test_model(), engine=split, reference=False) as made:
        yield made


def test_a_split_engine_is_named_at_start_up_and_serves_its_requests_locally(
    tp: KvPair,
) -> None:
    for n in (33, 700):
        ids = prompt(n, seed=40 + n)
        got, made, rid = tp.pair(ids)
        assert got["token_ids"] == tp.want(ids), n
        # the prefill says its KV will not come, so a gateway has the decode prefill at once
        assert "xdc_failed" in (made.get("kv_transfer_params") or {}), made
        assert rid not in tp.tx.log()  # nothing began at the sender
    for e in (tp.producer, tp.consumer):
        assert f"tensor parallel size {RANKS}" in e.log(), e.log()[-3000:]
