"""Router replicas sharing state through a real redis-server: real `xdc router` processes, real
sockets. Same decisions from every replica, nothing lost when one is killed mid-load, and a
replica cut off from Redis keeps routing, says so, and catches up."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import orjson
import pytest
from xdc.scheduler.cacheindex import CacheEvent
from xdc.scheduler.service.shared import cache_event, cache_row

from tests.paths import REPO
from tests.redis_fixtures import RedisServer
from tests.router_fixtures import MetricsEndpoint, vllm_scrape

ROOT = REPO
TWO = ROOT / "deploy/profiles/prfaas-two-clusters.toml"
GW, DM = "gw-token", "dm-token"

pytestmark = pytest.mark.slow


class Replica:
    """One `xdc router` process with router.shared_state = redis."""

    def __init__(self, redis_url: str, name: str, ns: str = "t", extra: Sequence[str] = ()) -> None:
        self.name = name
        cmd = [
            sys.executable,
            "-m",
            "xdc",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--profile",
            str(TWO),
            "--set",
            f"router.gateway_token={GW}",
            "--set",
            f"router.daemon_token={DM}",
            "--set",
            "router.shared_state=redis",
            "--set",
            f"router.redis_url={redis_url}",
            "--set",
            f"router.redis_namespace={ns}",
            "--set",
            f"router.replica_id={name}",
            "--set",
            "router.redis_timeout_s=0.5",
            "--set",
            "router.redis_leader_lease_s=1.5",
            "--set",
            "node.log_level=warning",
            *(x for kv in extra for x in ("--set", kv)),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"router {name} did not start: {line!r} {self.stderr()}")
        self.port = int(line.split()[4].rsplit(":", 1)[1])

    def call(
        self, method: str, path: str, body: object = None, token: str | None = None
    ) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            headers = {"Content-Type": "application/json"}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            ctype = resp.getheader("Content-Type", "")
            return resp.status, json.loads(raw) if "json" in ctype else raw.decode()
        finally:
            conn.close()

    def state(self) -> dict[str, Any]:
        status, st = self.call("GET", "/v1/state")
        assert status == 200
        return dict(st)

    def health(self) -> dict[str, Any]:
        return dict(self.call("GET", "/healthz")[1]["shared_state"])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read()[-3000:]


class ReplicaFactory(Protocol):
    def __call__(self, name: str, extra: Sequence[str] = ...) -> Replica: ...


@pytest.fixture
def replicas(redis_server: RedisServer) -> Iterator[ReplicaFactory]:
    started: list[Replica] = []

    def start(name: str, extra: Sequence[str] = ()) -> Replica:
        r = Replica(redis_server.url, name, extra=extra)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def link(src: str, reporter: str, goodput: float, cap: float, at: float) -> dict[str, Any]:
    return {
        "from_cluster": src,
        "to_cluster": "pd",
        "reporter": reporter,
        "utilisation": goodput / cap,
        "goodput_bps": goodput,
        "capacity_bps": cap,
        "state": "ok",
        "retrans_ratio": 0.0,
        "rtt_ms": 2.0,
        "updated_at": at,
    }


PROMPT = list(range(1000, 1200))  # 200 block hashes


def feed(a: Replica, b: Replica) -> None:
    """Different inputs to different replicas, each acknowledged as written to Redis."""
    now = time.time()
    for i, rep in enumerate(("tx-1", "tx-2")):
        status, ack = a.call(
            "POST", "/v1/links", link("prfaas-a", rep, 0.8e9, 1e9, now + i), token=DM
        )
        assert status == 200 and ack["replicated"] is True, ack
    status, ack = b.call("POST", "/v1/links", link("prfaas-b", "tx-3", 2e9, 8e9, now), token=DM)
    assert status == 200 and ack["replicated"] is True
    events = {
        "events": [
            {"kind": "stored", "cluster": "pd", "node": "pd-1", "seq": 1,
             "block_hashes": PROMPT[:60]},
            {"kind": "stored", "cluster": "prfaas-b", "node": "prfaas-b-1", "seq": 1,
             "block_hashes": PROMPT[:150]},
        ]
    }  # fmt: skip
    status, ack = a.call("POST", "/v1/cache/events", events, token=DM)
    assert status == 200 and ack["replicated"] is True
    nodes = {
        "nodes": [
            {"name": "pd-0", "cluster": "pd", "role": "prefill", "queue_s": 3.0},
            {"name": "pd-2", "cluster": "pd", "role": "prefill", "queue_s": 0.5},
            {"name": "pd-3", "cluster": "pd", "role": "decode", "decode_load": 0.2},
            {"name": "pd-4", "cluster": "pd", "role": "decode", "decode_load": 0.1},
        ]
    }
    status, ack = b.call("POST", "/v1/nodes", nodes, token=DM)
    assert status == 200 and ack["replicated"] is True


def same_decision(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal, except that predicted times may differ by the milliseconds between the two
    calls (a reported queue drains in real time)."""
    timed = {"predicted_ttft_s", "queue_s"}
    if {k: v for k, v in a.items() if k not in timed and k != "reasons"} != {
        k: v for k, v in b.items() if k not in timed and k != "reasons"
    }:
        return False
    return all(abs((a[k] or 0) - (b[k] or 0)) < 0.05 for k in timed)


