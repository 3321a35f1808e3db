"""`xdc demo`: the whole data path on one machine.

Starts a receiver and a sender daemon (real processes, real TCP over loopback), then plays a
synthetic prefill engine that produces requests layer by layer at the pace of the PrfaaS
case-study model, while a synthetic decode engine takes complete requests from the receiver
and checks every byte against what was produced. Exits non-zero if any request was lost or
corrupted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from xdc.config import SenderConfig
from xdc.errors import ResultCode, XdcError
from xdc.lab.synthetic import SyntheticRequest, fill_layer, layer_digest, make_requests
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError
from xdc.transport.launcher import DaemonProcess, local_pair_config, pair_flag_problems


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", "-n", type=int, default=24, help="requests to stream")
    parser.add_argument(
        "--scale",
        type=float,
        default=0.05,
        help="fraction of the case-study model's KV bytes and prefill time (default 0.05)",
    )
    parser.add_argument("--layers", type=int, default=48, help="model layers (default 48)")
    parser.add_argument("--connections", type=int, default=8, help="parallel TCP connections")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=SenderConfig().chunk_bytes // 1024,
        help="chunk size in KiB",
    )
    parser.add_argument("--seed", type=int, default=1, help="workload seed")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this long")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--workdir", help="keep configs and daemon logs here")


@dataclass
class Tally:
    produced: dict[str, dict[int, int]] = field(default_factory=dict)  # rid -> layer -> digest
    last_handed: dict[str, float] = field(default_factory=dict)
    first_begin: float = 0.0
    bytes_handed: int = 0
    bytes_delivered: int = 0
    delivered: dict[str, float] = field(default_factory=dict)  # rid -> time complete at decode
    corrupt: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    resent_chunks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _progress(t: Tally, total_bytes: int, n: int, final: bool = False) -> None:
    frac = t.bytes_delivered / total_bytes if total_bytes else 1.0
    width = 30
    bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
    msg = (
        f"\r[{bar}] {frac * 100:5.1f}%  {len(t.delivered)}/{n} requests  "
        f"{t.bytes_delivered / 2**20:8.1f} MiB"
    )
    if sys.stderr.isatty() or final:
        sys.stderr.write(msg + ("\n" if final else ""))
        sys.stderr.flush()


def _decode_engine(path: str, n: int, t: Tally, deadline: float, stop: threading.Event) -> None:
    """``stop``: the demo is ending (done, or cut short by Ctrl-C or SIGTERM); the daemons go
    next, and a call cut off by that is the end, not a traceback."""
    with DecodeClient(path) as rx:
        while (
            len(t.delivered) + len(t.failed) < n
            and time.monotonic() < deadline
            and not stop.is_set()
        ):
            try:
                req = rx.await_request(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            except TransferError as e:
                if e.code == "TIMEOUT":
                    continue
                raise
            except XdcError:
                if stop.is_set():
                    return
                raise
            now = time.monotonic()
            ok = True
            for i in range(len(req.layer_sizes)):
                with t.lock:
                    want = t.produced.get(req.rid, {}).get(i)
                if want is None or layer_digest(req.layer(i)) != want:
                    ok = False
            req.release()
            with t.lock:
                t.delivered[req.rid] = now
                t.bytes_delivered += req.total_bytes
                if not ok:
                    t.corrupt.append(req.rid)


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags at once, each naming its flag."""
    p = []
    if args.requests < 1:
        p.append("--requests: must be >= 1")
    if not 0 < args.scale <= 1:
        p.append("--scale: 0 < scale <= 1")
    if args.layers < 1:
        p.append("--layers: must be >= 1")
    if not 0 < args.timeout <= 86400:
        p.append("--timeout: 0 < s <= 86400")
    return p + pair_flag_problems(args.connections, args.chunk_kib)


