"""A sliding-window model through xdc on real vLLM CPU engines (issue 27): a Gemma-3-shaped
model with three layers of a 64-token window beside one full-attention layer (MiMo-V2-Flash's
mix). The window layers move only the blocks their window still reads; the full layer moves
every block. float32, prefix caching on every engine, a chunked producer: the decode's tokens
equal a plain run's for prompts shorter than a block, of several blocks and of many chunks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm_fixtures import BLOCK, KvPair, kv_pair, prompt, sliding_model

pytestmark = pytest.mark.vllm

WINDOW = 64
BLOCK_BYTES = BLOCK * 2 * 128 * 4  # 32 tokens x 2 KV heads x (64 K + 64 V) x fp32


@pytest.fixture(scope="module")
def swa() -> Iterator[KvPair]:
    engine = {"dtype": "float32", "prefix_caching": True, "max_num_batched_tokens": 2 * WINDOW}
    with kv_pair(sliding_model(), engine=engine) as made:
        yield made


@pytest.mark.parametrize("n", [20, 300, 1000, 1000])
def test_sliding_window_decode_tokens_equal_a_plain_run(swa: KvPair, n: int) -> None:
    """20 tokens (under a block), 300 and 1000 (8 chunks of 128), then 1000 again (the
    producer's prefix cache serves most of it). A window layer moves the blocks of its last
    window (from token n - 65 on, one token of margin); the full layer moves all of them."""
    ids = prompt(n, seed=3100 + n)
    got, _, rid = swa.pair(ids)
    assert got["token_ids"] == swa.want(ids), n
    full = -(-n // BLOCK)
    window = full - max(0, n - WINDOW - 1) // BLOCK
    assert (
        swa.delivered_bytes(rid) == (3 * window + full) * (BLOCK_BYTES + 8) + 8
    )  # + the prompt's digest
    assert "prefilling it locally" not in swa.consumer.log()