def _same_inputs(a: Replica, b: Replica) -> bool:
    sa, sb = a.state(), b.state()

    def key(s: dict[str, Any]) -> object:
        links = {k: sorted(v["reporters"]) for k, v in s["links"].items()}
        return links, s["cache_index"]["entries"], len(s["nodes"])

    return key(sa) == key(sb) and sa["cache_index"]["entries"] > 0


def test_two_replicas_share_inputs_and_give_the_same_decisions(
    replicas: ReplicaFactory,
) -> None:
    a, b = replicas("A"), replicas("B")
    until(lambda: a.health()["up"] and b.health()["up"], what="both replicas on Redis")
    feed(a, b)
    until(lambda: _same_inputs(a, b), what="both replicas to hold the same inputs")
    st = b.state()
    assert sorted(st["links"]["prfaas-a->pd"]["reporters"]) == ["tx-1", "tx-2"]
    assert st["links"]["prfaas-a->pd"]["state"]["goodput_bps"] == 1.6e9  # combined, on B
    until(lambda: a.state()["threshold"] == b.state()["threshold"], what="the leader's threshold")
    leaders = [r.health()["leader"] for r in (a, b)]
    assert sorted(leaders) == [False, True]  # exactly one runs the controller and planner
    decisions = []
    for i in range(40):
        # prefixes cached on both sides, and long uncached prompts that offload
        hashes = PROMPT[: 20 + 4 * i] if i % 2 == 0 else list(range(9000 * i, 9000 * i + 180))
        body = {
            "rid": f"same-{i}",
            "prompt_len": 512 * len(hashes) + 100,
            "block_hashes": hashes,
            "dry_run": True,
        }
        sa, da = a.call("POST", "/v1/route", body, token=GW)
        sb, db = b.call("POST", "/v1/route", body, token=GW)
        assert sa == sb == 200, (da, db)
        assert same_decision(da, db), (i, da, db)
        decisions.append(da)
    targets = {d["target"] for d in decisions}
    assert "pd" in targets and targets & {"prfaas-a", "prfaas-b"}
    assert any(d["cached_tokens"] > 0 for d in decisions)  # the replicated index was used


