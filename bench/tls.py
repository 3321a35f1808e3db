"""xdc goodput with mutual TLS against the same daemons in plain TCP, on the same link in the
same run (plain and each TLS record layer back to back in every repeat, so machine noise hits
all alike): loopback, and a veth pair shaped with tc tbf (root; see xdc/lab/netlab.py). Reports
medians, the TLS/plain goodput ratio and daemon CPU seconds per GB (both daemons).

    python bench/tls.py --repeats 3 --rates 10 --json-out bench/results/tls_2core.json

Record layers (``tls.record_layer``): "sealed" (the default: AEAD records of 256 KiB after
the handshake, with the cipher both ends negotiate: AEGIS-128L where PyNaCl has it), a cipher
forced with a slash ("sealed/aes-128-gcm", "sealed/aegis-128l": ``tls.record_cipher``), and
"tls" (TLS 1.3's own 16 KiB records through the SSL object).

Certificates come from a throwaway trustme CA; both ends check the other's identity
(allowed_peers) as a deployment would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import trustme
from xdc.transport.sealed_records import SEND_RECORD

from xdc.config import DATA_THREADS, TLS_RECORD_CIPHERS, TLS_RECORD_LAYERS, SenderConfig, TlsConfig
from xdc.lab import bench_transfer as bt
from xdc.lab.netlab import NetLab, shaped_links
from xdc.protocol.aead_records import SAMPLE_EVERY, Cipher
from xdc.protocol.wire.checksum import checksum


def make_pki(root: Path) -> tuple[TlsConfig, TlsConfig]:
    """(sender, receiver) TLS configs with certificates from a fresh CA under ``root``."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    out = []
    for name, peer in (("tx", "rx"), ("rx", "tx")):
        leaf = ca.issue_cert(f"{name}.example")
        leaf.cert_chain_pems[0].write_to_path(str(root / f"{name}.pem"))
        leaf.private_key_pem.write_to_path(str(root / f"{name}.key"))
        out.append(
            TlsConfig(
                "mutual",
                str(root / "ca.pem"),
                str(root / f"{name}.pem"),
                str(root / f"{name}.key"),
                allowed_peers=(f"{peer}.example",),
                server_name="rx.example" if name == "tx" else "",
            )
        )
    return out[0], out[1]


def cipher_floor(
    cipher: Cipher = Cipher.AES_128_GCM, pool_mib: int = 256, repeats: int = 3
) -> dict[str, float]:
    """What sealed records must cost over plain TCP on this machine, from the primitives alone.

    ``cipher`` the way the sealed path runs it: 256 KiB records sealed from a pool too large
    for the caches into one reused buffer (the sender), opened from one buffer into the pool
    (the receiver); every byte is sealed once and opened once. Against that, sealed records
    hash one chunk in ``SAMPLE_EVERY`` where plain hashes every chunk on both ends (xxh3 over
    default-sized chunks of the same cold pool). ``net_s_per_gb`` = cipher - hashes skipped: the CPU
    per GB a TLS run must add to a plain one. Best of ``repeats``, so a noisy neighbour does
    not inflate it."""
    aead = cipher.aead(os.urandom(cipher.key_bytes))
    nonce = os.urandom(cipher.iv_bytes)
    pool = memoryview(bytearray(os.urandom(1 << 20) * pool_mib))
    record, chunk = SEND_RECORD, SenderConfig().chunk_bytes
    sealed = memoryview(bytearray(record + cipher.tag))
    seal_s, open_s, hash_s = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for off in range(0, len(pool), record):
            aead.encrypt_into(nonce, pool[off : off + record], b"", sealed)
        seal_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for off in range(0, len(pool), record):
            aead.decrypt_into(nonce, sealed, b"", pool[off : off + record])
        open_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for off in range(0, len(pool), chunk):
            checksum(pool[off : off + chunk])
        hash_s.append(time.perf_counter() - t)
    gb = len(pool) / 1e9
    seal, open_, hash_ = gb / min(seal_s), gb / min(open_s), gb / min(hash_s)
    cipher_s = 1 / seal + 1 / open_
    skipped = 2 / hash_ * (1 - 1 / SAMPLE_EVERY)
    return {
        "seal_gb_per_s": round(seal, 2),
        "open_gb_per_s": round(open_, 2),
        "xxh3_gb_per_s": round(hash_, 2),
        "cipher_s_per_gb": round(cipher_s, 3),
        "hashes_skipped_s_per_gb": round(skipped, 3),
        "net_s_per_gb": round(cipher_s - skipped, 3),
    }


