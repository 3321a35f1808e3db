"""Node load from vLLM's /metrics: parsing (hostile bodies included), the report it becomes,
and the router's poller against real HTTP endpoints that answer well, badly or not at all
(a real vLLM server's /metrics is scraped in test_vllm_http.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from xdc.scheduler.vllm_metrics import EngineLoad, load_report, parse_metrics

from tests.router_rig import RouterRig
from xdc.config_entries import MetricsTarget, parse_targets

SCRAPE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 5.0
"""


def test_a_scrape_becomes_queue_depth_queue_time_and_decode_load() -> None:
    load = parse_metrics(SCRAPE)
    assert load == EngineLoad(4, 3, 0.25, 5.0, 10)
    t = MetricsTarget("pd", "pd-0", "prefill", "http://h/metrics")
    r = load_report(t, load, None, 1.0)
    assert r == {
        "cluster": "pd",
        "name": "pd-0",
        "role": "prefill",
        "queue_depth": 4,
        "queue_s": 2.0,  # 4 waiting x 0.5 s mean prefill
        "decode_load": 0.25,
        "healthy": True,
        "instance": "http://h/metrics",  # the nodes of one engine are one instance
    }
    later = EngineLoad(1, 3, 0.5, 9.0, 12)  # two more prefills took 4 s: 2 s each now
    assert load_report(t, later, load, 1.0)["queue_s"] == 2.0


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("", "num_requests_waiting"),
        ("garbage {{{", "not vLLM metrics"),
        ("vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n", "not a count"),
        ("vllm:num_requests_waiting -1\nvllm:num_requests_running 1\n", "not a count"),
        # each finite, their sum inf: int() raised OverflowError, which ended the poller
        (
            'vllm:num_requests_waiting{e="0"} 1e308\nvllm:num_requests_waiting{e="1"} 1e308\n'
            "vllm:num_requests_running 1\n",
            "sums to inf",
        ),
        ("vllm:num_requests_waiting 1e300\nvllm:num_requests_running 1\n", "sums to 1e"),
    ],
)
def test_bad_scrapes_are_value_errors(body: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_metrics(body)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("pd/p=http://h/metrics", "cluster/node@role"),
        ("pd/p@both=http://h/metrics", "role"),
        ("pd/p@decode=ftp://h", "http"),
        ("p d/x@decode=http://h", "cluster name"),
        ("pd/p@decode=http://h,pd/p@prefill=http://g", "twice"),
    ],
)
def test_bad_targets_name_the_entry(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_targets(spec)


class Endpoint:
    """A real HTTP server whose /metrics answer the test can change."""

    def __init__(self) -> None:
        self.body, self.status = SCRAPE, 200
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def handler(_: web.Request) -> web.Response:
            return web.Response(text=self.body, status=self.status)

        app = web.Application()
        app.router.add_get("/metrics", handler)
        self.runner = web.AppRunner(app, access_log=None)

        async def start() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return int(self.runner.addresses[0][1])

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.close()


def _node(rig: RouterRig, name: str) -> dict[str, object] | None:
    nodes = rig.state()["nodes"]
    rows = nodes if isinstance(nodes, list) else nodes.get("pd", [])
    for row in rows:
        if row.get("name") == name:
            return dict(row)
    return None


def test_the_router_polls_engines_and_marks_a_silent_one_unhealthy(endpoint: Endpoint) -> None:
    with RouterRig() as rig:
        rig.start(
            "",
            vllm_metrics=(f"pd/eng-9@prefill=http://127.0.0.1:{endpoint.port}/metrics",),
            vllm_metrics_interval_s=0.1,
        )
        rig.wait_for(lambda: (_node(rig, "eng-9") or {}).get("queue_depth") == 4)
        endpoint.status = 500  # broken engine: unhealthy after three failed scrapes
        rig.wait_for(lambda: (_node(rig, "eng-9") or {}).get("healthy") is False, timeout=5)
        endpoint.status, endpoint.body = 200, SCRAPE.replace("} 4.0", "} 0.0")
        rig.wait_for(lambda: (_node(rig, "eng-9") or {}).get("healthy") is True, timeout=5)
        assert (_node(rig, "eng-9") or {}).get("queue_depth") == 0