def test_a_replica_killed_mid_load_loses_nothing(
    replicas: ReplicaFactory,
) -> None:
    a, b = replicas("A"), replicas("B")
    until(lambda: a.health()["up"] and b.health()["up"], what="both replicas on Redis")
    feed(a, b)
    until(lambda: _same_inputs(a, b), what="the same inputs")
    # a report acknowledged by A just before it dies is on B too
    status, ack = a.call(
        "POST", "/v1/links", link("prfaas-a", "tx-late", 0.1e9, 1e9, time.time()), token=DM
    )
    assert status == 200 and ack["replicated"] is True
    results: list[tuple[int, str]] = []
    retries = 0
    stop_at = 400
    kill_at = 150

    def client() -> None:
        """The gateway side: round-robin over replicas, one retry on the other one."""
        nonlocal retries
        order = [a, b]
        for i in range(stop_at):
            if i == kill_at:
                threading.Thread(target=a.kill, daemon=True).start()
            body = {"rid": f"load-{i}", "prompt_len": 30_000 + 100 * i}
            first, second = order[i % 2], order[(i + 1) % 2]
            for attempt, r in enumerate((first, second)):
                try:
                    status, d = r.call("POST", "/v1/route", body, token=GW)
                except OSError:
                    status, d = 0, None
                if status in (200, 429):
                    results.append((status, d["target"]))
                    break
                if attempt == 0:
                    retries += 1
                else:
                    results.append((status, "failed"))
            time.sleep(0.005)

    t = threading.Thread(target=client)
    t.start()
    t.join(120)
    assert not t.is_alive()
    failed = [r for r in results if r[1] == "failed"]
    assert len(results) == stop_at and not failed, failed[:5]
    assert retries >= 1  # requests did hit the dead replica and were retried
    # B has everything A acknowledged, and takes over the leader lease
    assert "tx-late" in b.state()["links"]["prfaas-a->pd"]["reporters"]
    until(lambda: b.health()["leader"], timeout=10, what="B to take the leader lease")
    counts = b.state()["counts"]
    assert counts["decisions"] >= stop_at - 5  # A's bookings reached B before it died


def test_a_replica_cut_off_from_redis_keeps_routing_and_catches_up(
    replicas: ReplicaFactory, redis_server: RedisServer
) -> None:
    a, b = replicas("A"), replicas("B")
    until(lambda: a.health()["up"] and b.health()["up"], what="both replicas on Redis")
    feed(a, b)
    until(lambda: _same_inputs(a, b), what="the same inputs")
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # Redis hangs: every call times out
    try:
        body = {"rid": "outage-0", "prompt_len": 40_000, "dry_run": True}
        until(lambda: not a.health()["up"], timeout=10, what="A to notice Redis is gone")
        h = a.health()
        assert h["degraded"] is True and h["last_error"]
        assert h["controls_threshold"] is True  # cut off, it runs its own controller
        _, metrics = a.call("GET", "/metrics")
        assert "xdc_router_replication_up 0.0" in metrics
        for i in range(20):  # routing goes on, on the last state
            status, d = a.call("POST", "/v1/route", {**body, "rid": f"o-{i}"}, token=GW)
            assert status == 200 and d["target"]
        status, ack = a.call(
            "POST", "/v1/links", link("prfaas-b", "tx-outage", 1e9, 8e9, time.time()), token=DM
        )
        assert status == 200 and ack["accepted"] is True and ack["replicated"] is False
        assert a.health()["outbox"] >= 1
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    until(lambda: a.health()["up"], timeout=15, what="A to reconnect")
    until(lambda: a.health()["outbox"] == 0, timeout=10, what="A's outbox to drain")
    until(
        lambda: "tx-outage" in b.state()["links"]["prfaas-b->pd"]["reporters"],
        timeout=10,
        what="B to receive what A took in during the outage",
    )
    # a replica started now rebuilds everything from Redis
    c = replicas("C")
    until(lambda: c.health()["up"], what="C on Redis")
    until(lambda: _same_inputs(b, c), what="C to hold the shared inputs")
    assert "tx-outage" in c.state()["links"]["prfaas-b->pd"]["reporters"]


