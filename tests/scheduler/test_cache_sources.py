"""A second cache-event source with its own block hash plugs into the router through
``cacheintake`` (the way an engine's own KV-event stream will): its events land in their own
index, a request sent as token ids is keyed in every scheme, and the prefix is found."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import xxhash
from aiohttp import web
from xdc.scheduler.cacheindex import CacheEvent
from xdc.scheduler.cacheintake import CacheIntake, EventSink, XdcChainHash, merge_matches
from xdc.scheduler.profile import load_profile
from xdc.scheduler.service.router_app import SERVICE, make_router_app

from tests.paths import REPO
from tests.router_fixtures import GW, router_config

PROFILE = REPO / "deploy/profiles/prfaas-case-study.toml"
BLOCK = 16


@dataclass(frozen=True)
class OtherHash:
    """A foreign engine's block key: xxh64 over the token text, chained, seed 7."""

    block_size: int = BLOCK
    name: str = "other-engine"

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        out: list[int] = []
        prev = 7
        for i in range(len(token_ids) // self.block_size):
            chunk = ",".join(map(str, token_ids[i * self.block_size : (i + 1) * self.block_size]))
            prev = xxhash.xxh64_intdigest(f"{prev}:{chunk}".encode())
            out.append(prev)
        return out

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "block_size": self.block_size, "algorithm": "xxh64-text"}


@dataclass
class ListSource:
    """Emits one batch of events, then waits (bounded) until cancelled."""

    scheme: OtherHash
    events: list[CacheEvent]
    sent: threading.Event = field(default_factory=threading.Event)

    async def run(self, sink: EventSink) -> None:
        sink(self.scheme.name, self.events)
        self.sent.set()
        while True:
            await asyncio.sleep(3600)


def test_a_second_event_source_with_its_own_hash_gives_prefix_hits() -> None:
    profile = load_profile(PROFILE)
    app = make_router_app(router_config(block_size=BLOCK), profile)
    svc = app[SERVICE]
    scheme = OtherHash()
    tokens = list(range(5000, 5000 + 64 * BLOCK))  # 64 blocks
    keys = scheme.keys(tokens)
    source = ListSource(scheme, [CacheEvent("stored", "pd", "pd-2", 1, tuple(keys[:48]))])
    svc.cache.add_scheme(scheme)
    svc.cache.add_source(source)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return int(runner.addresses[0][1])

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        assert source.sent.wait(10)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        body = {"rid": "x", "prompt_len": len(tokens), "token_ids": tokens, "dry_run": True}
        conn.request(
            "POST",
            "/v1/route",
            json.dumps(body),
            {"Authorization": f"Bearer {GW}", "Content-Type": "application/json"},
        )
        d = json.loads(conn.getresponse().read())
        conn.close()
        assert d["target"] == "pd" and d["prefill_node"] == "pd-2", d
        assert d["cached_tokens"] == 48 * BLOCK  # found through the other scheme's index
        st = svc.state()
        assert st["cache_index"]["schemes"] == {"xdc": 0, "other-engine": 48}
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_schemes_must_share_the_block_size_and_be_unique() -> None:
    intake = CacheIntake(1000, ("prfaas", "pd"), [XdcChainHash(BLOCK)])
    with pytest.raises(ValueError, match="block size"):
        intake.add_scheme(OtherHash(block_size=32))
    intake.add_scheme(OtherHash())
    with pytest.raises(ValueError, match="already"):
        intake.add_scheme(OtherHash())


def test_merge_matches_takes_the_longer_prefix_per_node() -> None:
    from xdc.scheduler.cacheindex import PrefixMatch

    a = PrefixMatch({"pd": 3, "prfaas": 0}, {"pd": {"p1": 3}, "prfaas": {}}, {"pd": "p1"})
    b = PrefixMatch({"pd": 5}, {"pd": {"p2": 5, "p1": 1}}, {"pd": "p2"})
    m = merge_matches(a, b)
    assert m.blocks == {"pd": 5, "prfaas": 0}
    assert m.node_blocks["pd"] == {"p1": 3, "p2": 5} and m.best_node["pd"] == "p2"


def test_keys_a_gateway_computes_from_published_schemes_match_like_token_ids() -> None:
    """Issue 26 finding 8: a gateway sends per-scheme block keys (computed from the
    router's GET /v1/schemes), not every token id; the match is the one token ids give."""
    from xdc.scheduler.cacheintake import scheme_from
    from xdc.scheduler.vllm_hash import VllmBlockHash

    intake = CacheIntake(10_000, ("prfaas", "pd"), [XdcChainHash(BLOCK)])
    intake.add_scheme(VllmBlockHash(BLOCK))
    tokens = [(i * 7919) % 50_000 for i in range(60 * BLOCK + 5)]
    xdc_keys, vllm_keys = XdcChainHash(BLOCK).keys(tokens), VllmBlockHash(BLOCK).keys(tokens)
    intake.apply("xdc", [CacheEvent("stored", "pd", "pd-1", 1, tuple(xdc_keys[:20]))])
    intake.apply("vllm", [CacheEvent("stored", "prfaas", "prfaas-0", 1, tuple(vllm_keys[:50]))])
    published = json.loads(json.dumps(intake.describe()))  # as it travels
    schemes = [scheme_from(d) for d in published]
    sent = {s.name: s.keys(tokens) for s in schemes}
    by_keys, default = intake.match_keys(sent)
    by_tokens, _ = intake.match(token_ids=tokens)
    assert by_keys == by_tokens and by_keys.blocks == {"pd": 20, "prfaas": 50}
    assert default == tuple(xdc_keys)
    # a leading part of the keys (a prompt too long to send them all) finds what it covers
    part, _ = intake.match_keys({name: ks[:30] for name, ks in sent.items()})
    assert part.blocks == {"pd": 20, "prfaas": 30}
    # a scheme this router does not have is ignored
    assert intake.match_keys({"gone": [1, 2, 3], **sent})[0] == by_tokens
    with pytest.raises(ValueError, match="unknown kind"):
        scheme_from({"name": "x", "kind": "sglang", "block_size": BLOCK})
