"""Links by id over the real HTTP API: a router with two PrfaaS clusters, several senders per
link, strict validation of every new field (4xx, never 5xx), and routing that follows the
combined link state."""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from xdc.scheduler.profile import Profile, load_profile

from tests.paths import REPO
from tests.router_fixtures import DM, GW, Clock, LiveRouter, router_config

TWO = REPO / "deploy/profiles/prfaas-two-clusters.toml"


@pytest.fixture(scope="module")
def two() -> Profile:
    return load_profile(TWO)


@pytest.fixture
def router(two: Profile) -> Iterator[tuple[LiveRouter, Clock]]:
    clock = Clock()
    r = LiveRouter(router_config(link_stale_s=5.0), two, clock)
    yield r, clock
    r.close()


def report(
    src: str, reporter: str, goodput: float, cap: float, at: float = 1.0, state: str = "ok"
) -> dict[str, Any]:
    return {
        "from_cluster": src,
        "to_cluster": "pd",
        "reporter": reporter,
        "utilisation": goodput / cap,
        "goodput_bps": goodput,
        "capacity_bps": cap,
        "state": state,
        "retrans_ratio": 0.0 if state == "ok" else 0.02,
        "rtt_ms": 3.0,
        "updated_at": at,
    }


def test_two_senders_on_one_link_are_combined_and_a_silent_one_expires(
    router: tuple[LiveRouter, Clock],
) -> None:
    r, clock = router
    s1 = r.call("POST", "/v1/links", report("prfaas-a", "tx-1", 6e9, 12e9), token=DM)
    assert s1[0] == 200 and s1[1]["accepted"] and s1[1]["link"] == "prfaas-a->pd"
    clock.now += 2.0
    status, ack = r.call(
        "POST", "/v1/links", report("prfaas-a", "tx-2", 10e9, 20e9, state="warn"), token=DM
    )
    assert status == 200
    combined = ack["combined"]
    assert combined["reporters"] == 2 and combined["goodput_bps"] == 16e9
    assert combined["capacity_bps"] == 20e9 and combined["state"] == "warn"
    _, st = r.call("GET", "/v1/state")
    link = st["links"]["prfaas-a->pd"]
    assert set(link["reporters"]) == {"tx-1", "tx-2"}
    assert st["links"]["prfaas-b->pd"]["state"] is None  # nobody reports on b's link
    _, text = r.call("GET", "/metrics")
    assert 'xdc_router_link_reporters{link="prfaas-a->pd"} 2.0' in text
    goodput = [ln for ln in text.splitlines() if ln.startswith("xdc_router_link_goodput_bps{")]
    assert goodput and float(goodput[0].split()[-1]) == 16e9
    # tx-1 goes silent for longer than router.link_stale_s: only tx-2 remains
    clock.now += 4.0
    _, st = r.call("GET", "/v1/state")
    link = st["links"]["prfaas-a->pd"]
    assert set(link["reporters"]) == {"tx-2"} and link["state"]["goodput_bps"] == 10e9


def test_unknown_link_and_bad_fields_are_4xx_naming_the_problem(
    router: tuple[LiveRouter, Clock],
) -> None:
    r, _ = router
    status, body = r.call("POST", "/v1/links", report("prfaas-x", "tx", 1e9, 2e9), token=DM)
    assert status == 400 and "prfaas-x->pd" in body["problems"][0]
    assert "prfaas-a->pd" in body["problems"][0]  # the known links are listed
    bad: list[tuple[dict[str, Any], str]] = [
        ({"goodput_bps": -1}, "goodput_bps"),
        ({"capacity_bps": 1e300}, "capacity_bps"),
        ({"rtt_ms": "3"}, "rtt_ms"),
        ({"from_cluster": "no spaces"}, "from_cluster"),
        ({"reporter": ""}, "reporter"),
        ({"reporter": "x" * 129}, "reporter"),
        ({"state": "fine"}, "state"),
        ({"updated_at": True}, "updated_at"),
    ]
    for change, field in bad:
        status, body = r.call(
            "POST", "/v1/links", {**report("prfaas-a", "t", 1e9, 2e9), **change}, token=DM
        )
        assert status == 400 and any(field in p for p in body["problems"]), (change, body)
    raw = json.dumps(report("prfaas-a", "t", 1e9, 2e9)).replace("1000000000.0", "NaN", 1)
    status, body = r.call("POST", "/v1/links", raw=raw.encode(), token=DM)
    assert status == 400 and "NaN" in body["problems"][0]
    missing = report("prfaas-a", "t", 1e9, 2e9)
    del missing["reporter"]
    status, body = r.call("POST", "/v1/links", missing, token=DM)
    assert status == 400 and "reporter" in body["problems"][0]


