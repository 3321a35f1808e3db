"""The producer's hand-over: a layer's blocks go to the sender only once their copy landed.

On the CPU build a copy has landed when it returns, so everything here happens on the
caller's thread, at once, as before. On a GPU the copy into the sender's pool completes on a
side stream while the engine computes on: a completion thread waits for each copy in the
order they were made (``Copy.wait`` releases the GIL), then hashes the landed blocks and
tells the sender (``layer_ready``). That keeps the forward pass free of any wait and still
ships the last layers of a prompt when the engine goes idle right after it (a hand-over
that waited for "the next engine call" would hang there).

Order matters per request: a layer's ``upto`` only grows, and bytes are handed over only
after they landed, so once a request has a copy in flight every later one queues behind it.
The engine's client socket is shared with the thread under one lock (the client is not
thread-safe): the worker takes it for every call it makes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from xdc.errors import XdcError
from xdc.integrations.kvcopy import Copy
from xdc.integrations.vllm.blocks import digest_offsets, prompt_slot
from xdc.transport.engine_client import Transfer

log = logging.getLogger("vllm.xdc.connector")


@dataclass
class Outgoing:
    """One request on its way out, as the worker sees it."""

    transfer: Transfer
    views: list[torch.Tensor | None]  # each layer's slot in the send pool, kept across steps
    counts: list[int]  # blocks per layer
    block_bytes: list[int]
    req_id: str = ""  # vLLM's id (a failure is reported under it)
    prompt_digest: int = 0  # what the KV was made from: the digest layer's last slot
    digests: np.ndarray[Any, np.dtype[np.uint64]] | None = None  # the digest layer's slot
    saved: set[int] = field(default_factory=set)  # layers copied in this step
    digest_at: list[int] = field(default_factory=list)
    in_flight: int = 0  # copies queued for the completion thread
    closing: bool = False  # every layer of the last step was copied: the digests go next
    ended: bool = False  # handed over whole, failed or cancelled: nothing more goes

    def __post_init__(self) -> None:
        self.digest_at = digest_offsets(self.counts)

    def digest_view(self) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """The digest layer's slot, the prompt's digest in place. Asked for only where a
        failure is handled (``Handover``): the sender may have ended the transfer (the
        decode gave it up) or have no room yet, and the caller may be the forward pass."""
        if self.digests is None:
            buf = self.transfer.layer_buffer(len(self.views))
            self.digests = buf.view(np.dtype("<u8"))
            self.digests[prompt_slot(self.counts)] = self.prompt_digest
        return self.digests


@dataclass(frozen=True, slots=True)
class SavedCopy:
    """Blocks ``first .. first + n - 1`` of a layer, copied (or being copied) into ``view``;
    ``upto``: the layer's final bytes once they landed (None: the whole layer)."""

    layer: int
    first: int
    n: int
    upto: int | None
    view: torch.Tensor
    copy: Copy


class Handover:
    def __init__(
        self,
        on_failed: Callable[[Outgoing, str], None],
        on_handed_over: Callable[[Outgoing], None],
        *,
        threaded: bool,
    ) -> None:
        self.lock = threading.RLock()
        self._on_failed = on_failed
        self._on_handed_over = on_handed_over
        self._queue: queue.SimpleQueue[tuple[Outgoing, SavedCopy] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="xdc-handover", daemon=True)
            self._thread.start()

    def submit(self, out: Outgoing, job: SavedCopy) -> None:
        """A copy was made: hand its blocks over now if it landed and nothing of the request
        is queued before it, else queue it for the completion thread."""
        with self.lock:
            if self._thread is None or (out.in_flight == 0 and job.copy.done()):
                self._land(out, job)
                return
            out.in_flight += 1
        self._queue.put((out, job))

    def last_step_copied(self, out: Outgoing) -> None:
        """Every layer of the request's last step was copied: the digest layer goes once
        they all landed (now, or from the completion thread)."""
        with self.lock:
            out.closing = True
            if out.in_flight == 0:
                self._close(out)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    # --- landing ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            out, job = item
            try:
                job.copy.wait()
            except Exception as e:  # a device error: this request cannot be handed over
                log.error("xdc: a copy of %s failed on the device: %s", out.transfer.rid, e)
                with self.lock:
                    out.in_flight -= 1
                    self._fail(out, "send_failed")
                continue
            with self.lock:
                out.in_flight -= 1
                self._land(out, job)
                if out.closing and out.in_flight == 0:
                    self._close(out)

    def _land(self, out: Outgoing, job: SavedCopy) -> None:
        if out.ended:
            return
        bb = out.block_bytes[job.layer]
        try:
            digests = out.digest_view()
            base = out.digest_at[job.layer]
            # hashed from the pool, after the copy landed: what the decode side checks is
            # what the sender was given, on any device, with no extra device-to-host copy
            host = job.view.numpy()
            for j in range(job.n):
                at = (job.first + j) * bb
                digests[base + job.first + j] = xxhash.xxh3_64_intdigest(host[at : at + bb])
            out.transfer.layer_ready(job.layer, job.upto)
        except (XdcError, OSError) as e:
            log.error("xdc: sending %s failed at layer %d: %s", out.transfer.rid, job.layer, e)
            self._fail(out, "send_failed")

    def _close(self, out: Outgoing) -> None:
        if out.ended:
            return
        try:
            out.digest_view()  # in place, with the prompt's digest, even if no block landed
            out.digests = None
            out.transfer.layer_ready(len(out.views))  # the digest layer
        except (XdcError, OSError) as e:
            log.error("xdc: sending %s failed at its digests: %s", out.transfer.rid, e)
            self._fail(out, "send_failed")
            return
        out.ended = True
        self._on_handed_over(out)

    def _fail(self, out: Outgoing, why: str) -> None:
        if not out.ended:
            out.ended = True
            self._on_failed(out, why)
