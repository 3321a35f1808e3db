"""HTTP load on a real `xdc router` subprocess over loopback: decisions/s and latency.

Target (issue 4): at least 2,000 decisions/s with p99 under 10 ms on a 2-core machine. The
router runs as its own process (``python -m xdc router --port 0``); this process preloads its
prefix index with 100K cached blocks through ``/v1/cache/events`` and a fresh link state
through ``/v1/links``, then fires ``POST /v1/route`` for 128K-token prompts (256 block hashes,
a mix of full, partial and missed prefixes) open-loop at ``--rate`` requests/s for
``--duration`` seconds. Open loop means requests are sent on schedule whether or not earlier
ones have answered, so latency includes any queueing the router causes. ``--rate 0`` runs
closed-loop with ``--concurrency`` workers to find the ceiling instead.

Latency is measured client-side up to the full response, from each request's due time (so a
late generator counts against the result) and, separately, from the actual send. 200 and 429
are both decisions. By default every decision is booked against node queues, so at 2,000
128K-token prompts/s the simulated 12-node cluster saturates within a second and nearly all
answers are 429 (a fully evaluated rejection); ``--dry-run`` routes without booking (all 200).
The report includes CPU per decision for router and generator: both share the machine's cores,
so other load on the box shows up directly in the tail (see the per-second p99 series).

``--backend redis`` runs ``--replicas`` (2) routers sharing state through a throwaway
redis-server (random port, temp dir): the preload goes to the first, the run waits until every
replica's index holds the same entries, then loads them round-robin at the same total rate;
CPU per decision is summed over the replicas. ``--backend both --repeat N`` interleaves the
in-process router and the replicas N times and prints medians side by side.

    python bench/router_load.py [--rate 2000] [--duration 10] [--backend memory|redis|both]
        [--repeat 3] [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

GW, DM = "bench-gateway", "bench-daemon"
HASHES = 256
NODES = [("prfaas", f"prfaas-{i}") for i in range(4)] + [("pd", f"pd-{i}") for i in range(8)]


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def start_router(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "xdc",
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--set",
        f"router.gateway_token={GW}",
        "--set",
        f"router.daemon_token={DM}",
        "--set",
        "node.log_level=warning",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"router did not start: {line!r}")
    return proc, line.split()[4]


async def preload(
    session: aiohttp.ClientSession, url: str, blocks: int, seed: int
) -> list[list[int]]:
    """Store prompts on nodes until the index holds ``blocks`` entries; return the prompts."""
    rnd = random.Random(seed)
    prompts: list[list[int]] = []
    seq = {n: 0 for n in NODES}
    stored = 0
    batch: list[dict[str, Any]] = []
    hdr = {"Authorization": f"Bearer {DM}"}
    while stored < blocks:
        hs = [rnd.getrandbits(64) for _ in range(HASHES)]
        prompts.append(hs)
        node = NODES[len(prompts) % len(NODES)]
        seq[node] += 1
        keep = rnd.randint(HASHES // 4, HASHES)
        stored += keep
        batch.append(
            {
                "kind": "stored",
                "cluster": node[0],
                "node": node[1],
                "seq": seq[node],
                "block_hashes": hs[:keep],
            }
        )
        if len(batch) == 40 or stored >= blocks:
            async with session.post(
                f"{url}/v1/cache/events", json={"events": batch}, headers=hdr
            ) as r:
                assert r.status == 200, await r.text()
            batch = []
    link = {
        "from_cluster": "prfaas",
        "to_cluster": "pd",
        "reporter": "bench-sender",
        "utilisation": 0.3,
        "goodput_bps": 30e9,
        "capacity_bps": 100e9,
        "state": "ok",
        "retrans_ratio": 0.0,
        "rtt_ms": 2.0,
        "updated_at": time.time(),
    }
    async with session.post(f"{url}/v1/links", json=link, headers=hdr) as r:
        assert r.status == 200
    return prompts


def _cpus(pids: list[int]) -> float | None:
    """Summed CPU seconds of the router processes (and Redis, when there is one)."""
    total = 0.0
    for pid in pids:
        c = _cpu(pid)
        if c is None:
            return None
        total += c
    return total


def _cpu(pid: int | None) -> float | None:
    """User+system CPU seconds of a process (Linux /proc; None if unavailable)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_replicated(session: aiohttp.ClientSession, urls: list[str], timeout: float) -> None:
    """Until every replica holds as many index entries as the first (replicated preload)."""
    deadline = time.monotonic() + timeout
    while True:
        counts = []
        for u in urls:
            async with session.get(f"{u}/v1/state") as r:
                counts.append((await r.json())["cache_index"]["entries"])
        if len(set(counts)) == 1:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"replicas did not converge: index entries {counts}")
        await asyncio.sleep(0.2)


