"""The decode side's GPU landing (the connector's ``Loader._land_on_device``) against real
daemons, without a GPU.

Run by ``tests/integrations/test_kv_landing.py`` with the vLLM venv's Python (torch and vLLM
live there): ``landing_checks.py TX_SOCK RX_SOCK``. A GPU's loads complete after they are
queued; here the copier is a ``LateCopier``: each load reads the pool and writes vLLM's
blocks only when it "lands" (after a delay, on its own timer), which is what a host-to-device
copy on a side stream does. Meanwhile the arrived bytes are hashed in the loader's hashing
threads. A load must be reported only when both are in, byte-exact; an arrived block that
does not hash to the producer's digest fails it; a load the deadline check finds complete
lands the same way (it once released the pool under the copies and was never reported).
Prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from xdc.transport.engine_client import PrefillClient

from xdc.integrations.kvcopy import BlockShape, CpuCopier, block_shape
from xdc.integrations.vllm.blocks import (
    KvPlan,
    LoadSpec,
    Piece,
    digest_layer_bytes,
    prompt_slot,
)
from xdc.integrations.vllm.loads import Loader
from xdc.integrations.vllm.params import ConnectorConfig
from xdc.integrations.vllm.prompt_binding import prompt_digest
from xdc.protocol.engine_control import MAX_AWAIT_RIDS, MAX_RID

LAYERS = 3
NUM_BLOCKS = 16
BLOCK_TOKENS = 16
ROW = (2, BLOCK_TOKENS, 64)  # heads, tokens, 2 x head dim
TOKENS = 4 * BLOCK_TOKENS  # a 4-block prompt
DELAY_S = 0.3
LAYOUT = "test-layout"


class LateCopy:
    def __init__(self, run: Any) -> None:
        self._landed = threading.Event()

        def land() -> None:
            run()
            self._landed.set()

        threading.Timer(DELAY_S, land).start()

    def done(self) -> bool:
        return self._landed.is_set()

    def wait(self) -> None:
        if not self._landed.wait(10):
            raise TimeoutError("the copy never landed")

    def verified(self) -> bool:
        return True


class LateCopier(CpuCopier):
    """The CPU copier's loads, landing ``DELAY_S`` after they were queued (a GPU's)."""

    device = "late"

    def load(
        self,
        dst: torch.Tensor,
        shape: BlockShape,
        ids: Sequence[int],
        src: torch.Tensor,
        first: int,
        check_ids: Sequence[int] | None = None,
    ) -> LateCopy:
        def run() -> None:
            CpuCopier.load(self, dst, shape, ids, src, first, check_ids)

        return LateCopy(run)


def block(rid: str, layer: int, b: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    seed = xxhash.xxh3_64_intdigest(f"{rid}/{layer}/{b}".encode()) & 0x7FFFFFFF
    return np.random.default_rng(seed).integers(0, 256, BB, dtype=np.uint8)


BB = int(np.prod(ROW)) * 2  # bf16


def made_from(rid: str) -> int:
    """The digest of the prompt a transfer's KV was made from: one prompt per transfer id."""
    seed = xxhash.xxh3_64_intdigest(rid.encode()) & 0xFFFF
    return prompt_digest([seed + i for i in range(TOKENS)], TOKENS)


def produce(
    tx: PrefillClient,
    rid: str,
    bad_digest: tuple[int, int] | None = None,
    prompt_of: str | None = None,
) -> None:
    """A 4-block transfer of every layer and its digest layer (one digest wrong, if asked),
    made from the prompt of ``prompt_of`` (its own by default)."""
    n = TOKENS // BLOCK_TOKENS
    sizes = [BB * n] * LAYERS + [digest_layer_bytes([n] * LAYERS)]
    t = tx.begin(rid, sizes, deadline_s=20, layout=LAYOUT)
    digests = t.layer_buffer(LAYERS).view(np.dtype("<u8"))
    digests[prompt_slot([n] * LAYERS)] = made_from(prompt_of or rid)
    for layer in range(LAYERS):
        buf = t.layer_buffer(layer)
        for b in range(n):
            data = block(rid, layer, b)
            buf[b * BB : (b + 1) * BB] = data
            d = xxhash.xxh3_64_intdigest(data.data)
            digests[layer * n + b] = d ^ 1 if bad_digest == (layer, b) else d
        t.layer_ready(layer)
    t.layer_ready(LAYERS)


