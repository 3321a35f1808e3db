"""TTFT at a vLLM decode instance: prefill remote over xdc vs the decode instance prefilling
itself, on a shaped link between two network namespaces (root; xdc/lab/netlab.py).

The producer instance and its sender run in namespace a, the consumer (decode) instance and its
receiver in namespace b, joined by a veth shaped with tc tbf (default 1 Gbit/s). For each prompt
length, interleaved in every repeat:

- remote: the decode request (max_tokens 1) and the prefill request go out together, as a
  gateway sends them; TTFT = submit -> the decode's first token;
- local: the same prompt to the decode instance with no transfer: its own prefill.

From the sender's log, per transfer: the bytes moved per prompt token, and the tail, i.e. the
time from the last layer handed over (the producer's last forward step) to the transfer
complete at the receiver, next to one layer's wire time on the link (layer bytes / rate).
Medians of repeats; both instances pinned to their own core on a 2-core machine, so "remote" is
not faster hardware: the difference is xdc's cost.

``--models dense,hybrid`` runs the test models side by side, interleaved in every repeat, on
the same daemons and link: the dense 4-layer Llama and the Qwen3-Next-shaped hybrid (2 linear
attention + 2 full attention layers) share hidden size, heads and layer count, so the ratio of
their bytes per token is PrfaaS's case for hybrid models (``sliding``: the Gemma-3-shaped one).

    python bench/vllm_ttft.py --repeats 3 --json-out bench/results/vllm_ttft_2core.json
    python bench/vllm_ttft.py --models dense,hybrid --json-out bench/results/vllm_ttft_hybrid.json
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

from xdc.lab.netlab import NetLab, unavailable_reason
from xdc.lab.vllm_rig import (
    Engine,
    VllmMissing,
    hybrid_model,
    need_vllm,
    prompt,
    sliding_model,
    test_model,
)

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
    ap.add_argument(
        "--models",
        default="dense",
        help="comma-separated test models, side by side: dense, hybrid (1:1), hybrid31 (3:1), "
        "sliding",
    )
    ap.add_argument("--json-out", default="")
    a = ap.parse_args()
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        ap.error(f"--models: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(MODELS)}")
    why = unavailable_reason()
    if why is not None:
        print(f"netlab unavailable: {why}", file=sys.stderr)
        return 2
    need_vllm_or_exit()
    lengths = [int(x) for x in a.lengths.split(",")]
    wd = Path(tempfile.mkdtemp(prefix="xdc-bench-vllm-"))
    rows: dict[tuple[str, int], dict[str, list[float]]] = {
        (model, n): {
            "remote": [],
            "local": [],
            "producer_prefill": [],
            "producer_alone": [],
            "tail_ms": [],
            "layer_wire_ms": [],
            "bytes_per_token": [],
        }
        for model in models
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
        pairs: dict[str, tuple[Engine, Engine]] = {}
        try:
            for model in models:
                path = MODELS[model][0]()
                pairs[model] = (
                    Engine(
                        "producer",
                        core=0,
                        sender_socket=tx_cfg.sender.control_socket,
                        max_num_batched_tokens=a.batch,
                        netns=lab.ns_a,
                        model=path,
                    ),
                    Engine(
                        "consumer",
                        core=1,
                        receiver_socket=rx_cfg.receiver.control_socket,
                        max_num_batched_tokens=a.batch,
                        netns=lab.ns_b,
                        model=path,
                    ),
                )
            for producer, consumer in pairs.values():
                for n in lengths:  # warm-up: one of each per length
                    rid = f"warm-{n}-{uuid.uuid4().hex[:6]}"
                    _remote(producer, consumer, prompt(n, 0), rid)
                    consumer.generate([prompt(n, 1)], None, 1)
            for rep in range(a.repeats):
                for model, (producer, consumer) in pairs.items():
                    for n in lengths:
                        _one(a, rows[model, n], producer, consumer, tx, model, n, rep)
        finally:
            for producer, consumer in pairs.values():
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
        "models": {m: MODELS[m][1] for m in models},
        "rows": [],
    }
    print(
        f"\n{'model':>7} {'tokens':>7} {'KV B/token':>11} {'TTFT remote':>12} "
        f"{'TTFT local':>11} {'ratio':>6} "
        f"{'prefill+send':>13} {'prefill alone':>14} {'tail':>8} {'1 layer on wire':>16}"
    )
    for (model, n), r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        out["rows"].append(
            {
                "model": model,
                "tokens": n,
                **{f"{k}_median": round(v, 5) for k, v in med.items()},
                "raw": r,
            }
        )
        print(
            f"{model:>7} {n:>7} {med['bytes_per_token']:>11.0f} {med['remote'] * 1e3:>10.0f}ms "
            f"{med['local'] * 1e3:>9.0f}ms "
            f"{med['remote'] / med['local']:>6.2f} {med['producer_prefill'] * 1e3:>11.0f}ms "
            f"{med['producer_alone'] * 1e3:>12.0f}ms {med['tail_ms']:>6.1f}ms "
            f"{med['layer_wire_ms']:>14.2f}ms"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0


# the test models (tests/vllm_fixtures.py): all 4 layers, hidden 256, 4 heads / 2 KV heads x 64
MODELS: dict[str, tuple[Any, str]] = {
    "dense": (test_model, "4-layer Llama, 4 full-attention layers, bf16"),
    "hybrid": (
        hybrid_model,
        "Qwen3-Next shape: 2 gated-delta-net + 2 full-attention layers, MoE, bf16",
    ),
    "hybrid31": (
        lambda: hybrid_model(4),
        "Qwen3-Next shape, Qwen3.5's mix: 3 gated-delta-net + 1 full-attention layer, MoE, bf16",
    ),
    "sliding": (sliding_model, "Gemma-3 shape: 3 sliding-window (64) + 1 full layer, bf16"),
}


def _one(
    a: argparse.Namespace,
    row: dict[str, list[float]],
    producer: Engine,
    consumer: Engine,
    tx: DaemonProcess,
    model: str,
    n: int,
    rep: int,
) -> None:
    """One interleaved measurement of one length: remote, local, the producer alone."""
    seed = 100 * rep + n
    rid = f"b-{model}-{n}-{rep}-{uuid.uuid4().hex[:6]}"
    t_remote = _remote(producer, consumer, prompt(n, seed), rid)
    t0 = time.monotonic()
    consumer.generate([prompt(n, seed + 7)], None, 1)
    t_local = time.monotonic() - t0
    alone = producer.generate([prompt(n, seed + 9)], None, 1)[0]["seconds"]
    m = _delivery(tx, rid)
    layer_bytes = m["bytes"] / 4  # the test models have 4 layers
    row["producer_alone"].append(alone)
    row["remote"].append(t_remote)
    row["producer_prefill"].append(_remote.producer_s)  # type: ignore[attr-defined]
    row["local"].append(t_local)
    row["tail_ms"].append(m["tail_ms"])
    row["layer_wire_ms"].append(layer_bytes * 8 / (a.rate * 1e9) * 1e3)
    row["bytes_per_token"].append(m["bytes"] / n)
    print(
        f"rep {rep + 1} {model} n={n}: TTFT remote {t_remote * 1e3:.0f} ms (producer "
        f"prefill {_remote.producer_s * 1e3:.0f} ms, alone {alone * 1e3:.0f} ms), "  # type: ignore[attr-defined]
        f"local {t_local * 1e3:.0f} ms, tail {m['tail_ms']:.1f} ms "
        f"({m['bytes'] / 1e6:.2f} MB, {m['bytes'] / n:.0f} B/token, {m['resent']} resent)",
        flush=True,
    )


def need_vllm_or_exit() -> None:
    try:
        need_vllm()
    except VllmMissing as e:
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