async def run_load(
    args: argparse.Namespace, urls: list[str], server_pids: list[int]
) -> dict[str, Any]:
    """Preload the first router, then load all of them round-robin (one request each in
    turn) at ``args.rate`` in total."""
    url = urls[0]
    c0 = time.process_time()
    conn = aiohttp.TCPConnector(limit=args.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=10)
    # The client shares the 2 cores with the router: strip per-request work it does not need.
    async with aiohttp.ClientSession(
        connector=conn,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    ) as session:
        prompts = await preload(session, url, args.blocks, args.seed)
        await _wait_replicated(session, urls, 60.0)
        rnd = random.Random(args.seed + 1)
        bodies: list[bytes] = []
        for i in range(2000):
            hs = [rnd.getrandbits(64) for _ in range(HASHES)] if i % 4 == 3 else rnd.choice(prompts)
            body = {"rid": f"b{i}", "prompt_len": 131_072, "block_hashes": hs}
            if args.dry_run:
                body["dry_run"] = True
            bodies.append(json.dumps(body).encode())
        hdr = CIMultiDict({"Authorization": f"Bearer {GW}", "Content-Type": "application/json"})
        route_urls = [URL(f"{u}/v1/route") for u in urls]  # parsed once, not per request
        lat: list[float] = []  # due time -> response (includes any lateness of the generator)
        svc_lat: list[float] = []  # actual send -> response
        sent_at: list[float] = []  # when each measured request was due, for the timeline
        status: dict[int, int] = {}
        errors: list[str] = []
        measuring = False

        async def one(i: int, t0: float | None = None) -> None:
            t_send = time.perf_counter()
            t0 = t_send if t0 is None else t0
            try:
                target = route_urls[i % len(route_urls)]
                async with session.post(target, data=bodies[i % len(bodies)], headers=hdr) as r:
                    await r.read()
                    code = r.status
            except (TimeoutError, aiohttp.ClientError) as e:
                errors.append(type(e).__name__)
                return
            if measuring:
                t_end = time.perf_counter()
                lat.append(t_end - t0)
                svc_lat.append(t_end - t_send)
                sent_at.append(t0)
                status[code] = status.get(code, 0) + 1

        await asyncio.gather(*(one(i) for i in range(200)))  # warm-up: connections, caches
        # The generator's own GC pauses would show up as router latency: keep setup objects
        # out of collections (as the router itself does after startup).
        gc.collect()
        gc.freeze()
        measuring = True
        sent = 0
        cpu0 = _cpus(server_pids)
        t_start = time.perf_counter()

        async def worker() -> None:
            """Open loop: request k is due at t_start + k / rate; latency counts from then,
            so a router that falls behind is charged for the wait (no coordinated omission)."""
            nonlocal sent
            while True:
                k = sent
                sent += 1
                due = t_start + k / args.rate if args.rate > 0 else time.perf_counter()
                if due - t_start >= args.duration:
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await one(k, due if args.rate > 0 else None)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        sent = len(lat) + len(errors)
        elapsed = time.perf_counter() - t_start
        cpu1 = _cpus(server_pids)
        async with session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        async with session.get(f"{url}/v1/state") as r:
            state = await r.json()
    client_cpu = time.process_time() - c0
    timeline = _timeline(sent_at, lat, t_start)
    lat.sort()
    svc_lat.sort()
    server_count, server_sum = _histogram(metrics, "xdc_router_route_seconds")
    return {
        "bench": "router_load",
        "mode": (
            f"open-loop {args.rate:g}/s" if args.rate > 0 else f"closed-loop x{args.concurrency}"
        ),
        "duration_s": round(elapsed, 3),
        "sent": sent,
        "decisions": len(lat),
        "decisions_per_s": round(len(lat) / elapsed, 1),
        "status": {str(k): v for k, v in sorted(status.items())},
        "errors": len(errors),
        "latency_ms": {
            "p50": round(_pct(lat, 0.5) * 1e3, 3),
            "p90": round(_pct(lat, 0.9) * 1e3, 3),
            "p99": round(_pct(lat, 0.99) * 1e3, 3),
            "max": round(lat[-1] * 1e3, 3) if lat else None,
        },
        "send_to_response_ms": {
            "p50": round(_pct(svc_lat, 0.5) * 1e3, 3),
            "p99": round(_pct(svc_lat, 0.99) * 1e3, 3),
        },
        "server_route_mean_us": round(server_sum / server_count * 1e6, 1) if server_count else None,
        "server_cpu_us_per_decision": (
            round((cpu1 - cpu0) / len(lat) * 1e6, 1)
            if lat and cpu0 is not None and cpu1 is not None
            else None
        ),
        "client_cpu_us_per_decision": round(client_cpu / len(lat) * 1e6, 1) if lat else None,
        "cached_blocks": state["cache_index"]["entries"],
        "p99_ms_by_second": timeline,
    }