def make_loader(rx_sock: str, helpers: int = 0) -> tuple[Loader, list[torch.Tensor]]:
    kv = {f"l{i}": torch.zeros((NUM_BLOCKS, *ROW), dtype=torch.bfloat16) for i in range(LAYERS)}
    shapes = []
    for t in kv.values():
        sh = block_shape(t, NUM_BLOCKS)
        assert isinstance(sh, BlockShape), sh
        shapes.append(sh)
    cfg = ConnectorConfig(receiver_socket=rx_sock, hash_helpers=helpers)
    loader = Loader(
        cfg, "test-layout", kv, shapes, KvPlan.dense(BLOCK_TOKENS, LAYERS), LateCopier()
    )
    return loader, list(kv.values())


TARGETS = (9, 3, 12, 5)


def spec(rid: str) -> LoadSpec:
    return LoadSpec(
        f"req-{rid}", rid, TOKENS, (Piece(0, 0, TARGETS),), 20.0, 10.0, prompt_digest=made_from(rid)
    )


def run_until_reported(loader: Loader, req_id: str) -> tuple[str, float]:
    """Step the loader as the engine does until the request is reported: ('loaded' or the
    failure reason, seconds it took)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15:
        done, failed = loader.take()
        if req_id in done:
            return "loaded", time.monotonic() - t0
        if req_id in failed:
            return loader.reasons.get(req_id, "failed"), time.monotonic() - t0
        time.sleep(0.005)
    return "never reported", time.monotonic() - t0


def blocks_hold(kv: list[torch.Tensor], rid: str) -> str | None:
    for layer, t in enumerate(kv):
        for j, b in enumerate(TARGETS):
            got = t[b].contiguous().view(torch.uint8).view(-1).numpy()
            if not np.array_equal(got, block(rid, layer, j)):
                return f"layer {layer}: vLLM block {b} does not hold transfer block {j}"
    return None


def main() -> int:
    tx_sock, rx_sock = sys.argv[1], sys.argv[2]
    # the arrival hashes in this many helper processes (0: in the loader's threads)
    helpers = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    results: list[dict[str, Any]] = []
    tx = PrefillClient(tx_sock)

    def case(name: str, why: str | None) -> None:
        results.append({"case": name, "ok": why is None, "detail": why})

    loader, kv = make_loader(rx_sock, helpers)
    helper_pids: list[int] = []
    try:
        # 1. a landing is reported after its copies landed, byte-exact
        produce(tx, "late")
        loader.add([spec("late")])
        got, took = run_until_reported(loader, "req-late")
        why = None if got == "loaded" else f"reported {got}"
        if why is None and took < DELAY_S * 0.9:
            why = f"reported after {took:.3f}s, before its copies landed ({DELAY_S}s)"
        case("reported_after_the_copies_byte_exact", why or blocks_hold(kv, "late"))

        # 2. one arrived block whose digest is not the producer's: the load fails
        produce(tx, "bad", bad_digest=(2, 1))
        loader.add([spec("bad")])
        got, _ = run_until_reported(loader, "req-bad")
        case("an_arrived_block_off_its_digest_fails_the_load", None if got == "integrity" else got)

        # 3. the deadline check finds the transfer complete: it lands like any other
        produce(tx, "late-check")
        tx.wait("late-check", 15)  # delivered: complete at the receiver
        s = spec("late-check")
        # past its arrival time (10 s), not its deadline (20 s)
        loader._pending[s.rid] = (s, time.monotonic() - 12, False)
        loader._check_deadlines(loader._client(), time.monotonic())
        why = None if s.rid in loader._landing else "the deadline check did not keep the landing"
        if why is None:
            got, _ = run_until_reported(loader, "req-late-check")
            why = None if got == "loaded" else f"reported {got}"
        case("the_deadline_check_lands_like_a_poll", why or blocks_hold(kv, "late-check"))

        # 4. more loads waiting than one await may name (MAX_AWAIT_RIDS): the one that
        # arrives lands, and none of the rest is failed as if the receiver were gone
        many = [spec(f"never-{i}") for i in range(MAX_AWAIT_RIDS + 100)]
        loader.add(many)
        produce(tx, "among-many")
        loader.add([spec("among-many")])  # named last: past the first await's rids
        got, _ = run_until_reported(loader, "req-among-many")
        why = None if got == "loaded" else f"reported {got}"
        failed = sorted({loader.reasons.get(s.req_id, "") for s in many} - {""})
        case("more_pending_than_one_await_names", why or (f"failed: {failed}" if failed else None))

        # 5. a load whose transfer id the receiver can not take (too long for the engine
        # protocol): that load alone fails, the others still land
        loader.add(
            [spec("x" * (MAX_RID + 1)), spec("bad\nrid")]
        )  # not via parse_request: the loader's own guard
        produce(tx, "beside-bad-rid")
        loader.add([spec("beside-bad-rid")])
        got, _ = run_until_reported(loader, "req-beside-bad-rid")
        why = None if got == "loaded" else f"reported {got}"
        bad = [
            loader.reasons.get(f"req-{r}", "never reported")
            for r in ("x" * (MAX_RID + 1), "bad\nrid")
        ]
        if why is None and bad != ["bad_request", "bad_request"]:
            why = f"the bad ids were reported {bad}"
        case("a_bad_transfer_id_fails_only_its_load", why or blocks_hold(kv, "beside-bad-rid"))

        # 6. a valid transfer of another prompt's KV under this request's id (a reused or
        # mixed-up id): refused before a block is written, the blocks keep what they held
        produce(tx, "mixed-up", prompt_of="someone-else")
        loader.add([spec("mixed-up")])
        got, _ = run_until_reported(loader, "req-mixed-up")
        why = None if got == "prompt_mismatch" else f"reported {got}"
        case("another_prompts_kv_is_refused", why or blocks_hold(kv, "beside-bad-rid"))

        # 7. with helper processes: the hashes ran there; a helper SIGKILLed between loads
        # leaves the next ones to the other; one stopped mid-check (SIGSTOP) is killed after
        # HASH_STALL_S and its load fails, never hangs; with none left, threads hash
        if helpers:
            hp = loader._helpers
            why = None if hp is not None and hp.usable else "no helper process hashed"
            if hp is not None and why is None:
                helper_pids = hp.pids()
                first, second = helper_pids[:2]
                os.kill(first, signal.SIGKILL)
                os.waitpid(first, 0)
                produce(tx, "after-kill")
                loader.add([spec("after-kill")])
                got, _ = run_until_reported(loader, "req-after-kill")
                why = None if got == "loaded" else f"after a helper was killed: {got}"
                why = why or blocks_hold(kv, "after-kill")
            case("a_killed_helper_leaves_loads_to_the_others", why)
            if hp is not None and why is None:
                loader.HASH_STALL_S = 1.0
                os.kill(second, signal.SIGSTOP)
                produce(tx, "stalled")
                loader.add([spec("stalled")])
                got, took = run_until_reported(loader, "req-stalled")
                why = None if got == "integrity" else f"beside a stopped helper: {got}"
                if why is None and took > 8:
                    why = f"the stopped helper held its load {took:.1f} s"
                if why is None and hp.usable:
                    why = "the stopped helper still counts usable"
                produce(tx, "no-helper-left")
                loader.add([spec("no-helper-left")])
                got, _ = run_until_reported(loader, "req-no-helper-left")
                if why is None and got != "loaded":
                    why = f"with no helper left, a load was reported {got}"
                why = why or blocks_hold(kv, "no-helper-left")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(second, signal.SIGCONT)
            case("a_stopped_helper_fails_its_load_then_threads_hash", why)
    finally:
        loader.stop()
        tx.close()
    # nothing of the loader's is left running: the hashing threads are gone
    left = [t.name for t in threading.enumerate() if t.name.startswith("xdc-hash")]
    case("stop_leaves_no_hashing_thread", f"left: {left}" if left else None)
    if helpers:
        alive = [p for p in helper_pids if os.path.exists(f"/proc/{p}")]
        case("stop_leaves_no_helper_process", f"alive: {alive}" if alive else None)
    for r in results:
        print(json.dumps(r, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
