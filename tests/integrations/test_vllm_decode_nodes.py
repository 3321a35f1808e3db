"""Many decode nodes (issue 28): the prefill instance ships each request's KV to the receiver
of the decode node it names (``xdc_peer``, which the gateway sets from the router's choice),
on real vLLM CPU engines. Node A is the sender's own receiver, node B a second receiver with
its own decode engine; each request lands on its node only, token-equal to a plain run. A
request naming a receiver the sender does not allow is refused at once and its decode
recomputes."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdc.transport.launcher import DaemonProcess, local_pair_config

from tests.vllm_fixtures import Engine, KvPair, kv_pair, need_vllm, prompt
from tests.vllm_fixtures import test_model as dense_model

pytestmark = pytest.mark.vllm


class NodeB:
    def __init__(self, rx: DaemonProcess, addr: str, sock: str) -> None:
        self.rx, self.addr, self.sock = rx, addr, sock
        self.consumer: Engine | None = None


@pytest.fixture(scope="module")
def node_b() -> Iterator[NodeB]:
    need_vllm()
    wd = Path(tempfile.mkdtemp(prefix="xdc-node-b-"))
    _, rx_cfg, _ = local_pair_config(wd, connections=2)
    rx = DaemonProcess("receiver", rx_cfg, wd)
    try:
        rx.wait_ready()
        yield NodeB(rx, f"127.0.0.1:{rx_cfg.receiver.listen_port}", rx_cfg.receiver.control_socket)
    finally:
        rx.stop()
        shutil.rmtree(wd, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes(node_b: NodeB) -> Iterator[tuple[KvPair, NodeB]]:
    with kv_pair(dense_model(), allowed_peers=(node_b.addr,)) as a:
        node_b.consumer = Engine(
            "consumer",
            core=1,
            receiver_socket=node_b.sock,
            extra={"arrival_timeout_s": 4.0, "timeout_s": 30.0},
        )
        try:
            yield a, node_b
        finally:
            node_b.consumer.close()


def _complete_on(rx: DaemonProcess, rid: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"request {rid} complete" in rx.log():
            return True
        time.sleep(0.05)
    return False


def test_each_request_lands_on_the_decode_node_it_names(nodes: tuple[KvPair, NodeB]) -> None:
    a, b = nodes
    assert b.consumer is not None
    for n, target in ((300, "a"), (700, "b"), (250, "b"), (500, "a")):
        ids = prompt(n, seed=2800 + n)
        rid = f"node-{target}-{uuid.uuid4().hex[:6]}"
        consumer = a.consumer if target == "a" else b.consumer
        send = {"do_remote_decode": True, "xdc_rid": rid}
        if target == "b":
            send["xdc_peer"] = b.addr
        consumer.submit([ids], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": n}])
        a.producer.generate([ids], [send], 1)
        got = consumer.result()[0]["token_ids"]
        assert got == a.want(ids), (n, target)
        here, there = (a.rx, b.rx) if target == "a" else (b.rx, a.rx)
        assert _complete_on(here, rid), here.log()[-2000:]
        assert f"request {rid} complete" not in there.log()
    assert "prefilling it locally" not in a.consumer.log() + b.consumer.log()


def test_a_loaded_decode_answers_without_a_recompute_mark(nodes: tuple[KvPair, NodeB]) -> None:
    a, _ = nodes
    ids = prompt(200, seed=2950)
    got, _, _ = a.pair(ids)
    assert got["token_ids"] == a.want(ids)
    assert not (got["kv_transfer_params"] or {}).get("xdc_recomputed"), got


def test_a_request_naming_a_receiver_not_allowed_recomputes_on_its_decode_node(
    nodes: tuple[KvPair, NodeB],
) -> None:
    """The producer's sender refuses the transfer at once (BAD_REQUEST, named in the
    producer's log); the decode waits its arrival timeout and prefills locally, with the
    plain run's tokens."""
    a, b = nodes
    assert b.consumer is not None
    ids = prompt(300, seed=2900)
    rid = f"stray-{uuid.uuid4().hex[:6]}"
    b.consumer.submit([ids], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 300}])
    stray = {"do_remote_decode": True, "xdc_rid": rid, "xdc_peer": "127.0.0.1:9"}
    a.producer.generate([ids], [stray], 1)
    got = b.consumer.result()[0]
    assert got["token_ids"] == a.want(ids)
    # the decode's answer says it prefilled itself, and why (a gateway counts it)
    assert got["kv_transfer_params"] == {"xdc_recomputed": "never_arrived"}, got
    assert "sender.allowed_peers" in a.producer.log()
    assert f"transfer {rid}" in b.consumer.log()
