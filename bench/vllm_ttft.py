"""TTFT at a vLLM decode instance: prefill remote over xdc vs the decode instance prefilling
itself, on a shaped link between two network namespaces (root; xdc/netlab.py).

The producer instance and its sender run in namespace a, the consumer (decode) instance and its
receiver in namespace b, joined by a veth shaped with tc tbf (default 1 Gbit/s). For each prompt
length, interleaved in every repeat:

- remote: the decode request (max_tokens 1) and the prefill request go out together, as a
  gateway sends them; TTFT = submit -> the decode's first token;
- local: the same prompt to the decode instance with no transfer: its own prefill.

From the sender's log, per transfer: the tail, i.e. the time from the last layer handed over
(the producer's last forward step) to the transfer complete at the receiver, next to one layer's
wire time on the link (layer bytes / rate). Medians of repeats; both instances pinned to their
own core on a 2-core machine, so "remote" is not faster hardware: the difference is xdc's cost.

    python bench/vllm_ttft.py --repeats 3 --json-out bench/results/vllm_ttft.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xdc.transport.launcher import DaemonProcess, local_pair_config

from tests.vllm_fixtures import Engine, need_vllm, prompt
from xdc.netlab import NetLab, unavailable_reason

DELIVERED = re.compile(
    r"request (\S+) delivered: (\d+) bytes in ([\d.]+)s, tail ([\d.]+) ms, (\d+) resent"
)


def main() -> int:
    # SIGTERM unwinds like Ctrl-C, so the namespaces, daemons and engines are torn down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,1024,2048,3584")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=1.0, help="link rate, Gbit/s")
    ap.add_argument("--loss", type=float, default=0.0, help="random loss probability")
    ap.add_argument("--batch", type=int, default=512, help="producer's max tokens per step")
    ap.add_argument("--json-out", default="")
    a = ap.parse_args()
    why = unavailable_reason()
    if why is not None:
        print(f"netlab unavailable: {why}", file=sys.stderr)
        return 2
    need_vllm_or_exit()
    lengths = [int(x) for x in a.lengths.split(",")]
    wd = Path(tempfile.mkdtemp(prefix="xdc-bench-vllm-"))
    rows: dict[int, dict[str, list[float]]] = {
        n: {
            "remote": [],
            "local": [],
            "producer_prefill": [],
            "producer_alone": [],
            "tail_ms": [],
            "layer_wire_ms": [],
        }
        for n in lengths
    }
    with NetLab() as lab:
        lab.set_rate(a.rate)
        if a.loss:
            lab.set_loss(a.loss)
        tx_cfg, rx_cfg, _ = local_pair_config(
            wd, connections=4, send_pool=256 << 20, recv_pool=512 << 20
        )
        rx_cfg.receiver.listen_host = lab.addr_b
        tx_cfg.sender.peer_host = lab.addr_b
        rx = DaemonProcess("receiver", rx_cfg, wd, netns=lab.ns_b)
        rx.wait_ready()
        tx = DaemonProcess("sender", tx_cfg, wd, netns=lab.ns_a)
        tx.wait_ready()
        producer = Engine(
            "producer",
            core=0,
            sender_socket=tx_cfg.sender.control_socket,
            max_num_batched_tokens=a.batch,
            netns=lab.ns_a,
        )
        consumer = Engine(
            "consumer",
            core=1,
            receiver_socket=rx_cfg.receiver.control_socket,
            max_num_batched_tokens=a.batch,
            netns=lab.ns_b,
        )
        try:
            for n in lengths:  # warm-up: one of each per length
                _remote(producer, consumer, prompt(n, 0), f"warm-{n}-{uuid.uuid4().hex[:6]}")
                consumer.generate([prompt(n, 1)], None, 1)
            for rep in range(a.repeats):
                for n in lengths:
                    seed = 100 * rep + n
                    rid = f"b-{n}-{rep}-{uuid.uuid4().hex[:6]}"
                    t_remote = _remote(producer, consumer, prompt(n, seed), rid)
                    t0 = time.monotonic()
                    consumer.generate([prompt(n, seed + 7)], None, 1)
                    t_local = time.monotonic() - t0
                    alone = producer.generate([prompt(n, seed + 9)], None, 1)[0]["seconds"]
                    rows[n]["producer_alone"].append(alone)
                    m = _delivery(tx, rid)
                    layer_bytes = m["bytes"] / 4  # the test model has 4 layers
                    rows[n]["remote"].append(t_remote)
                    rows[n]["producer_prefill"].append(_remote.producer_s)  # type: ignore[attr-defined]
                    rows[n]["local"].append(t_local)
                    rows[n]["tail_ms"].append(m["tail_ms"])
                    rows[n]["layer_wire_ms"].append(layer_bytes * 8 / (a.rate * 1e9) * 1e3)
                    print(
                        f"rep {rep + 1} n={n}: TTFT remote {t_remote * 1e3:.0f} ms (producer "
                        f"prefill {_remote.producer_s * 1e3:.0f} ms, alone {alone * 1e3:.0f} ms), "  # type: ignore[attr-defined]
                        f"local "
                        f"{t_local * 1e3:.0f} ms, tail {m['tail_ms']:.1f} ms "
                        f"({m['bytes'] / 1e6:.2f} MB, {m['resent']} resent)",
                        flush=True,
                    )
        finally:
            producer.close()
            consumer.close()
            tx.stop()
            rx.stop()
    shutil.rmtree(wd, ignore_errors=True)
    out: dict[str, Any] = {
        "machine": "2 cores, 24 GiB",
        "link": {"rate_gbit": a.rate, "loss": a.loss},
        "repeats": a.repeats,
        "producer_batch_tokens": a.batch,
        "model": "xdc test model: 4-layer Llama, hidden 256, 2 KV heads x 64, bf16, block 32",
        "rows": [],
    }
    print(
        f"\n{'tokens':>7} {'TTFT remote':>12} {'TTFT local':>11} {'ratio':>6} "
        f"{'prefill+send':>13} {'prefill alone':>14} {'tail':>8} {'1 layer on wire':>16}"
    )
    for n, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        out["rows"].append(
            {"tokens": n, **{f"{k}_median": round(v, 5) for k, v in med.items()}, "raw": r}
        )
        print(
            f"{n:>7} {med['remote'] * 1e3:>10.0f}ms {med['local'] * 1e3:>9.0f}ms "
            f"{med['remote'] / med['local']:>6.2f} {med['producer_prefill'] * 1e3:>11.0f}ms "
            f"{med['producer_alone'] * 1e3:>12.0f}ms {med['tail_ms']:>6.1f}ms "
            f"{med['layer_wire_ms']:>14.2f}ms"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0


def need_vllm_or_exit() -> None:
    try:
        need_vllm()
    except BaseException as e:  # pytest.skip outside pytest
        print(f"vLLM unavailable: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _remote(producer: Engine, consumer: Engine, ids: list[int], rid: str) -> float:
    t0 = time.monotonic()
    consumer.submit(
        [ids], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": len(ids)}], 1
    )
    producer.submit([ids], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
    consumer.result()
    t = time.monotonic() - t0
    prod = producer.result()[0]
    _remote.producer_s = prod["seconds"]  # type: ignore[attr-defined]
    return t


def _delivery(tx: DaemonProcess, rid: str) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for m in DELIVERED.finditer(tx.log()):
            if m.group(1) == rid:
                return {
                    "bytes": float(m.group(2)),
                    "elapsed_s": float(m.group(3)),
                    "tail_ms": float(m.group(4)),
                    "resent": float(m.group(5)),
                }
        time.sleep(0.05)
    raise RuntimeError(f"{rid} was not delivered:\n{tx.log()[-2000:]}")


if __name__ == "__main__":
    raise SystemExit(main())