def run(args: argparse.Namespace) -> int:
    problems = check_args(args)
    if problems:
        print("xdc demo: " + "; ".join(problems), file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else None
    if workdir:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=workdir):
                pass  # the configs and logs will be written here: say now if they cannot be
        except OSError as e:
            print(f"xdc demo: --workdir {workdir}: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        return _run(args, workdir)
    except (RuntimeError, XdcError) as e:
        print(f"xdc demo: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, workdir: Path | None) -> int:
    reqs = make_requests(args.requests, layers=args.layers, scale=args.scale, seed=args.seed)
    biggest = max(r.total_bytes for r in reqs)
    tx_cfg, rx_cfg, wd = local_pair_config(
        workdir,
        connections=args.connections,
        chunk_bytes=args.chunk_kib * 1024,
        send_pool=max(64 << 20, 2 * max(max(r.layer_sizes) for r in reqs)),
        recv_pool=max(256 << 20, 4 * biggest),
    )
    total = sum(r.total_bytes for r in reqs)
    print(
        f"xdc demo: {len(reqs)} requests, {total / 2**20:.1f} MiB of KV "
        f"({args.layers} layers, scale {args.scale}) over {args.connections} TCP connections"
    )
    rx = DaemonProcess("receiver", rx_cfg, wd)
    tx: DaemonProcess | None = None
    tally = Tally()
    deadline = time.monotonic() + args.timeout
    stop = threading.Event()
    decoder: threading.Thread | None = None
    try:
        rx.wait_ready()
        tx = DaemonProcess("sender", tx_cfg, wd)
        tx.wait_ready()
        decoder = threading.Thread(
            target=_decode_engine,
            args=(rx_cfg.receiver.control_socket, len(reqs), tally, deadline, stop),
            daemon=True,
        )
        decoder.start()
        outcomes: set[str] = set()
        # a call blocked on a full pool (nobody decoding) gives up by the demo's deadline too
        with PrefillClient(tx_cfg.sender.control_socket, timeout=min(60.0, args.timeout)) as engine:
            tally.first_begin = time.monotonic()
            try:
                _produce(engine, reqs, tally, total, deadline, outcomes)
                waits = sorted({r.rid for r in reqs} - outcomes)
            except XdcError as e:
                # out of time, or the sender broke: what was not handed over in full failed
                waits = []
                for r in reqs:
                    if r.rid not in tally.last_handed:
                        tally.failed.setdefault(r.rid, f"not produced: {e}")
            for rid in waits:
                try:
                    o = engine.wait(rid, max(0.1, deadline - time.monotonic()))
                except XdcError as e:
                    tally.failed[rid] = str(e)
                    continue
                tally.resent_chunks += o.resent_chunks
                if not o.ok:
                    tally.failed[rid] = f"{o.code}: {o.error}"
                _progress(tally, total, len(reqs))
        decoder.join(max(0.1, deadline - time.monotonic()))
        _progress(tally, total, len(reqs), final=True)
        rx_status = DecodeClient(rx_cfg.receiver.control_socket).status()
    finally:
        stop.set()
        if decoder is not None:
            decoder.join(5)
        if tx is not None:
            tx.stop()
        rx.stop()
        if not args.workdir:
            shutil.rmtree(wd, ignore_errors=True)
    return _summary(args, reqs, tally, rx_status)


def _produce(
    engine: PrefillClient,
    reqs: list[SyntheticRequest],
    tally: Tally,
    total: int,
    deadline: float,
    outcomes: set[str],
) -> None:
    """The synthetic prefill engine: each request layer by layer, handed over as it is
    "computed"; TransferError(TIMEOUT) once ``deadline`` (``--timeout``) has passed."""
    for r in reqs:
        transfer = engine.begin(r.rid, r.layer_sizes, deadline_s=60.0)
        digests: dict[int, int] = {}
        with tally.lock:
            tally.produced[r.rid] = digests
        for i, size in enumerate(r.layer_sizes):
            if time.monotonic() >= deadline:
                raise TransferError(ResultCode.TIMEOUT, "--timeout reached")
            time.sleep(r.layer_seconds)  # "computing" layer i; layer i-1 is on the wire
            buf = transfer.layer_buffer(i)
            fill_layer(buf, r.rid, i)
            with tally.lock:
                digests[i] = layer_digest(buf)
            del buf
            transfer.layer_ready(i)
            tally.bytes_handed += size
        tally.last_handed[r.rid] = time.monotonic()
        for o in engine.poll_outcomes():
            outcomes.add(o.rid)
            tally.resent_chunks += o.resent_chunks
            if not o.ok:
                tally.failed[o.rid] = f"{o.code}: {o.error}"
        _progress(tally, total, len(reqs))


def _summary(args: argparse.Namespace, reqs: list, tally: Tally, rx_status: dict) -> int:  # type: ignore[type-arg]
    delivered_ok = [rid for rid in tally.delivered if rid not in tally.corrupt]
    lost = [r.rid for r in reqs if r.rid not in tally.delivered and r.rid not in tally.failed]
    tails = sorted(
        (tally.delivered[rid] - tally.last_handed[rid]) * 1e3
        for rid in tally.delivered
        if rid in tally.last_handed
    )
    span = max(tally.delivered.values(), default=tally.first_begin) - tally.first_begin
    nbytes = sum(r.total_bytes for r in reqs if r.rid in tally.delivered)
    summary = {
        "requests": len(reqs),
        "delivered_intact": len(delivered_ok),
        "failed": len(tally.failed),
        "lost": len(lost),
        "corrupted": len(tally.corrupt),
        "bytes": nbytes,
        "wall_s": round(span, 3),
        "goodput_gbps": round(nbytes * 8 / span / 1e9, 3) if span > 0 else 0.0,
        "tail_ms_p50": round(statistics.median(tails), 2) if tails else None,
        "tail_ms_max": round(tails[-1], 2) if tails else None,
        "checksum_failures": rx_status.get("checksum_failures", 0),
        "resent_chunks": tally.resent_chunks,
        "connections": args.connections,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print()
        print(f"{'requests':<28}{summary['requests']}")
        print(f"{'delivered intact':<28}{summary['delivered_intact']}")
        print(f"{'failed (reported)':<28}{summary['failed']}")
        print(f"{'lost / corrupted':<28}{summary['lost']} / {summary['corrupted']}")
        print(f"{'bytes':<28}{nbytes / 2**20:.1f} MiB")
        print(f"{'wall time':<28}{span:.2f} s (paced by synthetic prefill)")
        print(f"{'goodput':<28}{summary['goodput_gbps']} Gbit/s")
        if tails:
            print(
                f"{'tail after last layer':<28}p50 {summary['tail_ms_p50']} ms, "
                f"max {summary['tail_ms_max']} ms"
            )
        else:
            print(f"{'tail after last layer':<28}- (no request delivered)")
        print(f"{'checksum failures':<28}{summary['checksum_failures']}")
        print(f"{'chunks resent':<28}{summary['resent_chunks']}")
        for rid, why in sorted(tally.failed.items()):
            print(f"  failed {rid}: {why}")
    bad = summary["lost"] or summary["corrupted"] or summary["failed"]
    return 1 if bad else 0