def test_unknown_clusters_in_nodes_and_cache_events_are_400(
    router: tuple[LiveRouter, Clock],
) -> None:
    r, _ = router
    nodes = {"nodes": [{"name": "n1", "cluster": "prfaas-z", "role": "prefill"}]}
    status, body = r.call("POST", "/v1/nodes", nodes, token=DM)
    assert status == 400 and "prfaas-z" in body["error"] and "prfaas-a" in body["error"]
    ev = {"events": [{"kind": "stored", "cluster": "prfaas-z", "node": "n", "seq": 1}]}
    status, body = r.call("POST", "/v1/cache/events", ev, token=DM)
    assert status == 400 and "prfaas-z" in body["error"]
    ok = {"nodes": [{"name": "b-1", "cluster": "prfaas-b", "role": "prefill", "queue_s": 1.0}]}
    assert r.call("POST", "/v1/nodes", ok, token=DM)[0] == 200
    bad_role = {"nodes": [{"name": "b-2", "cluster": "prfaas-b", "role": "decode"}]}
    status, body = r.call("POST", "/v1/nodes", bad_role, token=DM)
    assert status == 400 and "only prefill" in body["error"]


def test_non_utf8_header_bytes_are_401_not_500(router: tuple[LiveRouter, Clock]) -> None:
    r, _ = router
    for value in (b"Bearer \xff\xfe\x80", b"\xc3\x28 token", b"Bearer " + "dm\u00e9".encode()):
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
        data = json.dumps(report("prfaas-a", "t", 1e9, 2e9)).encode()
        conn.putrequest("POST", "/v1/links")
        conn.putheader("Authorization", value)
        conn.putheader("X-Trace", b"\xfe\xff")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 401, (value, body)


def test_routing_follows_the_combined_capacity_of_each_link(
    router: tuple[LiveRouter, Clock],
) -> None:
    r, _ = router

    def split(tag: str) -> Counter[str]:
        out: Counter[str] = Counter()
        for i in range(300):
            body = {"rid": f"{tag}-{i}", "prompt_len": 90_000, "dry_run": True, "ttft_slo_s": 1e4}
            status, d = r.call("POST", "/v1/route", body, token=GW)
            assert status == 200, d
            out[d["target"]] += 1
            assert d["link"] == (None if d["target"] == "pd" else f"{d['target']}->pd")
        return out

    # configured: both sites compute-bound (2 instances each): an even split
    before = split("a")
    assert before["pd"] == 0 and abs(before["prfaas-a"] - 150) < 30
    # prfaas-a's two senders now see 1 Gbit/s each on a link that fell to 2 Gbit/s
    for s in ("a1", "a2"):
        assert r.call("POST", "/v1/links", report("prfaas-a", s, 1e9, 1e9), token=DM)[0] == 200
    after = split("b")
    # a: min(2 / 2.4 s, 2 Gbit/s / 8.2 Gbit) = 0.24 req/s vs b's 0.83: about 22%
    assert after["prfaas-a"] < 0.6 * before["prfaas-a"]
    _, st = r.call("GET", "/v1/state")
    share = st["links"]["prfaas-a->pd"]["offload_share"]
    assert share == pytest.approx(after["prfaas-a"] / 300, abs=0.06)


def test_non_utf8_content_type_is_4xx(router: tuple[LiveRouter, Clock]) -> None:
    r, _ = router
    for ctype in (b"application/\xffjson", b"\xfe\xff", b"application/json; charset=\xff"):
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
        data = json.dumps({"rid": "x", "prompt_len": 10}).encode()
        conn.putrequest("POST", "/v1/route")
        conn.putheader("Authorization", f"Bearer {GW}")
        conn.putheader("Content-Type", ctype)
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        resp.read()
        conn.close()
        assert 400 <= resp.status < 500 or resp.status == 200, (ctype, resp.status)
