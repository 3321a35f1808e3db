"""The producer's threaded hand-over (xdc.integrations.vllm.saves) against real daemons.

Run by ``tests/integrations/test_kv_handover.py`` with the vLLM venv's Python (torch lives there):
``handover_checks.py TX_SOCK RX_SOCK``. A GPU's copies land after they are made; here each
copy is a ``LateCopy`` that writes its bytes into the pool only when it "lands" (after a
delay, on its own timer), which is what a device-to-host copy on a side stream does. The
hand-over must hand nothing over before it landed, keep each request's order, send the
digest layer last, and report a copy that failed on the device. Prints one JSON line per
case.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
import xxhash
from xdc.transport.engine_client import DecodeClient, PrefillClient

from xdc.integrations.vllm.blocks import digest_layer_bytes
from xdc.integrations.vllm.saves import Handover, Outgoing, SavedCopy

BB = 4096  # bytes a block
BLOCKS = 4  # per layer
LAYERS = 2


class LateCopy:
    """A copy whose bytes reach the pool ``delay_s`` after it was made (or never: ``fail``)."""

    def __init__(self, dst: torch.Tensor, data: torch.Tensor, delay_s: float, fail: bool = False):
        self._landed = threading.Event()
        self.fail = fail

        def land() -> None:
            if not fail:
                dst.copy_(data)
            self._landed.set()

        threading.Timer(delay_s, land).start()

    def done(self) -> bool:
        return self._landed.is_set()

    def wait(self) -> None:
        if not self._landed.wait(10):
            raise TimeoutError("the copy never landed")
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

    def verified(self) -> bool:
        return True


def block(rid: str, layer: int, b: int) -> torch.Tensor:
    seed = xxhash.xxh3_64_intdigest(f"{rid}/{layer}/{b}".encode()) & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=g)


def start(tx: PrefillClient, rid: str, handover: Handover) -> Outgoing:
    sizes = [BB * BLOCKS] * LAYERS + [digest_layer_bytes([BLOCKS] * LAYERS)]
    with handover.lock:
        t = tx.begin(rid, sizes, deadline_s=20)
        views: list[torch.Tensor | None] = [
            torch.from_numpy(t.layer_buffer(i)) for i in range(LAYERS)
        ]
    return Outgoing(t, views, [BLOCKS] * LAYERS, [BB] * LAYERS, f"req-{rid}", made_from(rid))


def made_from(rid: str) -> int:
    """The digest of the prompt the transfer ``rid`` was made from (any number will do)."""
    return xxhash.xxh3_64_intdigest(f"prompt of {rid}".encode())


def save(out: Outgoing, rid: str, step: range, last: bool, delay_s: float, h: Handover) -> None:
    """One engine step: blocks ``step`` of every layer copied (landing after ``delay_s``)."""
    for layer in range(LAYERS):
        view = out.views[layer]
        assert view is not None
        first, n = step.start, len(step)
        data = torch.cat([block(rid, layer, b) for b in step])
        copy = LateCopy(view[first * BB : (first + n) * BB], data, delay_s)
        upto = None if last else (first + n) * BB
        h.submit(out, SavedCopy(layer, first, n, upto, view, copy))


def check_arrived(rx: DecodeClient, rid: str) -> str | None:
    req = rx.await_request(rid, timeout=15)
    try:
        digests = req.layer(LAYERS).view(np.dtype("<u8"))
        for layer in range(LAYERS):
            got = req.layer(layer)
            for b in range(BLOCKS):
                want = block(rid, layer, b).numpy()
                if not np.array_equal(got[b * BB : (b + 1) * BB], want):
                    return f"layer {layer} block {b} arrived with other bytes"
                if int(digests[layer * BLOCKS + b]) != xxhash.xxh3_64_intdigest(want):
                    return f"layer {layer} block {b}: its digest is not the landed bytes'"
        if int(digests[LAYERS * BLOCKS]) != made_from(rid):
            return "the digest layer does not end with the prompt's digest"
    finally:
        req.release()
    return None


def main() -> int:
    tx_sock, rx_sock = sys.argv[1], sys.argv[2]
    results: list[dict[str, Any]] = []
    failed: list[tuple[str, str]] = []
    handed: list[str] = []

    def on_failed(out: Outgoing, why: str) -> None:
        failed.append((out.req_id, why))

    h = Handover(on_failed, lambda out: handed.append(out.req_id), threaded=True)
    tx, rx = PrefillClient(tx_sock), DecodeClient(rx_sock)
    try:
        # 1. a slow first step, a fast second one: the second waits its turn; the digest
        #    layer goes after both, though the engine said "last step copied" at once
        out = start(tx, "late-then-fast", h)
        save(out, "late-then-fast", range(0, 2), False, 0.4, h)
        save(out, "late-then-fast", range(2, 4), True, 0.0, h)
        h.last_step_copied(out)
        early = list(handed)
        why = check_arrived(rx, "late-then-fast")
        if why is None and early:
            why = "handed over whole before its copies landed"
        if why is None and handed != ["req-late-then-fast"]:
            why = f"handed over: {handed}"
        results.append({"case": "order_kept_and_digests_last", "ok": why is None, "detail": why})

        # 2. the engine keeps using the client while the thread hands over (one lock)
        out = start(tx, "busy-engine", h)
        save(out, "busy-engine", range(0, 4), True, 0.2, h)
        h.last_step_copied(out)
        t_end = time.monotonic() + 0.5
        calls = 0
        while time.monotonic() < t_end:
            with h.lock:
                tx.poll_outcomes()
                calls += 1
        why = check_arrived(rx, "busy-engine")
        results.append(
            {"case": "client_shared_under_one_lock", "ok": why is None, "detail": why or calls}
        )

        # 3. a copy that fails on the device: reported once, nothing more handed over, the
        #    decode side never gets the request
        out = start(tx, "device-error", h)
        view = out.views[0]
        assert view is not None
        bad = LateCopy(view[:BB], block("device-error", 0, 0), 0.1, fail=True)
        h.submit(out, SavedCopy(0, 0, 1, BB, view, bad))
        save(out, "device-error", range(1, 4), True, 0.0, h)
        h.last_step_copied(out)
        deadline = time.monotonic() + 5
        while not failed and time.monotonic() < deadline:
            time.sleep(0.02)
        why = None
        if failed != [("req-device-error", "send_failed")]:
            why = f"failures reported: {failed}"
        elif "req-device-error" in handed:
            why = "a request whose copy failed was handed over whole"
        with h.lock:
            tx.cancel("device-error", "test: the copy failed")
        results.append({"case": "device_error_reported", "ok": why is None, "detail": why})
    finally:
        h.stop()
        tx.close()
        rx.close()
    for r in results:
        print(json.dumps(r, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
