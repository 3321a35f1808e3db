"""A steady stream of verified requests through a daemon pair (WAN tests, soak benchmark): a
producer thread keeps a few requests in flight, a consumer checks every byte that arrives,
and a watcher records the sender's link state every 100 ms."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError


@dataclass
class StreamStats:
    begun: int = 0
    delivered: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    corrupt: list[str] = field(default_factory=list)
    received: int = 0
    bytes: int = 0
    states: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)  # BEGIN -> all acked, per request


class Streamer:
    def __init__(
        self,
        tx_sock: str,
        rx_sock: str,
        sizes: list[int],
        *,
        in_flight: int = 3,
        deadline_s: float = 30.0,
        fill: bool = True,
        rate_bps: float | None = None,
    ) -> None:
        if rate_bps is not None and not rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0, got {rate_bps}")
        self.rate_bps = rate_bps  # offered load; None = as fast as the sender takes it
        self.tx_sock, self.rx_sock, self.sizes = tx_sock, rx_sock, sizes
        self.in_flight, self.deadline_s, self.fill = in_flight, deadline_s, fill
        self.stats = StreamStats()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._produce, daemon=True),
            threading.Thread(target=self._consume, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]
        self._producer_done = threading.Event()
        self._done_consuming = threading.Event()

    def __enter__(self) -> Streamer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, drain_s: float = 30.0) -> StreamStats:
        self._stop.set()
        self._producer_done.wait(drain_s)
        deadline = time.monotonic() + drain_s
        while self.stats.received < self.stats.delivered and time.monotonic() < deadline:
            time.sleep(0.05)
        self._done_consuming.set()
        self._threads[1].join(2.0)  # it waits at most 0.5 s per poll; the daemons outlive it
        self._threads[2].join(2.0)
        return self.stats

    def link_state(self) -> dict[str, Any]:
        with PrefillClient(self.tx_sock) as c:
            return dict(c.status().get("link") or {})

    def _produce(self) -> None:
        try:
            with PrefillClient(self.tx_sock) as tx:
                pending: list[str] = []
                k = 0
                t0 = time.monotonic()
                per_request_s = sum(self.sizes) * 8 / self.rate_bps if self.rate_bps else 0.0
                while not self._stop.is_set():
                    if per_request_s:
                        # offered load: request k begins no earlier than k x its share
                        self._stop.wait(max(0.0, t0 + k * per_request_s - time.monotonic()))
                        if self._stop.is_set():
                            break
                    rid = f"s-{k}"
                    k += 1
                    try:
                        t = tx.begin(rid, self.sizes, deadline_s=self.deadline_s)
                        self.stats.begun += 1
                        for i in range(len(self.sizes)):
                            buf = t.layer_buffer(i)
                            if self.fill:
                                fill_layer(buf, rid, i)
                            del buf
                            t.layer_ready(i)
                    except TransferError as e:
                        # refused (TOO_BUSY, a receiver gone...): a definite outcome, counted;
                        # the stream goes on with the next request
                        self.stats.failed[rid] = str(e)
                        self._stop.wait(0.1)
                        continue
                    pending.append(rid)
                    while len(pending) >= self.in_flight:
                        self._settle(tx, pending.pop(0))
                for rid in pending:
                    self._settle(tx, rid)
        finally:
            self._producer_done.set()

    def _settle(self, tx: PrefillClient, rid: str) -> None:
        try:
            o = tx.wait(rid, self.deadline_s + 10)
        except TransferError as e:
            self.stats.failed[rid] = str(e)
            return
        if o.ok:
            self.stats.delivered += 1
            self.stats.bytes += o.bytes
            self.stats.transfer_s.append(o.elapsed_s)
        else:
            self.stats.failed[rid] = f"{o.code}: {o.error}"

    def _consume(self) -> None:
        with DecodeClient(self.rx_sock) as rx:
            while not self._done_consuming.is_set():
                try:
                    req = rx.await_request(timeout=0.5)
                except TransferError:
                    continue
                if self.fill:
                    for i, size in enumerate(req.layer_sizes):
                        if layer_digest(req.layer(i)) != expected_digest(req.rid, i, size):
                            self.stats.corrupt.append(req.rid)
                            break
                req.release()
                self.stats.received += 1

    def _watch(self) -> None:
        with PrefillClient(self.tx_sock) as c:
            while not self._producer_done.is_set():
                link = dict(c.status().get("link") or {})
                self.stats.states.append((time.time(), str(link.get("state")), link))
                time.sleep(0.1)
