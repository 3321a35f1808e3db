"""vLLM CPU engines for the lab, the tests and bench/: seeded test checkpoints, an offline
engine in its own process, a served engine (optionally in a network namespace) and a
prefill/decode pair with xdc daemons between them. (Was tests/vllm_fixtures.py; the tests
wrap it to skip where vLLM is missing.)"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdc.errors import ConfigurationError
from xdc.integrations.vllm.serve import server_env
from xdc.lab.crash import kill_group, remove_unmapped, shm_mapped_by_group
from xdc.lab.netlab import ns_http
from xdc.lab.vllm_forkserver import ForkedEngineProcess, ForkServer

VENV = Path(os.environ.get("XDC_VLLM_VENV", "/opt/xdc-vllm"))
PY = VENV / "bin" / "python"
BLOCK = 32


class VllmMissing(ConfigurationError):
    """No vLLM venv where the lab looks for one."""


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    if PY.exists():
        return None
    return f"no vLLM venv at {VENV} (deploy/install-vllm.sh makes it; XDC_VLLM_VENV moves it)"


def need_vllm() -> None:
    why = vllm_missing()
    if why is not None:
        raise VllmMissing(why)


def vllm_env(core: int, bind: bool = False) -> dict[str, str]:
    """A lab engine's environment: the served engines' (serve.server_env), with 1 GiB of KV
    cache whatever the session asked."""
    env = server_env(core, bind=bind)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


_MODELS: dict[str, Path] = {}


def _written(name: str, *flags: str) -> Path:
    """A seeded test checkpoint written once per test session by the vLLM venv's python."""
    need_vllm()
    if name not in _MODELS:
        out = Path(tempfile.gettempdir()) / name
        res = subprocess.run(
            [str(PY), "-m", "xdc.lab.vllm_testmodel", str(out), *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        _MODELS[name] = out
    return _MODELS[name]


def test_model() -> Path:
    """The seeded dense test model (a 4-layer Llama)."""
    return _written("xdc-vllm-testmodel")


def hybrid_model(full_every: int = 2, kv_heads: int = 2) -> Path:
    """The seeded Qwen3-Next-shaped hybrid test model: one full-attention layer in every
    ``full_every`` (2: 1:1, the tests' model; 4: 3:1, Qwen3.5's and Kimi Linear's mix), with
    ``kv_heads`` full-attention KV heads (1: whole at every tensor-parallel rank)."""
    if full_every == 2 and kv_heads == 2:
        return _written("xdc-vllm-hybridmodel", "--hybrid")
    name = "xdc-vllm-hybridmodel" + (f"-fe{full_every}" if full_every != 2 else "")
    name += f"-kv{kv_heads}" if kv_heads != 2 else ""
    return _written(name, "--hybrid", f"--full-every={full_every}", f"--kv-heads={kv_heads}")


def sliding_model() -> Path:
    """The seeded Gemma-3-shaped sliding-window test model (window 64 tokens)."""
    return _written("xdc-vllm-slidingmodel", "--sliding")


def mla_model() -> Path:
    """The seeded DeepSeek-V2-shaped test model (multi-head latent attention)."""
    return _written("xdc-vllm-mlamodel", "--mla")


# vLLM 0.32's CPU rotary kernel (torch.ops._C.rotary_embedding) takes a tensor's
# second-to-last stride for its token stride: right for [tokens, heads * dim] rows, wrong for
# the [tokens, heads, dim] slices MLA hands it (q's rope half, and k_pe, a slice of each
# token's 576-value latent). It rotates token r at r * 64 values past k_pe's start, so the
# cached k_pe of token a is rotated for position 9a when the prompt is longer than 9a tokens,
# else not at all, and a token's KV depends on the prompt's length (found 2026-12-01: a
# 10-token prompt decoded other tokens through xdc than a plain engine). The CUDA kernel
# takes such slices since vLLM PR 18046. MLA engines here rotate with PyTorch's ops instead
# (``Engine(custom_ops=...)``); tests/integrations/test_vllm_mla.py checks the kernel still
# needs it.
MLA_CUSTOM_OPS = "-rotary_embedding"


_FORK_SERVER: ForkServer | None = None
_FORK_LOCK = threading.Lock()


def _fork_server() -> ForkServer | None:
    """The session's fork server (started on first use), or None where it is turned off
    (``XDC_VLLM_FORKSERVER=0``): engines then start as processes of their own."""
    global _FORK_SERVER
    if os.environ.get("XDC_VLLM_FORKSERVER", "1") == "0":
        return None
    with _FORK_LOCK:
        if _FORK_SERVER is None or not _FORK_SERVER.alive():
            log = Path(tempfile.gettempdir()) / f"xdc-vllm-forkserver-{os.getpid()}.log"
            _FORK_SERVER = ForkServer(str(PY), vllm_env(0), log)
            atexit.register(_FORK_SERVER.close)
        return _FORK_SERVER


class Engine:
    """An offline vLLM engine in its own process (xdc.lab.vllm_offline): forked from the
    session's fork server (vLLM imported once), or, in a namespace or with the server
    turned off, started as ``python -m xdc.lab.vllm_offline``."""

    def __init__(
        self,
        role: str,
        *,
        core: int = 0,
        sender_socket: str = "",
        receiver_socket: str = "",
        block_size: int = BLOCK,
        extra: dict[str, Any] | None = None,
        max_num_batched_tokens: int = 0,
        prefix_caching: bool = False,
        netns: str | None = None,
        ready_timeout: float = 240,
        dtype: str = "bfloat16",
        num_blocks: int = 0,
        max_model_len: int = 0,
        env: dict[str, str] | None = None,
        model: Path | None = None,
        tensor_parallel_size: int = 1,
        wait: bool = True,
        bind: bool = False,
        attention_backend: str = "",
        custom_ops: str = "",
    ) -> None:
        """``wait=False``: return once the process runs; ``wait_ready`` waits for the engine
        (``start_engines`` starts several side by side that way). ``bind``: one thread on
        ``core``, as ``xdc up`` runs its engines (a reference for a comparison with it)."""
        self.role = role
        self.ready_timeout = ready_timeout
        self.ready_s = 0.0
        args = [  # vllm_offline's own (the command line is built below)
            "--model",
            str(model or test_model()),
            "--role",
            role,
            "--block-size",
            str(block_size),
        ]
        if sender_socket:
            args += ["--sender-socket", sender_socket]
        if receiver_socket:
            args += ["--receiver-socket", receiver_socket]
        if extra:
            args += ["--extra", json.dumps(extra)]
        if max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if prefix_caching:
            args += ["--prefix-caching"]
        if dtype != "bfloat16":
            args += ["--dtype", dtype]
        if num_blocks:
            args += ["--num-blocks", str(num_blocks)]
        if attention_backend:
            args += ["--attention-backend", attention_backend]
        if custom_ops:
            args += [f"--custom-ops={custom_ops}"]  # one word: a value may start with '-'
        if max_model_len:
            args += ["--max-model-len", str(max_model_len)]
        binding: dict[str, str] = {}
        if tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(tensor_parallel_size)]
            # a rank per core from ``core`` on, wrapping on a small host
            n = os.cpu_count() or 1
            ranks = (str((core + r) % n) for r in range(tensor_parallel_size))
            binding["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(ranks)
        command = [str(PY), "-m", "xdc.lab.vllm_offline", *args]
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        self.log_path = Path(tempfile.mkstemp(prefix=f"xdc-vllm-{role}-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        self._out_lines: list[str] = []  # what the engine printed that is not an answer
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._shm: set[str] = set()  # what the group mapped in /dev/shm (see end_input)
        full_env = {**vllm_env(core, bind and tensor_parallel_size == 1), **binding, **(env or {})}
        server = None if netns else _fork_server()
        self.proc: subprocess.Popen[str] | ForkedEngineProcess
        if server is not None:
            self.proc = ForkedEngineProcess(server, args, full_env, self._log)
        else:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                env=full_env,
                start_new_session=True,  # a group of its own: close() reaps its rank workers too
            )
        # One thread drains stdout (vLLM logs there too): answers go to a queue, the rest to
        # the log. Reading it only while waiting for an answer would let the pipe fill and
        # stall the engine, and select() on a buffered text stream misses lines it buffered.
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.kill()
                raise

    def wait_ready(self) -> None:
        """Until the engine said it is ready (seconds it took in ``ready_s``)."""
        self.ready_s = float(self._reply(self.ready_timeout)["ready"])

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._answers.put(json.loads(line))
            else:
                self._out_lines.append(line)
        self._answers.put(None)  # the engine exited

    def log(self) -> str:
        """Everything the engine printed: stderr, then the non-answer lines of stdout."""
        self._log.flush()
        return self.log_path.read_text(errors="replace") + "".join(list(self._out_lines))

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        """Until the engine prints ``text`` on a line of its own (a step of a lab job)."""
        deadline = time.monotonic() + timeout
        while not any(line.rstrip("\n") == text for line in list(self._out_lines)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"vLLM {self.role} never printed {text!r}:\n{self.log()[-6000:]}"
                )
            time.sleep(0.02)

    def _reply(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            answer = None
        if answer is None:
            state = (
                "exited" if self.proc.poll() is not None else f"gave no answer within {timeout}s"
            )
            raise AssertionError(f"vLLM {self.role} {state}:\n{self.log()[-6000:]}")
        return answer

    def submit(
        self, prompts: list[list[int]], params: list[Any] | None = None, max_tokens: int = 8
    ) -> None:
        assert self.proc.stdin is not None
        job = {"prompts": prompts, "params": params, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def submit_job(self, job: dict[str, Any]) -> None:
        """Any job line offline.py understands (e.g. ``abort_first_after_steps``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 180) -> list[dict[str, Any]]:
        return list(self._reply(timeout)["outputs"])

    def generate(
        self, prompts: list[list[int]], params: list[Any] | None = None, max_tokens: int = 8
    ) -> list[dict[str, Any]]:
        self.submit(prompts, params, max_tokens)
        return self.result()

    def end_input(self) -> None:
        """End of input: the engine shuts down (``close`` waits for it). What its group maps
        in /dev/shm is noted first: a clean exit leaves it behind (``crash.remove_unmapped``)."""
        if self.proc.poll() is None:
            self._shm |= shm_mapped_by_group(self.proc.pid)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def close(self) -> None:
        """End of input, then the whole process group: a tensor-parallel engine's rank
        workers outlive a main process that was killed, and spin on their shared-memory
        queue (one ran at 86% of a core for 47 minutes before it was found)."""
        self.end_input()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        self.kill()  # whatever of the group is left, and its shared memory

    def kill(self) -> None:
        """At once, with its rank workers and their shared memory (an engine that failed)."""
        kill_group(self.proc.pid, self._shm)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._reader.join(5)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


def start_engines(*specs: tuple[str, dict[str, Any]]) -> list[Engine]:
    """Engines of ``(role, Engine keyword arguments)`` started side by side, then waited for:
    most of an engine's start is importing vLLM and building the model in one Python
    thread, so two or three on a 2-core host take little longer than one. If one does not
    come up, all are killed."""
    engines: list[Engine] = []
    try:
        for role, kw in specs:
            engines.append(Engine(role, **kw, wait=False))
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.kill()
        raise
    return engines


def close_engines(engines: list[Engine]) -> None:
    """End every engine's input first, then wait for each: they shut down side by side (in
    series ~4 s each)."""
    for e in engines:
        e.end_input()
    for e in engines:
        e.close()


def prompt(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids (1..2000)."""
    return [((i + 1) * 2654435761 + seed * 97) % 2000 + 1 for i in range(n)]


class VllmServer:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; ``vllm serve``
    does not run from this install) with or without the xdc connector; the argv is the one
    ``xdc up`` uses (xdc.integrations.vllm.serve). ``netns`` runs it inside a lab namespace,
    listening on ``host``."""

    def __init__(
        self,
        role: str,
        port: int,
        *,
        core: int | None = 0,
        extra: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        tokenizer: bool = False,
        served_name: str = "",
        kv_events_port: int = 0,
    ) -> None:
        from xdc.integrations.vllm.serve import ServerSpec, core_binding, server_env

        self.role, self.port, self.host = role, port, host
        self.model_name = served_name or str(test_model())
        spec = ServerSpec(
            str(PY),
            str(test_model()),
            port,
            host=host,
            role=role,
            served_name=served_name,
            block_size=BLOCK,
            extra=extra or {},
            tokenizer=tokenizer,
            kv_events_port=kv_events_port,
        )
        args = spec.argv()
        if netns:
            args = ["ip", "netns", "exec", netns, *args]
        self.netns = netns
        self.log_path = Path(tempfile.mkstemp(prefix=f"xdc-vllm-http-{role}-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        env = server_env(core)
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=core_binding(env),
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 240) -> None:
        self._wait_health(timeout)
        from xdc.integrations.vllm.serve import needs_warmup, warmup_body

        if not needs_warmup(self.role):  # a vLLM CPU issue on AMX hosts: see needs_warmup
            return
        body = warmup_body(self.model_name)
        if self.netns:
            ok = ns_http(self.netns, f"{self.url}/v1/completions", body, 120) is not None
        else:
            import urllib.request

            req = urllib.request.Request(
                f"{self.url}/v1/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                ok = r.status == 200
        assert ok, f"vLLM server {self.role}: warm-up failed:\n{self.log()[-5000:]}"

    def _wait_health(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server {self.role} exited:\n{self.log()[-5000:]}")
            if self.netns:
                if ns_http(self.netns, f"{self.url}/health") is not None:
                    return
                time.sleep(0.5)
                continue
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(
            f"vLLM server {self.role} not ready in {timeout}s:\n{self.log()[-5000:]}"
        )

    def complete(
        self, ids: list[int], max_tokens: int = 8, kv: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        import urllib.request

        body: dict[str, Any] = {
            "model": str(test_model()),
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "detokenize": False,
            "return_token_ids": True,
        }
        if kv is not None:
            body["kv_transfer_params"] = kv
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return dict(json.loads(r.read()))

    def close(self) -> None:
        """SIGTERM to the server's whole process group (the engine core is a child), then
        remove the /dev/shm files it mapped and left behind."""
        held = shm_mapped_by_group(self.proc.pid) if self.proc.poll() is None else set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid, held)
            self.proc.wait(10)
        remove_unmapped(held)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


@dataclass
class KvPair:
    """A sender and a receiver daemon, a producer engine, a consumer engine and a plain
    reference engine of one model: what a connector test drives (``kv_pair`` makes one)."""

    tx: Any  # DaemonProcess (replaced when a test kills the sender)
    rx: Any
    tx_cfg: Any  # the sender's Config, to start a new one
    rx_sock: str
    workdir: Path
    producer: Engine
    consumer: Engine
    reference: Engine

    def pair(
        self, ids: list[int], *, consumer: Engine | None = None, made_from: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Decode ``ids`` on the consumer with KV the producer makes from ``made_from``
        (default: the same prompt); the decode is sent first, as a gateway overlapping both
        does. (consumer output, producer output, rid)."""
        rid = _new_rid(ids)
        c = consumer or self.consumer
        c.submit([ids], [{"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": len(ids)}])
        made = self.producer.generate(
            [made_from or ids], [{"do_remote_decode": True, "xdc_rid": rid}], 1
        )
        return c.result()[0], made[0], rid

    def relay(
        self, ids: list[int], *, consumer: Engine | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], str]:
        """As ``pair``, but one after the other, as a gateway that waits for the prefill's
        answer does: the decode gets the ``kv_transfer_params`` the prefill answered with."""
        rid = _new_rid(ids)
        made = self.producer.generate([ids], [{"do_remote_decode": True, "xdc_rid": rid}], 1)
        handed = made[0].get("kv_transfer_params") or {}
        got = (consumer or self.consumer).generate([ids], [handed])
        return got[0], made[0], rid

    def logs(self, tail: int = 3000) -> str:
        """The last ``tail`` characters of each engine's and daemon's log: what a failed
        check prints (a decode that recomputed says why; its producer and sender say when)."""
        return log_tails(
            tail,
            consumer=self.consumer.log(),
            producer=self.producer.log(),
            sender=self.tx.log(),
            receiver=self.rx.log(),
        )

    def want(self, ids: list[int], max_tokens: int = 8) -> list[int]:
        return list(self.reference.generate([ids], None, max_tokens)[0]["token_ids"])

    def delivered_bytes(self, rid: str, timeout: float = 10) -> int:
        """The bytes the sender delivered for ``rid`` (it logs each delivery)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(rf"request {re.escape(rid)} delivered: (\d+) bytes", self.tx.log())
            if m:
                return int(m.group(1))
            time.sleep(0.05)
        raise AssertionError(f"{rid} not delivered:\n{self.tx.log()[-2000:]}")


def log_tails(tail: int, **logs: str) -> str:
    """The last ``tail`` characters of each named log, headed by its name."""
    return "".join(f"\n--- {k} ---\n{v[-tail:]}" for k, v in logs.items())


def _new_rid(ids: list[int]) -> str:
    return f"kv-{len(ids)}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def kv_pair(
    model: Path,
    *,
    engine: dict[str, Any] | None = None,
    consumer: dict[str, Any] | None = None,
    orphan_grace_s: float = 0.0,
    allowed_peers: tuple[str, ...] = (),
    reference: bool = True,
) -> Iterator[KvPair]:
    """Daemons on loopback and three engines of ``model`` with the options ``engine`` (the
    consumer also ``consumer``; the sender may also ship to ``allowed_peers``); everything
    stopped on exit, also on failure. ``reference=False``: the consumer's own plain runs
    (no transfer) are the reference, one engine fewer on a small host."""
    from xdc.transport.launcher import DaemonProcess, local_pair_config

    need_vllm()
    wd = Path(tempfile.mkdtemp(prefix="xdc-kvpair-"))
    tx_cfg, rx_cfg, _ = local_pair_config(wd, connections=2)
    if orphan_grace_s:
        rx_cfg.receiver.orphan_grace_s = orphan_grace_s  # a dead sender's request fails fast
    tx_cfg.sender.allowed_peers = allowed_peers
    rx = DaemonProcess("receiver", rx_cfg, wd)
    rx.wait_ready()
    tx = DaemonProcess("sender", tx_cfg, wd)
    made: KvPair | None = None
    engines: list[Engine] = []
    try:
        tx.wait_ready()
        kw: dict[str, Any] = {"model": model, **(engine or {})}
        waits = {"extra": {"arrival_timeout_s": 4.0, "timeout_s": 30.0}}
        rx_sock = rx_cfg.receiver.control_socket
        ckw = {**waits, **kw, **(consumer or {})}
        specs = [
            ("producer", {"core": 0, "sender_socket": tx_cfg.sender.control_socket, **kw}),
            ("consumer", {"core": 1, "receiver_socket": rx_sock, **ckw}),
        ]
        if reference:
            specs.append(("plain", {"core": 1, **kw}))
        engines = start_engines(*specs)
        producer, consumer_engine, plain = engines[0], engines[1], engines[-1]
        made = KvPair(tx, rx, tx_cfg, rx_sock, wd, producer, consumer_engine, plain)
        yield made
    finally:
        close_engines(engines)
        for d in {tx, rx, *((made.tx,) if made is not None else ())}:
            d.stop()
        shutil.rmtree(wd, ignore_errors=True)  # configs, sockets, the daemons' logs
