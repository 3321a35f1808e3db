"""What the gateway makes of a router's published key schemes, hostile ones included."""

from __future__ import annotations

import asyncio
from typing import Any

from xdc.scheduler.service.openapi import MAX_SCHEMES

from xdc.gateway.route_keys import INLINE_TOKEN_IDS, RouterSchemes, keys_body


def _schemes(answer: Any) -> list[Any] | None:
    async def fetch() -> Any:
        return answer

    return asyncio.run(RouterSchemes().get(fetch))


def test_garbage_and_too_many_schemes_from_the_router_are_skipped_or_cut() -> None:
    good = {"name": "x", "kind": "xdc", "block_size": 16, "seed": 0}
    bad = [
        {"name": "a", "kind": "sglang", "block_size": 16},
        {"name": "b", "kind": "xdc", "block_size": -1},
        {"name": "c", "kind": "xdc", "block_size": True},
        {"name": "d", "kind": "xdc", "block_size": 16, "seed": 2**64},
        {"name": "e", "kind": "vllm", "block_size": 16, "algo": "md5"},
        {"name": "f", "kind": "vllm", "block_size": 16, "algo": "xxhash"},  # unseeded
        "not a scheme",
    ]
    got = _schemes({"schemes": bad + [dict(good, name=f"x{i}") for i in range(20)]})
    assert got is not None and len(got) == MAX_SCHEMES
    assert [s.name for s in got] == [f"x{i}" for i in range(MAX_SCHEMES)]
    assert _schemes({"schemes": "everything"}) is None  # kept what it had: nothing
    assert _schemes(["not", "an", "object"]) is None


def test_a_long_prompt_goes_as_a_leading_part_of_its_keys_in_every_scheme() -> None:
    got = _schemes({"schemes": [{"name": "x", "kind": "xdc", "block_size": 1, "seed": 0}]})
    assert got is not None
    ids = list(range(INLINE_TOKEN_IDS + 100_000))
    rb = keys_body("r", ids, got)
    assert rb.truncated and rb.prefix and rb.body["prompt_len"] == len(ids)
    assert len(rb.body["scheme_keys"][0]["hashes"]) == 24_576
    assert keys_body("r", ids, None).body == {"rid": "r", "prompt_len": len(ids)}
