"""Shared rigs for tests that feed a real router app from engine event streams: the router
served on loopback from a background loop (``RouterRig``) and a real ZMQ publisher speaking
vLLM's KV-event framing, with its replay socket (``ZmqPublisher``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from xdc.scheduler.profile import load_profile

from tests.router_fixtures import GW, LiveRouter, router_config
from xdc.config_entries import entries

PROFILE = Path(__file__).resolve().parent.parent / "deploy/profiles/prfaas-case-study.toml"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class RouterRig:
    """A router whose ``router.vllm_kv_events`` is set at ``start``; stopped on exit."""

    def __init__(self, **cfg: Any) -> None:
        self.cfg = cfg
        self.live: LiveRouter | None = None

    def __enter__(self) -> RouterRig:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.close()

    def start(self, vllm_kv_events: str, **more: Any) -> None:
        """``vllm_kv_events``: the entries comma-separated, as the environment gives them."""
        events = tuple(entries(vllm_kv_events))
        cfg = router_config(vllm_kv_events=events, **self.cfg, **more)
        self.live = LiveRouter(cfg, load_profile(PROFILE))

    @property
    def router(self) -> LiveRouter:
        assert self.live is not None, "start() the rig first"
        return self.live

    def route(self, tokens: list[int]) -> dict[str, Any]:
        body = {"rid": "r", "prompt_len": len(tokens), "token_ids": tokens, "dry_run": True}
        status, d = self.router.call("POST", "/v1/route", body, token=GW)
        assert status == 200, d
        return dict(d)

    def state(self) -> dict[str, Any]:
        status, d = self.router.call("GET", "/v1/state")
        assert status == 200, d
        return dict(d)

    def source_counts(self, node: str) -> dict[str, Any]:
        return dict(self.state()["cache_index"]["vllm_sources"].get(node, {}))

    def metrics(self) -> str:
        _, text = self.router.call("GET", "/metrics")
        return str(text)

    def wait_for(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, self.state()["cache_index"]
            time.sleep(0.02)


class ZmqPublisher:
    """vLLM's ZmqEventPublisher framing: PUB frames (topic, seq, payload), and with
    ``replay`` a ROUTER socket answering (b"", start_seq) with every kept frame from there
    and an END_SEQ marker."""

    def __init__(self, replay: bool = False) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.kept: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.replay_port = 0
        self.thread: threading.Thread | None = None
        if replay:
            rep = self.ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            self.replay_port = rep.bind_to_random_port("tcp://127.0.0.1")
            self.thread = threading.Thread(target=self._serve, args=(rep,), daemon=True)
            self.thread.start()

    def _serve(self, rep: zmq.Socket[bytes]) -> None:
        try:
            while not self.stop.is_set():
                if not rep.poll(50):
                    continue
                client, _, start = rep.recv_multipart()
                first = int.from_bytes(start, "big")
                with self.lock:
                    frames = [(s, p) for s, p in self.kept if s >= first]
                for s, p in frames:
                    rep.send_multipart((client, b"", b"", s.to_bytes(8, "big"), p))
                rep.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            rep.close(0)

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        """Send one batch (``live=False``: numbered and kept for replay, but lost on the way)."""
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.kept.append((seq, payload))
        if live:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    def restart(self) -> None:
        """A new engine process on the same endpoints: numbering from 0, nothing kept."""
        with self.lock:
            self.seq = 0
            self.kept.clear()

    def publish_until_seen(self, payload: bytes, rig: RouterRig, node: str) -> None:
        """ZMQ subscriptions take a moment to reach the publisher: repeat until one lands."""
        deadline = time.monotonic() + 10
        while not rig.source_counts(node).get("batches"):
            assert time.monotonic() < deadline, rig.state()["cache_index"]
            self.publish(payload)
            time.sleep(0.05)

    def __enter__(self) -> ZmqPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5)
        self.pub.close(0)
        self.ctx.term()
