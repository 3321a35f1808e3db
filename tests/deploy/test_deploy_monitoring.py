"""deploy/prometheus and deploy/grafana: scrape targets match the deploy configs, and every
PromQL expression of the dashboard names metrics (and labels) the code really exports."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from xdc.monitor.link_metrics import LinkMetrics
from xdc.scheduler.service.router_metrics import RouterMetrics
from xdc.transport.daemon_metrics import ReceiverMetrics, SenderMetrics

from tests.deploy_fixtures import DEPLOY, load_deploy_config

yaml = pytest.importorskip("yaml")

# Labels Prometheus adds at scrape time (job, instance), set in prometheus.yml (role) or as
# external labels (datacenter, host), plus the histogram bucket label.
SCRAPE_LABELS = {"job", "instance", "role", "datacenter", "host"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@dataclass(frozen=True)
class Exported:
    family: str
    labels: frozenset[str]


def exported_metrics() -> dict[str, Exported]:
    """Every series name the daemons and the router expose -> its family and label names,
    taken from the real metric objects (names built at runtime, like xdc_link_*, included)."""
    holders: list[Any] = [
        SenderMetrics(),
        ReceiverMetrics(),
        RouterMetrics(),
        LinkMetrics(CollectorRegistry()),
    ]
    out: dict[str, Exported] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, MetricWrapperBase):
            labels = frozenset(obj._labelnames)
            if obj._type == "histogram":
                labels |= {"le"}
            for suffix in SUFFIXES[str(obj._type)]:
                out[obj._name + suffix] = Exported(obj._name, labels)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)

    for h in holders:
        for v in vars(h).values():
            visit(v)
    return out


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "xdc-dashboard.json").read_text())
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_exported_metrics_are_found() -> None:
    names = exported_metrics()
    # spot checks that the walk sees plain, labelled, runtime-named and histogram metrics
    assert names["xdc_sender_requests_total"].labels == {"outcome"}
    assert names["xdc_link_goodput_bps"].labels == {"peer"}
    assert "xdc_link_rtt_seconds" in names and "xdc_receiver_transfer_seconds_bucket" in names
    assert names["xdc_router_threshold_tokens"].labels == {"kind"}


def test_every_promql_expression_uses_real_metrics_and_labels() -> None:
    names = exported_metrics()
    seen = 0
    for p in panels():
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            used = re.findall(r"\b(xdc_[a-z0-9_]+)\s*(\{[^}]*\})?", expr)
            assert used, f"{p['title']}: {expr!r} names no xdc_ metric"
            labels_here: set[str] = set(SCRAPE_LABELS)
            for metric, selector in used:
                assert metric in names, f"{p['title']}: {metric} is not exported by xdc"
                labels_here |= names[metric].labels
                for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector):
                    assert label in names[metric].labels, f"{metric} has no label {label!r}"
            for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                for label in filter(None, (g.strip() for g in group.split(","))):
                    assert label in labels_here, f"{p['title']}: no label {label!r} in {expr!r}"
            for label in re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")):
                assert label in labels_here, f"{p['title']}: legend label {label!r}"
            seen += 1
    assert seen >= 20


def test_dashboard_covers_the_issue_and_is_importable() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels()}
    required = {
        "Link state": "xdc_link_state",
        "Goodput": "xdc_link_goodput_bps",
        "Retransmit ratio": "xdc_link_retrans",
        "RTT": "xdc_link_rtt_seconds",
        "Transfer latency quantiles": "histogram_quantile",
        "Requests by outcome": "by (outcome)",
        "Routing decisions by target": "xdc_router_decisions_total",
        "Offload fraction": "xdc_router_offload_fraction",
        "Threshold t": "xdc_router_threshold_tokens",
    }
    for title, needle in required.items():
        assert needle in exprs[title], title
    for p in panels():
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}"


def test_scrape_targets_match_the_deploy_configs(tmp_path: Path) -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs) == {"xdc-sender", "xdc-receiver", "xdc-router"}
    snd = load_deploy_config("prfaas-sender.toml", tmp_path / "s")
    rcv = load_deploy_config("pd-receiver.toml", tmp_path / "r")
    rtr = load_deploy_config("router.toml", tmp_path / "t")
    expected = {
        # the daemons' status endpoint binds 127.0.0.1 (transport/sender_main.py)
        "xdc-sender": f"127.0.0.1:{snd.sender.status_port}",
        "xdc-receiver": f"127.0.0.1:{rcv.receiver.status_port}",
        "xdc-router": f"{rtr.router.listen_host}:{rtr.router.listen_port}",
    }
    for job, target in expected.items():
        assert jobs[job].get("metrics_path", "/metrics") == "/metrics"
        targets = [t for sc in jobs[job]["static_configs"] for t in sc["targets"]]
        assert targets == [target], job
        assert not target.endswith(":0")