def _run_in(lab: NetLab, args: argparse.Namespace) -> bt.XdcRun:
    """xdc across the lab's veth: sender in namespace a, receiver in b."""
    return bt.run_xdc(args, lab.ns_a, lab.ns_b, lab.addr_b)


def _link(
    name: str,
    base: argparse.Namespace,
    tls: tuple[TlsConfig, TlsConfig],
    layers: list[str],
    run: Callable[[argparse.Namespace], bt.XdcRun],
) -> dict[str, Any]:
    plain: list[bt.XdcRun] = []
    secure: dict[str, list[bt.XdcRun]] = {layer: [] for layer in layers}
    for rep in range(base.repeats):
        base.tls = None
        plain.append(run(base))
        parts = [f"plain {plain[-1].gbps:6.2f} Gbit/s ({plain[-1].cpu_s_per_gb:.2f} CPU s/GB)"]
        for layer in layers:
            record_layer, _, record_cipher = layer.partition("/")
            base.tls = tuple(
                replace(c, record_layer=record_layer, record_cipher=record_cipher or "auto")
                for c in tls
            )
            secure[layer].append(run(base))
            r = secure[layer][-1]
            parts.append(f"TLS/{layer} {r.gbps:6.2f} Gbit/s ({r.cpu_s_per_gb:.2f} CPU s/GB)")
        print(f"  {name:<26} repeat {rep + 1}: " + ", ".join(parts), file=sys.stderr)
    p_gbps = statistics.median(r.gbps for r in plain)
    p_cpu = statistics.median(r.cpu_s_per_gb for r in plain)
    out: dict[str, Any] = {
        "link": name,
        "plain_gbps": [round(r.gbps, 3) for r in plain],
        "plain_cpu_s_per_gb": [round(r.cpu_s_per_gb, 3) for r in plain],
        "plain_gbps_median": round(p_gbps, 3),
        "plain_cpu_s_per_gb_median": round(p_cpu, 3),
        "failed_requests": sum(r.failed for r in plain)
        + sum(r.failed for runs in secure.values() for r in runs),
    }
    for layer, runs in secure.items():
        t_gbps = statistics.median(r.gbps for r in runs)
        t_cpu = statistics.median(r.cpu_s_per_gb for r in runs)
        out[layer] = {
            "gbps": [round(r.gbps, 3) for r in runs],
            "cpu_s_per_gb": [round(r.cpu_s_per_gb, 3) for r in runs],
            "gbps_median": round(t_gbps, 3),
            "cpu_s_per_gb_median": round(t_cpu, 3),
            # per repeat, side by side, then the median
            "ratio_median": round(
                statistics.median(t.gbps / p.gbps for t, p in zip(runs, plain, strict=True)), 3
            ),
            "cpu_ratio_median": round(
                statistics.median(
                    t.cpu_s_per_gb / p.cpu_s_per_gb for t, p in zip(runs, plain, strict=True)
                ),
                3,
            ),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1", help="shaped link rates in Gbit/s ('' = none)")
    ap.add_argument("--no-loopback", action="store_true")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--request-mib", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-kib", type=int, default=SenderConfig().chunk_bytes // 1024)
    ap.add_argument(
        "--record-layers",
        default="sealed,tls",
        help="TLS record layers to run: sealed (the negotiated cipher), sealed/aes-128-gcm, "
        "sealed/aegis-128l, tls",
    )
    ap.add_argument(
        "--data-threads",
        default="",
        help="loopback once per data_threads setting, e.g. 'off,on' (default: the daemons' "
        "own, auto); sealed records take the threads too, TLS records do not",
    )
    ap.add_argument("--json-out")
    args = ap.parse_args()
    base = argparse.Namespace(**vars(args), congestion_control="on", tcp_congestion="")
    layers = [x.strip() for x in args.record_layers.split(",") if x.strip()]
    for layer in layers:
        record_layer, slash, record_cipher = layer.partition("/")
        if record_layer not in TLS_RECORD_LAYERS or (
            slash and (record_layer != "sealed" or record_cipher not in TLS_RECORD_CIPHERS)
        ):
            ap.error(
                f"--record-layers: {layer!r} is not one of {', '.join(TLS_RECORD_LAYERS)} "
                f"or sealed/<{'|'.join(TLS_RECORD_CIPHERS)}>"
            )
    threads = [x.strip() for x in args.data_threads.split(",") if x.strip()] or [""]
    wrong = [t for t in threads if t and t not in DATA_THREADS]
    if wrong:
        ap.error(f"--data-threads: {', '.join(wrong)} not one of {', '.join(DATA_THREADS)}")
    links: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="xdc-tls-bench-") as d:
        tls = make_pki(Path(d))
        for setting in [] if args.no_loopback else threads:
            base.overrides = (
                {"sender.data_threads": setting, "receiver.data_threads": setting}
                if setting
                else {}
            )
            links.append(
                _link(
                    f"loopback threads={setting}" if setting else "loopback",
                    base,
                    tls,
                    layers,
                    lambda a: bt.run_xdc(a, None, None, "127.0.0.1"),
                )
            )
        base.overrides = {}
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        for rate, lab in shaped_links(rates):
            links.append(
                _link(
                    f"veth tbf {rate:g} Gbit/s",
                    base,
                    tls,
                    layers,
                    partial(_run_in, lab),
                )
            )
    floor = cipher_floor()
    floors = {c.label: floor if c is Cipher.AES_128_GCM else cipher_floor(c) for c in Cipher}
    report = {
        "machine": bt._machine(),
        "params": {k: v for k, v in vars(args).items() if k != "json_out"},
        "cipher_floor": floor,
        "cipher_floors": floors,
        "links": links,
    }
    print(
        f"\n{'link':<26}{'records':>9}{'plain':>9}{'TLS':>9}{'ratio':>8}{'CPU s/GB plain/TLS':>22}"
    )
    for r in links:
        for layer in layers:
            t = r[layer]
            cpu = f"{r['plain_cpu_s_per_gb_median']:.2f}/{t['cpu_s_per_gb_median']:.2f}"
            print(
                f"{r['link']:<26}{layer:>9}{r['plain_gbps_median']:>9.2f}{t['gbps_median']:>9.2f}"
                f"{t['ratio_median']:>8.2f}{cpu:>22}"
            )
    for label, f in floors.items():
        print(
            f"\nprimitives, one core, cold 256 MiB pool: {label} seal {f['seal_gb_per_s']:.2f} "
            f"GB/s, open {f['open_gb_per_s']:.2f} GB/s (+{f['cipher_s_per_gb']:.3f} CPU s/GB); "
            f"xxh3 {f['xxh3_gb_per_s']:.1f} GB/s (sealed skips 15 in 16 chunks' hashes: "
            f"-{f['hashes_skipped_s_per_gb']:.3f}); net +{f['net_s_per_gb']:.3f} CPU s/GB"
        )
        net = f["net_s_per_gb"]
        for r in links:
            p = r["plain_cpu_s_per_gb_median"]
            print(
                f"  {r['link']}: where CPU bounds both runs, sealed/plain goodput <= "
                f"{p:.2f} / ({p:.2f} + {net:.3f}) = {p / (p + net):.2f}"
            )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 1 if any(r["failed_requests"] for r in links) else 0


if __name__ == "__main__":
    sys.exit(main())