def test_malformed_shared_entries_are_skipped_not_fatal(
    replicas: ReplicaFactory, redis_server: RedisServer
) -> None:
    import redis as redis_client

    r = redis_client.Redis.from_url(redis_server.url)
    try:
        # garbage where a replica starting now reads its snapshot, and in every stream
        r.hset("t:links", "prfaas-a->pd|evil", b"{not json")
        r.hset("t:nodes", "pd|evil", b'{"n": {"cluster": "nowhere", "name": "x", "role": "d"}}')
        a = replicas("A")
        until(lambda: a.health()["up"], what="A on Redis despite a bad snapshot")
        r.xadd("t:reports", {"r": "evil", "k": "link", "d": b"[1, 2"})
        r.xadd("t:cache", {"r": "evil", "s": "xdc", "d": b'[["stored", "pd", "n", -1, [1]]]'})
        for row in (
            b'[["window_stored", "pd", "n", 1, [1], "4"]]',
            b'[["stored", 1, 2, 3, 4, 5, 6]]',
        ):
            r.xadd("t:cache", {"r": "evil", "s": "xdc", "d": row})
        r.xadd("t:book", {"r": "evil", "d": b'[["x"]]'})
        b = replicas("B")
        until(lambda: b.health()["up"], what="B on Redis")
        status, ack = b.call("POST", "/v1/links", link("prfaas-a", "ok-1", 1e9, 2e9, 1.0), token=DM)
        assert status == 200 and ack["replicated"] is True
        until(
            lambda: "ok-1" in a.state()["links"]["prfaas-a->pd"]["reporters"],
            what="A to keep applying good input after bad",
        )
        _, metrics = a.call("GET", "/metrics")
        errors = [
            ln for ln in metrics.splitlines() if ln.startswith("xdc_router_replication_errors")
        ]
        assert errors and float(errors[0].split()[-1]) >= 5
        assert a.call("POST", "/v1/route", {"rid": "q", "prompt_len": 100}, token=GW)[0] == 200
    finally:
        r.close()


def test_a_follower_prices_requests_with_the_leaders_profile_drift(
    replicas: ReplicaFactory, endpoint: MetricsEndpoint
) -> None:
    """Only the leader replans, so only it corrects the profile for drift; it publishes the
    factors with t, and a follower routes with them: the two still give the same decisions
    (same predicted TTFT) after a PD engine slowed down."""
    from xdc.scheduler.profile import load_profile

    per = load_profile(TWO).pd.prefill_time(8192)
    extra = (
        f"router.vllm_metrics=pd/pd-0@prefill=http://127.0.0.1:{endpoint.port}/metrics",
        "router.vllm_metrics_interval_s=0.05",
        "router.replan_interval_s=0.3",
    )
    endpoint.body = vllm_scrape(0, 0.0, 0.0)
    a = replicas("A", extra)
    until(lambda: a.health()["up"] and a.health()["leader"], what="A leading")
    b = replicas("B", extra)
    until(lambda: b.health()["up"], what="B on Redis")
    assert b.health()["leader"] is False
    for n in (10, 20, 30, 40):  # four scrape windows of PD prefills 3x slower than profiled
        endpoint.body = vllm_scrape(n, n * per * 3.0, n * 8192.0)
        time.sleep(0.2)
    until(lambda: a.state()["profile_drift"]["applied"]["pd"] > 2.5, what="the leader to correct")
    applied = a.state()["profile_drift"]["applied"]
    until(
        lambda: b.state()["profile_drift"]["applied"] == applied,
        what=f"the follower to adopt {applied}",
    )
    assert b.state()["counts"]["profile_corrections"] >= 1
    body = {
        "rid": "d",
        "prompt_len": 8192,
        "block_hashes": list(range(5000, 5016)),
        "dry_run": True,
    }
    da = a.call("POST", "/v1/route", body, token=GW)[1]
    db = b.call("POST", "/v1/route", body, token=GW)[1]
    assert same_decision(da, db), (da, db)
    assert a.state()["threshold"] == b.state()["threshold"]


def test_cache_events_keep_their_window_through_redis() -> None:
    """A sliding-window engine's window events reach every replica with their window; a row
    from a replica older than window events (five fields) reads as before."""
    ev = CacheEvent("window_stored", "pd", "n1", 7, (1, 2), 4)
    assert cache_event(orjson.loads(orjson.dumps(cache_row(ev)))) == ev
    assert cache_event(["evicted", "pd", "n1", 8, [3]]) == CacheEvent(
        "evicted", "pd", "n1", 8, (3,)
    )
    for bad in (
        ["stored"],
        ["window_stored", "pd", "n", 1, [1], 2.5],
        "x",
        ["stored", "pd", "n", True, [1]],
    ):
        with pytest.raises(ValueError):
            cache_event(bad)
