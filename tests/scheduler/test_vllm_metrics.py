"""Node load from vLLM's /metrics: parsing (hostile bodies included), the report it becomes,
and the router's poller against real HTTP endpoints that answer well, badly or not at all
(a real vLLM server's /metrics is scraped in test_vllm_http.py)."""

from __future__ import annotations

import pytest
from xdc.scheduler.vllm_metrics import EngineLoad, load_report, parse_metrics

from tests.router_fixtures import SCRAPE, MetricsEndpoint
from tests.router_rig import RouterRig
from xdc.config_entries import MetricsTarget, parse_targets


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
        "decode_waiting": 0,
        "healthy": True,
        "instance": "http://h/metrics",  # the nodes of one engine are one instance
    }
    later = EngineLoad(1, 3, 0.5, 9.0, 12)  # two more prefills took 4 s: 2 s each now
    assert load_report(t, later, load, 1.0)["queue_s"] == 2.0


def test_deferred_requests_are_decodes_on_their_way_not_prefill_backlog() -> None:
    """A decode engine's connector defers a request until its KV is complete (admit =
    "complete"): vLLM counts it waiting, but it holds no KV blocks and needs no prefill."""
    body = SCRAPE + (
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 3.0\n'
    )
    load = parse_metrics(body)
    assert (load.waiting, load.deferred) == (4, 3)
    r = load_report(MetricsTarget("pd", "d", "decode", "http://h/metrics"), load, None, 1.0)
    assert (r["queue_depth"], r["queue_s"], r["decode_waiting"]) == (1, 0.5, 3)
    # gauges read a moment apart: never more deferred than waiting
    odd = SCRAPE.replace('waiting{engine="0",model_name="m"} 4.0', "waiting 2.0")
    odd += 'vllm:num_requests_waiting_by_reason{reason="deferred"} 5.0\n'
    assert parse_metrics(odd).deferred == 2
    with pytest.raises(ValueError, match="not a count"):
        parse_metrics(SCRAPE + 'vllm:num_requests_waiting_by_reason{reason="deferred"} NaN\n')


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


def _node(rig: RouterRig, name: str) -> dict[str, object] | None:
    nodes = rig.state()["nodes"]
    rows = nodes if isinstance(nodes, list) else nodes.get("pd", [])
    for row in rows:
        if row.get("name") == name:
            return dict(row)
    return None


def test_the_router_polls_engines_and_marks_a_silent_one_unhealthy(
    endpoint: MetricsEndpoint,
) -> None:
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
