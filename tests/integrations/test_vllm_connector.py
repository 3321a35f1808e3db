"""Real vLLM engines (CPU build) with the xdc connector: a producer (prefill) instance with its
sender daemon, a consumer (decode) instance with its receiver daemon, and a plain instance as
the reference. The consumer's greedy tokens must equal the plain run's, prompt by prompt, and
every failure ends in local recompute with the same tokens, never in a decode from wrong bytes.

The sender reaches the receiver through a proxy that flips one byte of the first connection's
stream: the receiver's checksum must catch it (the chunk is resent) while the tokens stay equal.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from xdc.transport.engine_client import DecodeClient
from xdc.transport.launcher import DaemonProcess, local_pair_config

from tests.corrupt_proxy import CorruptingProxy
from tests.vllm_fixtures import Engine, close_engines, need_vllm, prompt, start_engines
from xdc.config import Config
from xdc.lab.vllm_offline import ABORTED
from xdc.lab.vllm_rig import log_tails

pytestmark = pytest.mark.vllm

CHUNKED_BATCH = 128  # the producer prefills at most this many tokens per step


@dataclass
class Rig:
    tx: DaemonProcess
    rx: DaemonProcess
    tx_cfg: Config
    tx_sock: str
    rx_sock: str
    proxy: CorruptingProxy
    producer: Engine
    consumer: Engine
    reference: Engine
    workdir: Path

    def pair(
        self, prompt_ids: list[int], *, rid: str | None = None, decode_rid: str | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Prefill on the producer and decode on the consumer at the same time (the decode is
        sent first, as a gateway overlapping both does); (consumer outputs, producer outputs)."""
        rid = rid or f"t-{len(prompt_ids)}-{uuid.uuid4().hex[:8]}"
        n = len(prompt_ids)
        self.consumer.submit(
            [prompt_ids],
            [{"do_remote_prefill": True, "xdc_rid": decode_rid or rid, "xdc_num_tokens": n}],
            max_tokens=8,
        )
        prod = self.producer.generate([prompt_ids], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
        return self.consumer.result()[0], prod[0]

    def logs(self, tail: int = 3000) -> str:
        """Each engine's and daemon's last words: what a failed check prints."""
        return log_tails(
            tail,
            producer=self.producer.log(),
            consumer=self.consumer.log(),
            sender=self.tx.log(),
            receiver=self.rx.log(),
        )

    def rx_status(self) -> dict[str, Any]:
        with DecodeClient(self.rx_sock) as c:
            return c.status()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    need_vllm()
    wd = Path(tempfile.mkdtemp(prefix="xdc-vllm-"))
    tx_cfg, rx_cfg, _ = local_pair_config(
        wd, connections=2, chunk_bytes=64 * 1024, send_pool=128 << 20, recv_pool=256 << 20
    )
    rx_cfg.receiver.orphan_grace_s = 2.0  # a dead sender's partial request fails fast
    rx = DaemonProcess("receiver", rx_cfg, wd)
    rx.wait_ready()
    proxy = CorruptingProxy(rx_cfg.receiver.listen_port, flip_at=150_000)
    tx_cfg.sender.peer_port = proxy.port
    tx = DaemonProcess("sender", tx_cfg, wd)
    tx.wait_ready()
    engines: list[Engine] = []
    made: Rig | None = None
    try:
        engines = start_engines(
            (
                "producer",
                {
                    "core": 0,
                    "sender_socket": tx_cfg.sender.control_socket,
                    "max_num_batched_tokens": CHUNKED_BATCH,
                },
            ),
            (
                "consumer",
                {
                    "core": 1,
                    "receiver_socket": rx_cfg.receiver.control_socket,
                    "extra": {"arrival_timeout_s": 4.0, "timeout_s": 30.0},
                },
            ),
            ("plain", {"core": 1}),
        )
        producer, consumer, reference = engines
        made = Rig(
            tx,
            rx,
            tx_cfg,
            tx_cfg.sender.control_socket,
            rx_cfg.receiver.control_socket,
            proxy,
            producer,
            consumer,
            reference,
            wd,
        )
        yield made
    finally:
        close_engines(engines)
        for d in {tx, rx, *((made.tx,) if made is not None else ())}:
            d.stop()
        proxy.close()
        shutil.rmtree(wd, ignore_errors=True)


def _delivered(rig: Rig, rid: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"request {rid} delivered" in rig.tx.log():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("n", [33, 250, 700])
def test_decode_tokens_equal_a_plain_run(rig: Rig, n: int) -> None:
    """700 tokens with at most 128 per step: the prefill is chunked over 6 steps and its
    blocks stream as each step completes them."""
    p = prompt(n, seed=n)
    rid = f"eq-{n}-{uuid.uuid4().hex[:6]}"
    got, prod = rig.pair(p, rid=rid)
    want = rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert got["token_ids"] == want, (n, got, want)
    assert prod["kv_transfer_params"].get("xdc_rid") == rid, rig.producer.log()[-3000:]
    assert prod["kv_transfer_params"]["xdc_num_tokens"] == n
    assert _delivered(rig, rid), rig.tx.log()[-2000:]  # moved through xdc, not recomputed
    assert "prefilling it locally" not in rig.consumer.log()


def test_a_flipped_byte_in_flight_is_caught_by_the_checksum(rig: Rig) -> None:
    # the previous transfers crossed the proxy, which flipped one byte of connection 0
    for i in range(5):
        if rig.proxy.flipped.is_set():
            break
        rig.pair(prompt(700, seed=100 + i))
    assert rig.proxy.flipped.is_set()
    st = rig.rx_status()
    assert int(st["checksum_failures"]) >= 1, st
    assert "checksum mismatch" in rig.rx.log()


def test_another_requests_kv_under_this_requests_id_is_refused_and_recomputed(rig: Rig) -> None:
    """A transfer id reused or mixed up: the consumer is pointed at the KV of another prompt
    of the same length (a valid transfer, every block hashing right, the wrong bytes for this
    prompt). It once decoded from it into other tokens than the plain run's; the prompt's
    digest in the transfer now differs from its own, so it recomputes with the plain run's
    tokens. (That a wrong KV does change the tokens: the stale-write test below.)"""
    a, b = prompt(300, seed=1), prompt(300, seed=2)
    rid = f"mixed-{uuid.uuid4().hex[:6]}"
    rig.consumer.submit([a], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 300}])
    rig.producer.generate([b], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
    got = rig.consumer.result()[0]["token_ids"]
    want = rig.reference.generate([a], None, 8)[0]["token_ids"]
    assert _delivered(rig, rid)  # the daemons delivered it whole: only the binding saw it
    assert got == want
    log = rig.consumer.log()
    assert f"transfer {rid}" in log and "made from another prompt" in log, log[-3000:]


def test_a_prefill_whose_decode_gave_up_before_it_began_answers_and_the_engine_lives_on(
    rig: Rig,
) -> None:
    """The decode engine discarded the transfer (it waited too long, or was aborted) before
    the prefill began: the receiver refuses it at once, and the producer's calls on it may
    fail while the forward pass is still saving. A call made right after the transfer began,
    outside any failure handling, once crashed the whole engine when the refusal was
    already known (seen once, with two tensor-parallel ranks; here the refusal usually comes
    later, so this passes on that code too). The prefill must answer and the engine live on."""
    p = prompt(300, seed=11)
    rid = f"gone-{uuid.uuid4().hex[:6]}"
    with DecodeClient(rig.rx_sock) as rx:
        rx.discard(rid)
    made = rig.producer.generate([p], [{"do_remote_decode": True, "xdc_rid": rid}], 1)[0]
    assert made["token_ids"], made
    assert rig.producer.proc.poll() is None, rig.producer.log()[-3000:]
    q = prompt(250, seed=12)
    got, _ = rig.pair(q)
    assert got["token_ids"] == rig.reference.generate([q], None, 8)[0]["token_ids"]


def test_a_transfer_that_never_begins_ends_in_local_recompute(rig: Rig) -> None:
    p = prompt(200, seed=7)
    rid = f"lost-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    rig.consumer.submit([p], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 200}])
    got = rig.consumer.result()[0]["token_ids"]
    waited = time.monotonic() - t0
    assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert 3.5 <= waited < 15, waited  # the arrival timeout (4 s), then a local prefill
    log = rig.consumer.log()
    assert f"transfer {rid}" in log and "no transfer began within 4s" in log


def test_a_decode_told_to_wait_longer_loads_a_transfer_that_begins_late(rig: Rig) -> None:
    """A prefill queued at a busy PrfaaS cluster begins after the decode instance's own
    arrival timeout (4 s here; 5 s in ``xdc up``, below the router's 8 s queue surge mark).
    The gateway tells the decode to wait as long as it waits for the prefill
    (``xdc_arrival_s``): the decode loads the KV that began 6 s late instead of recomputing
    it (the test above: recompute at 4 s without it)."""
    p = prompt(200, seed=13)
    rid = f"late-{uuid.uuid4().hex[:6]}"
    waits = {"xdc_timeout_s": 30.0, "xdc_arrival_s": 20.0}
    kv = {"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 200, **waits}
    rig.consumer.submit([p], [kv])
    time.sleep(6.0)  # the prefill is queued elsewhere meanwhile
    made = rig.producer.generate([p], [{"do_remote_decode": True, "xdc_rid": rid}], 1)[0]
    assert made["kv_transfer_params"].get("xdc_rid") == rid, made
    got = rig.consumer.result()[0]["token_ids"]
    assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert _delivered(rig, rid), rig.tx.log()[-2000:]
    log = rig.consumer.log()
    assert f"transfer {rid}" not in log, log[-3000:]  # no failure named it: loaded


def test_bad_transfer_params_are_a_clear_error_and_a_local_prefill(rig: Rig) -> None:
    p = prompt(100, seed=9)
    bad = {"do_remote_prefill": True, "xdc_rid": "x\n", "xdc_num_tokens": 100}
    got = rig.consumer.generate([p], [bad])[0]["token_ids"]
    assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert "kv_transfer_params.xdc_rid" in rig.consumer.log()
    wrong_len = {"do_remote_prefill": True, "xdc_rid": "y", "xdc_num_tokens": 99}
    got = rig.consumer.generate([p], [wrong_len])[0]["token_ids"]
    assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert "xdc_num_tokens 99 but the prompt has 100 tokens" in rig.consumer.log()


def test_a_consumer_with_another_block_size_refuses_the_kv_and_recomputes(rig: Rig) -> None:
    """Block size 64 against the producer's 32 (CPU attention takes multiples of 32): the
    layouts differ, the receiver refuses to hand the request over (LAYOUT_MISMATCH) and the
    consumer prefills locally, saying why."""
    other = Engine(
        "consumer",
        core=1,
        receiver_socket=rig.rx_sock,
        block_size=64,
        extra={"arrival_timeout_s": 4.0, "timeout_s": 20.0},
    )
    try:
        p = prompt(160, seed=11)
        rid = f"bs-{uuid.uuid4().hex[:6]}"
        other.submit([p], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 160}])
        rig.producer.generate([p], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
        got = other.result()[0]["token_ids"]
        assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
        log = other.log()
        assert f"transfer {rid}" in log and "layout" in log.lower(), log[-3000:]
    finally:
        other.close()


def _sender_up(rig: Rig) -> None:
    """A sender daemon for the rig (a test before may have killed it)."""
    if rig.tx.proc.poll() is not None:
        rig.tx = DaemonProcess("sender", rig.tx_cfg, rig.workdir)
        rig.tx.wait_ready()


def _abort_then_reuse(rig: Rig, consumer: Engine, seed: int) -> tuple[list[int], list[int]]:
    """A decode request waits for its KV and is aborted (its blocks go back to vLLM's small
    free list), another request takes blocks it had, and then the aborted request's transfer
    arrives. (the second request's tokens, the plain run's)."""
    _sender_up(rig)
    a, b = prompt(600, seed=seed), prompt(900, seed=seed + 1)
    rid = f"aborted-{uuid.uuid4().hex[:6]}"
    consumer.submit_job(
        {
            "prompts": [a, b],
            "params": [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 600}, None],
            "max_tokens": 48,
            "abort_first_after_steps": 3,
            "step_sleep_s": 0.02,  # keep the second request decoding while the KV arrives
        }
    )
    consumer.wait_for_line(ABORTED)  # the abort is done: now the producer makes its KV
    rig.producer.generate([a], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
    got = consumer.result()[0]["token_ids"]
    want = rig.reference.generate([b], None, 48)[0]["token_ids"]
    return got, want


def test_a_transfer_landing_after_its_request_was_aborted_never_touches_the_blocks(
    rig: Rig,
) -> None:
    """Issue 26: blocks vLLM has let go are never written. The consumer drops a pending load
    when vLLM finishes its request (aborted here), and the receiver refuses the late
    transfer. With the drop planted away (XDC_CONNECTOR_FAULT=stale_write) the late KV lands
    in blocks another request now uses, and that request's tokens change: the check has
    teeth. Both consumers give a request its blocks as soon as it is scheduled
    (``admit = "scheduled"``; the default ``"complete"`` gives them only to a transfer that
    is complete by then): that is when a load is pending with blocks held."""
    small = {"num_blocks": 40, "max_model_len": 1024, "core": 1}
    rx = rig.rx_sock
    extra = {"arrival_timeout_s": 10.0, "timeout_s": 30.0, "admit": "scheduled"}
    good = Engine("consumer", receiver_socket=rx, extra=extra, **small)  # type: ignore[arg-type]
    try:
        got, want = _abort_then_reuse(rig, good, seed=910)
        assert got == want, (got, want)
        assert "finished before its transfer" in good.log()
    finally:
        good.close()
    bad = Engine(
        "consumer",
        receiver_socket=rx,
        extra=extra,
        env={"XDC_CONNECTOR_FAULT": "stale_write"},
        **small,  # type: ignore[arg-type]
    )
    try:
        got, want = _abort_then_reuse(rig, bad, seed=920)
        assert got != want, "a stale write into reused blocks went unnoticed"
    finally:
        bad.close()


@pytest.mark.parametrize("admit", ["complete", "scheduled"])
def test_a_decode_waiting_for_its_kv_holds_no_blocks_another_request_needs(
    rig: Rig, admit: str
) -> None:
    """A decode request whose prefill is queued elsewhere (it begins 6 s later) beside a
    plain request, on a consumer with room for only one of them (40 blocks of 32 tokens;
    each prompt takes 22). With ``admit = "complete"`` the waiting request gets its
    blocks only once its KV is complete at the receiver, so the plain request runs at once;
    given its blocks when scheduled, it holds them idle and the plain request waits for its
    KV too. Either way both answer with the plain run's tokens, the first through xdc."""
    small = {"num_blocks": 40, "max_model_len": 1024, "core": 1}
    extra = {"arrival_timeout_s": 20.0, "timeout_s": 40.0, "admit": admit}
    eng = Engine("consumer", receiver_socket=rig.rx_sock, extra=extra, **small)  # type: ignore[arg-type]
    try:
        _sender_up(rig)
        a, b = prompt(700, seed=930), prompt(700, seed=931)
        rid = f"held-{uuid.uuid4().hex[:6]}"
        kv = {"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 700}
        eng.submit_job({"prompts": [a, b], "params": [kv, None], "together": True})
        time.sleep(6.0)  # the prefill is queued elsewhere meanwhile
        rig.producer.generate([a], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
        remote, plain = eng.result()
        assert remote["token_ids"] == rig.reference.generate([a], None, 8)[0]["token_ids"]
        assert plain["token_ids"] == rig.reference.generate([b], None, 8)[0]["token_ids"]
        assert _delivered(rig, rid), rig.tx.log()[-2000:]
        assert f"transfer {rid}" not in eng.log(), eng.log()[-3000:]  # loaded, not recomputed
        print(f"admit={admit}: plain done at {plain['seconds']}s, remote at {remote['seconds']}s")
        assert remote["seconds"] > 6.0, remote
        if admit == "complete":
            assert plain["seconds"] < 5.0, (plain, remote)  # it did not wait for the KV
        else:
            assert plain["seconds"] > 6.0, (plain, remote)  # blocks held idle: it waited
    finally:
        eng.close()


def test_a_block_landed_at_the_wrong_id_is_caught_by_the_block_digests(rig: Rig) -> None:
    """Issue 26: integrity to the engine's blocks. With a planted fault that lands a
    transfer's first block in its second block's place, the consumer's read-back of the
    blocks it filled does not hash to what the producer copied: the request is recomputed
    locally with reason "integrity", and its tokens are still the plain run's."""
    wrong = Engine(
        "consumer",
        core=1,
        receiver_socket=rig.rx_sock,
        extra={"arrival_timeout_s": 10.0, "timeout_s": 30.0},
        env={"XDC_CONNECTOR_FAULT": "wrong_block"},
    )
    try:
        _sender_up(rig)
        p = prompt(400, seed=930)
        rid = f"wrong-{uuid.uuid4().hex[:6]}"
        wrong.submit([p], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 400}])
        rig.producer.generate([p], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
        got = wrong.result()[0]["token_ids"]
        assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
        log = wrong.log()
        assert "does not hash to what the producer copied" in log, log[-3000:]
        assert _delivered(rig, rid)  # the daemons delivered it: only the block check saw it
    finally:
        wrong.close()


def test_the_sender_killed_mid_transfer_means_local_recompute(rig: Rig) -> None:
    """SIGKILL the sender while a long chunked prefill (28 steps) is streaming: the producer
    logs the failed hand-over, the receiver drops the dead session's partial request after
    its orphan grace, and the decode recomputes with the plain run's tokens. A new sender
    then serves the next transfer."""
    p = prompt(3584, seed=21)
    rid = f"mid-{uuid.uuid4().hex[:6]}"
    rig.consumer.submit([p], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 3584}])
    rig.producer.submit([p], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
    deadline = time.monotonic() + 30
    while rid not in rig.rx_status()["requests"]:  # the transfer has begun: first step done
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rig.tx.proc.send_signal(signal.SIGKILL)
    rig.tx.proc.wait(10)
    rig.producer.result()
    got = rig.consumer.result()[0]["token_ids"]
    assert got == rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert f"request {rid} delivered" not in rig.tx.log()
    assert f"transfer {rid}" in rig.consumer.log()  # it says why it prefilled locally
    rig.tx = DaemonProcess("sender", rig.tx_cfg, rig.workdir)
    rig.tx.wait_ready()
    q = prompt(300, seed=22)
    again = f"after-{uuid.uuid4().hex[:6]}"
    got2, _ = rig.pair(q, rid=again)
    assert got2["token_ids"] == rig.reference.generate([q], None, 8)[0]["token_ids"]
    assert _delivered(rig, again), rig.logs()  # not recomputed: the new sender moved it


def test_the_sender_killed_before_the_prefill_means_local_recompute(rig: Rig) -> None:
    """Last in the module: it kills the sender daemon (and starts a new one after)."""
    rig.tx.proc.send_signal(signal.SIGKILL)
    rig.tx.proc.wait(10)
    p = prompt(400, seed=13)
    rid = f"dead-{uuid.uuid4().hex[:6]}"
    got, prod = rig.pair(p, rid=rid)
    assert got["token_ids"] == rig.reference.generate([p], None, 8)[0]["token_ids"]
    assert f"cannot send {rid}" in rig.producer.log()
    # the producer's answer says so at once (a gateway then has the decode prefill by
    # itself without waiting); this rig's decode went ahead alone and waited
    assert prod["kv_transfer_params"] == {"xdc_failed": "sender_down"}, prod
    assert f"transfer {rid}" in rig.consumer.log()