def _timeline(sent_at: list[float], lat: list[float], t0: float) -> list[float]:
    """p99 latency (ms) per second of the run: tells a stall (one bad second, e.g. another
    process taking the CPU) from a router that cannot keep up (every second bad)."""
    buckets: dict[int, list[float]] = {}
    for s, x in zip(sent_at, lat, strict=True):
        buckets.setdefault(int(s - t0), []).append(x)
    return [round(_pct(sorted(v), 0.99) * 1e3, 2) for _, v in sorted(buckets.items())]


def _histogram(text: str, name: str) -> tuple[float, float]:
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_count "):
            count = float(line.split()[1])
        elif line.startswith(f"{name}_sum "):
            total = float(line.split()[1])
    return count, total


class RedisProc:
    """A throwaway redis-server for the replicated scenario (random port, temp dir)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found (deploy/setup-test-env.sh installs it)")
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            self.port = int(sk.getsockname()[1])
        self.dir = tempfile.mkdtemp(prefix="xdc-bench-redis-")
        self.proc = subprocess.Popen(
            [
                *(binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir),
                *("--save", "", "--appendonly", "no", "--logfile", f"{self.dir}/redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise SystemExit("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def run_scenario(args: argparse.Namespace, backend: str, run_no: int) -> dict[str, Any]:
    """One measured run: ``memory`` = one in-process-state router; ``redis`` = two replicas
    sharing state through a redis-server, loaded round-robin at the same total rate."""
    procs: list[subprocess.Popen[str]] = []
    redis_srv: RedisProc | None = None
    extra = [x for kv in args.router_set for x in ("--set", kv)]
    try:
        if backend == "memory":
            proc, url = start_router(extra)
            procs.append(proc)
            urls = [url]
        else:
            redis_srv = RedisProc()
            urls = []
            for name in [f"bench-{k}" for k in range(args.replicas)]:
                proc, url = start_router(
                    [
                        *extra,
                        "--set",
                        "router.shared_state=redis",
                        "--set",
                        f"router.redis_url={redis_srv.url}",
                        "--set",
                        f"router.redis_namespace=bench{run_no}",
                        "--set",
                        f"router.replica_id={name}",
                    ]
                )
                procs.append(proc)
                urls.append(url)
        pids = [p.pid for p in procs]
        res = asyncio.run(run_load(args, urls, pids))
        res["backend"] = backend if backend == "memory" else f"redis x{args.replicas} replicas"
        return res
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if redis_srv is not None:
            redis_srv.close()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="requests/s; 0 = closed loop")
    ap.add_argument(
        "--duration", type=float, default=10.0, help="seconds of measured load (max 120)"
    )
    ap.add_argument("--concurrency", type=int, default=64, help="connection pool size / workers")
    ap.add_argument("--blocks", type=int, default=100_000, help="cached blocks to preload")
    ap.add_argument("--dry-run", action="store_true", help="route without booking node queues")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--url", help="use a running router instead of starting one")
    ap.add_argument(
        "--backend",
        choices=("memory", "redis", "both"),
        default="memory",
        help="one router with in-process state, two replicas on Redis, or both in turn",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per backend, interleaved; medians reported"
    )
    ap.add_argument("--replicas", type=int, default=2, help="router replicas for --backend redis")
    ap.add_argument(
        "--router-set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="extra --set for the routers started (e.g. router.event_loop=asyncio)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="pin the router and the generator to separate CPUs (only on an idle machine: "
        "a busy neighbour on a pinned CPU stalls the run; one router only)",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    args.duration = min(args.duration, 120.0)
    results: list[dict[str, Any]] = []
    if args.url is not None:
        results.append(asyncio.run(run_load(args, [args.url], [])))
        results[-1]["backend"] = "external"
        _print_one(results[-1])
    else:
        backends = ["memory", "redis"] if args.backend == "both" else [args.backend]
        for run_no in range(max(args.repeat, 1)):
            for b in backends:
                res = run_scenario(args, b, run_no)
                res["run"] = run_no
                results.append(res)
                _print_one(res)
    if len(results) > 1:
        _print_summary(results)
    ok = all(
        r["errors"] == 0
        and (
            args.rate <= 0
            or (r["decisions_per_s"] >= 0.98 * args.rate and r["latency_ms"]["p99"] < 10)
        )
        for r in results
    )
    if args.rate > 0:
        print(f"target >= {args.rate:g} decisions/s with p99 < 10 ms: {'PASS' if ok else 'FAIL'}")
    else:
        print("closed loop: ceiling measurement, no target")
    print(json.dumps(results if len(results) > 1 else results[0]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


def _print_one(res: dict[str, Any]) -> None:
    lat = res["latency_ms"]
    print(
        f"[{res['backend']}, run {res.get('run', 0)}] {res['mode']}, {res['duration_s']} s, "
        f"{res['cached_blocks']} cached blocks"
    )
    print(f"{'decisions/s':>12}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}  status")
    print(
        f"{res['decisions_per_s']:12.1f}{lat['p50']:9.3f}{lat['p90']:9.3f}{lat['p99']:9.3f}"
        f"{lat['max']:9.3f}  {res['status']} errors={res['errors']}"
    )
    sr = res["send_to_response_ms"]
    print(
        f"  from actual send: p50 {sr['p50']} ms, p99 {sr['p99']} ms; "
        f"p99 ms per second: {res['p99_ms_by_second']}"
    )
    print(
        f"  CPU per decision: routers {res['server_cpu_us_per_decision']} us (all replicas), "
        f"client {res['client_cpu_us_per_decision']} us, in route "
        f"{res['server_route_mean_us']} us; load avg {os.getloadavg()[0]:.2f} on "
        f"{os.cpu_count()} cores",
        flush=True,
    )


def _print_summary(results: list[dict[str, Any]]) -> None:
    """Medians per backend over the interleaved runs, side by side."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["backend"], []).append(r)
    print(f"\nmedians over {max(len(v) for v in by.values())} interleaved run(s)")
    print(f"{'backend':>20}{'decisions/s':>13}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/dec':>12}")
    for name, rs in by.items():
        cpu = [r["server_cpu_us_per_decision"] for r in rs if r["server_cpu_us_per_decision"]]
        print(
            f"{name:>20}{_median([r['decisions_per_s'] for r in rs]):13.1f}"
            f"{_median([r['latency_ms']['p50'] for r in rs]):9.3f}"
            f"{_median([r['latency_ms']['p99'] for r in rs]):9.3f}"
            f"{_median(cpu):12.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
