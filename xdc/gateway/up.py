"""``xdc up``: the whole PrfaaS path on one machine, for a user to try (and the rig the
end-to-end test and the trace benchmark run on).

Two network namespaces joined by one veth, shaped with tc tbf (and optional iptables random
loss) in the PrfaaS -> PD direction:

* ``prfaas`` namespace: a vLLM prefill instance (producer) and the xdc sender;
* ``pd`` namespace: ``--decode-nodes`` vLLM instances (default 1), each decoding remote
  prefills and prefilling + decoding the requests the router keeps local (consumer; router
  nodes ``pd-p`` / ``pd-d``, then ``pd2-p`` / ``pd2-d``, ...), each with its own xdc receiver
  (the sender may ship to any of them: ``sender.allowed_peers``; the gateway names the chosen
  node's: ``gateway.receivers``), the router (fed by every engine's KV events and /metrics and
  by the sender's link reports) and the gateway.

The gateway listens inside ``pd`` on a unix socket in the work directory (reachable from the
host, since a path socket is not tied to a network namespace); ``xdc up`` forwards
127.0.0.1:PORT on the host to it. Everything is a child process; stopping (Ctrl-C, SIGTERM)
kills them and deletes the namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xdc import __version__
from xdc.errors import ConfigurationError
from xdc.integrations.vllm.serve import (
    ServerSpec,
    core_binding,
    needs_warmup,
    server_env,
    warmup_body,
)
from xdc.lab.crash import kill_group, remove_unmapped, shm_mapped_by_group
from xdc.scheduler.profile import ProfileError, load_profile

PRFAAS_NODE, PD_PREFILL, PD_DECODE = "prfaas-a", "pd-p", "pd-d"
MODEL = "xdc-test"
ROUTER_PORT, GATEWAY_PORT, RECEIVER_PORT = 8080, 8000, 7400
PRFAAS_PORT, PD_PORT = 8100, 8200
PRFAAS_EVENTS, PD_EVENTS = 5557, 5567
PROFILE = Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "tiny-cpu.toml"
MAX_DECODE_NODES = 4


@dataclass(frozen=True)
class TestModel:
    """A seeded test model ``xdc up`` can serve, and how its engines must run it."""

    flags: tuple[str, ...]  # xdc.lab.vllm_testmodel's
    help: str
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    # the engines' prefill budget per step and running requests (0: vLLM's defaults); see
    # HYBRID_CHUNK
    chunk: int = 0
    max_num_seqs: int = 0
    # engines bound to one core and one thread each (serve.bind_to_core), where pin_cores
    # asks: the hybrid model's two busy engines ran 16x slower unbound; the others keep
    # vLLM's own threads, which the tests comparing with them were made under
    bind: bool = False


# vLLM's CPU gated-delta-net runs in bf16 only, and there a prompt's tokens depend on where its
# prefill is cut into chunks (tests/integrations/test_vllm_hybrid.py). With one request at a
# time and a fixed budget that divides vLLM's block (96 or 160 tokens: below), every engine
# cuts a prompt at the same multiples of the budget, cold or after a prefix-cache hit (hits
# end on block boundaries); a prompt of ``k * HYBRID_CHUNK + 1`` tokens is cut there by a
# plain engine too, and by the PrfaaS producer (all but the last token) and the decode (the
# last): so the whole system's tokens can be compared with a plain engine's.
HYBRID_CHUNK = 32
MODELS: dict[str, TestModel] = {
    "dense": TestModel((), "Llama-shaped"),
    "sliding": TestModel(("--sliding",), "Gemma-3-shaped, 64-token window layers beside full"),
    "hybrid": TestModel(
        ("--hybrid",),
        "Qwen3-Next-shaped, gated-delta-net layers beside full attention; bf16, one request "
        f"at a time in {HYBRID_CHUNK}-token prefill chunks",
        dtypes=("bfloat16",),
        chunk=HYBRID_CHUNK,
        max_num_seqs=1,
        bind=True,
    ),
}


@dataclass(frozen=True)
class PdNode:
    """One PD instance of ``xdc up``: its router node names, vLLM ports and xdc receiver."""

    index: int  # 0, 1, ...

    @property
    def tag(self) -> str:
        return "pd" if self.index == 0 else f"pd{self.index + 1}"

    @property
    def prefill(self) -> str:
        return f"{self.tag}-p"

    @property
    def decode(self) -> str:
        return f"{self.tag}-d"

    @property
    def engine(self) -> str:  # its process name
        return "vllm-pd" if self.index == 0 else f"vllm-{self.tag}"

    @property
    def receiver(self) -> str:  # its receiver's process name
        return "receiver" if self.index == 0 else f"receiver-{self.tag}"

    @property
    def port(self) -> int:
        return PD_PORT + 10 * self.index

    @property
    def events(self) -> int:
        return PD_EVENTS + 10 * self.index

    @property
    def receiver_port(self) -> int:
        return RECEIVER_PORT + self.index

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


MEASURE_SWEEP = (
    "--lengths",
    "256,1024,2048,3584",
    "--repeats",
    "3",
    "--batches",
    "1,4",
    "--decode-tokens",
    "16",
)
"""What `xdc up` sweeps: the lengths the gateway's tests and trace slice send, a few seconds."""


def cluster_counts(decode_nodes: int) -> tuple[str, ...]:
    """`xdc profile measure`'s shape flags for `xdc up`'s system: 1 PrfaaS engine and
    ``decode_nodes`` PD engines (each prefills and decodes); the all-PD baseline has as many
    engines as the system."""
    return (
        "--n-prfaas",
        "1",
        "--n-pd",
        str(max(2, decode_nodes)),
        "--homogeneous-instances",
        str(1 + decode_nodes),
    )


def measure_key(opts: UpOptions, model_dir: Path) -> str:
    """What a measured profile depends on: the engines (interpreter, model, dtype, cores),
    the base profile, the link and the sweep. A cached profile is reused only under the same."""
    parts = {
        "xdc": __version__,
        "vllm_python": str(opts.vllm_python),
        "model": (model_dir / "config.json").read_text(),
        "dtype": opts.dtype,
        "pin_cores": opts.pin_cores,
        "pd_kv_blocks": opts.pd_kv_blocks,
        "rate_gbit": opts.rate_gbit,
        "base": PROFILE.read_text(),
        "sweep": list(MEASURE_SWEEP),
        "cluster": list(cluster_counts(opts.decode_nodes)),
        "kv": "moved through xdc, claimed at the receiver",
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def default_vllm_python() -> Path:
    return Path(os.environ.get("XDC_VLLM_VENV", "/opt/xdc-vllm")) / "bin" / "python"


class UpError(ConfigurationError, RuntimeError):
    """The system could not be brought up; the message says which part and shows its log."""


@dataclass
class UpOptions:
    vllm_python: Path = field(default_factory=default_vllm_python)
    workdir: Path | None = None
    rate_gbit: float = 1.0
    loss: float = 0.0
    # the router's profile: None measures the engines once they are up (``xdc profile
    # measure``, cached in the workdir); a path is used as it is (tests that need the
    # declared stand-in's threshold give PROFILE)
    profile: Path | None = None
    measure_budget_s: float = 120.0
    client_token: str = ""
    metrics_interval_s: float = 0.3
    prefill_timeout_s: float = 30.0
    # two busy vLLM engines on two cores can delay the router past the gateway's 0.5 s default
    router_timeout_s: float = 2.0
    ready_timeout_s: float = 300.0
    pin_cores: bool = True
    dtype: str = "bfloat16"  # of both engines (float32: see ServerSpec.dtype)
    pd_kv_blocks: int = 0  # the PD engine's KV cache blocks (0 = as its memory allows)
    decode_nodes: int = 1  # PD instances, each with its own receiver
    # the seeded test model (MODELS): "dense" (Llama-shaped), "sliding" (Gemma-3-shaped:
    # window layers beside full attention) or "hybrid" (Qwen3-Next-shaped: linear attention,
    # whose state moves beside the full-attention blocks)
    model: str = "dense"


_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}\n]*\bblock_size="(\d+)"', re.M)


def cache_block_size(metrics: str) -> int | None:
    """The KV block size in tokens an engine's Prometheus text reports, if it does."""
    m = _BLOCK_SIZE.search(metrics)
    return int(m.group(1)) if m and 0 < int(m.group(1)) <= 1 << 20 else None


def _core(i: int) -> int:
    """The core engine ``i`` runs on (the PrfaaS one 0, PD nodes 1, 2, ...): the i-th this
    process may use, wrapping on a host with fewer cores than engines."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[i % len(cores)]


def _log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class LocalSystem:
    """Router, gateway, two vLLM servers and an xdc daemon pair across a shaped namespace link."""

    def __init__(self, opts: UpOptions) -> None:
        from xdc.lab.netlab import NetLab

        self.opts = opts
        if opts.model not in MODELS:
            raise UpError(f"model: {opts.model!r} is not one of {', '.join(MODELS)}")
        if opts.dtype not in MODELS[opts.model].dtypes:
            raise UpError(
                f"dtype: the {opts.model} model runs in {' or '.join(MODELS[opts.model].dtypes)} "
                f"on vLLM's CPU build, not {opts.dtype}"
            )
        if opts.profile is not None:  # refused now, not after the engines took a minute
            try:
                load_profile(opts.profile)
            except ProfileError as e:
                raise UpError(f"--profile {opts.profile}: {e}") from None
        if not (opts.vllm_python.is_file() and os.access(opts.vllm_python, os.X_OK)):
            raise UpError(
                f"no vLLM interpreter at {opts.vllm_python} (deploy/install-vllm.sh installs "
                "it; XDC_VLLM_VENV or --vllm-python point elsewhere)"
            )
        self.block_size = 32  # the engines' KV block in tokens, as vLLM set it (start)
        self.own_workdir = opts.workdir is None
        self.wd = opts.workdir or Path(tempfile.mkdtemp(prefix="xdc-up-"))
        self.profile: Path = opts.profile or PROFILE  # the router's, once chosen at start
        try:
            self.wd.mkdir(parents=True, exist_ok=True)
            os.chmod(self.wd, 0o755)
        except OSError as e:
            raise UpError(f"--workdir {self.wd}: {e.strerror or e}") from None
        self.lab = NetLab("xdcup")
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.logs: dict[str, Path] = {}
        # how each process was started (namespace side, argv, env): restart() repeats it
        self._how: dict[str, tuple[str, list[str], dict[str, str] | None]] = {}
        self.gateway_token = secrets.token_hex(16)
        self.daemon_token = secrets.token_hex(16)
        self.gateway_unix = str(self.wd / "gateway.sock")
        self.model_dir = self.wd / "model"
        if not 1 <= opts.decode_nodes <= MAX_DECODE_NODES:
            raise UpError(f"--decode-nodes: 1..{MAX_DECODE_NODES}")
        self.pd_nodes = [PdNode(i) for i in range(opts.decode_nodes)]
        self.receiver_sockets: dict[str, str] = {}  # receiver process name -> engine socket

    # ---- addresses -----------------------------------------------------------------------

    @property
    def prfaas_url(self) -> str:
        return f"http://{self.lab.addr_a}:{PRFAAS_PORT}"

    @property
    def pd_url(self) -> str:
        return f"http://127.0.0.1:{PD_PORT}"

    @property
    def router_url(self) -> str:
        return f"http://{self.lab.addr_b}:{ROUTER_PORT}"

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, progress: Any = print) -> None:
        try:
            self._start(progress)
        except BaseException:
            self.close()
            raise

    def _start(self, progress: Any) -> None:
        o = self.opts
        t0 = time.monotonic()
        self.lab.up()
        self.lab.set_rate(o.rate_gbit)
        if o.loss:
            self.lab.set_loss(o.loss)
        progress(
            f"lab: namespaces {self.lab.ns_a} (PrfaaS, {self.lab.addr_a}) and {self.lab.ns_b} "
            f"(PD, {self.lab.addr_b}), {o.rate_gbit} Gbit/s tbf"
            + (f", {o.loss:.1%} random loss" if o.loss else "")
        )
        flags = MODELS[o.model].flags
        res = subprocess.run(
            [str(o.vllm_python), "-m", "xdc.lab.vllm_testmodel", str(self.model_dir), *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            raise UpError(f"writing the test model failed:\n{res.stderr[-3000:]}")
        self._start_daemons()
        progress("xdc sender (PrfaaS) and receiver (PD) ready")
        self._start_engines()
        self._wait_engines(progress)
        self.block_size = self._engines_block_size()
        self.profile = self._profile(progress)
        self._start_router()
        self._start_gateway()
        self._wait_router_nodes()
        progress(f"router and gateway ready ({time.monotonic() - t0:.0f} s)")

    def _popen(
        self,
        name: str,
        side: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> subprocess.Popen[Any]:
        log = self.wd / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as f:
            p = self.lab.popen(
                side, argv, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn
            )
        self.procs[name] = p
        self._how[name] = (side, argv, env)
        return p

    def restart(self, name: str) -> None:
        """SIGKILL an xdc daemon ("sender" or "receiver") and start it again with the same
        config, as a supervisor would after a crash; returns once its engine socket is back."""
        if name != "sender" and name not in self.receiver_sockets:
            raise ValueError(f"restart: {name!r} is not an xdc daemon")
        self.kill(name)
        side, argv, env = self._how[name]
        self._popen(name, side, argv, env)
        sock = self.sender_socket if name == "sender" else self.receiver_sockets[name]
        deadline = time.monotonic() + 20
        while True:  # the socket file of the killed one may still be there: wait for a listener
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(sock)
                return
            except OSError:
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise UpError(
                        f"{name} did not restart:\n{_log_tail(self.logs[name])}"
                    ) from None
                time.sleep(0.05)
            finally:
                s.close()

    def _start_daemons(self) -> None:
        from xdc.config import to_toml
        from xdc.transport.launcher import local_pair_config

        tx, rx, _ = local_pair_config(
            self.wd,
            connections=4,
            send_pool=256 << 20,
            recv_pool=512 << 20,
            port=RECEIVER_PORT,
        )
        daemons: list[tuple[str, str, Any]] = []
        for node in self.pd_nodes:
            if node.index:
                wd = self.wd / node.tag
                wd.mkdir(exist_ok=True)
                _, rx, _ = local_pair_config(
                    wd, connections=4, recv_pool=512 << 20, port=node.receiver_port
                )
            rx.receiver.listen_host = self.lab.addr_b
            rx.node.cluster = "pd"
            rx.node.id = node.decode
            self.receiver_sockets[node.receiver] = rx.receiver.control_socket
            daemons.append((node.receiver, "b", rx))
        tx.sender.peer_host = self.lab.addr_b
        tx.sender.allowed_peers = tuple(self.receiver_addresses().values())
        tx.node.cluster = "prfaas"
        tx.sender.peer_cluster = "pd"
        tx.monitor.router_url = self.router_url
        tx.monitor.router_token = self.daemon_token
        tx.monitor.link_capacity_bps = self.opts.rate_gbit * 1e9
        self.sender_socket = tx.sender.control_socket
        self.receiver_socket = self.receiver_sockets["receiver"]
        daemons.append(("sender", "a", tx))
        for name, side, cfg in daemons:
            path = self.wd / f"{name}.toml"
            path.write_text(to_toml(cfg))
            self._popen(
                name, side, [sys.executable, "-m", "xdc", name.split("-")[0], "--config", str(path)]
            )
            sock = cfg.sender.control_socket if name == "sender" else cfg.receiver.control_socket
            self._wait_socket(name, sock, 20)

    def receiver_addresses(self) -> dict[str, str]:
        """Decode node name -> its receiver's data address, as the sender reaches it."""
        return {n.decode: f"{self.lab.addr_b}:{n.receiver_port}" for n in self.pd_nodes}

    def _start_engines(self) -> None:
        o = self.opts
        env = server_env(None)
        env.pop("PYTHONHASHSEED", None)  # the router hashes blocks with vLLM's default seed
        engines: list[tuple[str, str, str, int, str, dict[str, Any], int, int]] = [
            (
                "vllm-prfaas",
                "a",
                self.lab.addr_a,
                PRFAAS_PORT,
                "producer",
                {"sender_socket": self.sender_socket, "deadline_s": o.prefill_timeout_s},
                PRFAAS_EVENTS,
                _core(0),
            )
        ]
        for node in self.pd_nodes:
            engines.append(
                (
                    node.engine,
                    "b",
                    "127.0.0.1",
                    node.port,
                    "consumer",
                    {
                        "receiver_socket": self.receiver_sockets[node.receiver],
                        "arrival_timeout_s": 5.0,
                    },
                    node.events,
                    _core(1 + node.index),
                )
            )
        for name, side, host, port, role, extra, events, core in engines:
            spec = ServerSpec(
                str(o.vllm_python),
                str(self.model_dir),
                port,
                host=host,
                role=role,
                served_name=MODEL,
                extra=extra,
                tokenizer=True,
                kv_events_port=events,
                dtype=o.dtype,
                num_blocks=o.pd_kv_blocks if role == "consumer" else 0,
                max_num_batched_tokens=MODELS[o.model].chunk,
                max_num_seqs=MODELS[o.model].max_num_seqs,
            )
            bind = o.pin_cores and MODELS[o.model].bind
            e = server_env(core if o.pin_cores else None, env, bind=bind)
            self._popen(name, side, spec.argv(), env=e, preexec_fn=core_binding(e))

    def _start_router(self) -> None:
        o = self.opts
        a = self.lab.addr_a
        events = ",".join(
            [f"prfaas/{PRFAAS_NODE}=tcp://{a}:{PRFAAS_EVENTS}|tcp://{a}:{PRFAAS_EVENTS + 1}"]
            + [
                f"pd/{n.prefill}=tcp://127.0.0.1:{n.events}|tcp://127.0.0.1:{n.events + 1}"
                for n in self.pd_nodes
            ]
        )
        metrics = ",".join(
            [f"prfaas/{PRFAAS_NODE}@prefill={self.prfaas_url}/metrics"]
            + [
                f"pd/{n.prefill}@prefill={n.url}/metrics,pd/{n.decode}@decode={n.url}/metrics"
                for n in self.pd_nodes
            ]
        )
        sets = {
            "router.listen_host": self.lab.addr_b,
            "router.listen_port": ROUTER_PORT,
            "router.profile": str(self.profile),
            "router.keep_local_when_faster": self.keep_local_when_faster,
            "router.gateway_token": self.gateway_token,
            "router.daemon_token": self.daemon_token,
            "router.block_size": self.block_size,
            "router.vllm_kv_events": events,
            "router.vllm_metrics": metrics,
            "router.vllm_metrics_interval_s": o.metrics_interval_s,
            "router.event_loop": "asyncio",
        }
        argv = [sys.executable, "-m", "xdc", "router"]
        for k, v in sets.items():
            argv += ["--set", f"{k}={v}"]
        self._popen("router", "b", argv)

    def _start_gateway(self) -> None:
        self.add_gateway("gateway", self.gateway_unix, GATEWAY_PORT)

    def add_gateway(
        self,
        name: str,
        unix: str,
        port: int,
        *,
        router: bool = True,
        prefill: str = PD_PREFILL,
        decode: str = PD_DECODE,
    ) -> None:
        """A gateway in the PD namespace; ``router=False`` makes it run every request on
        the static plan prefill -> decode (the benchmark's everything-local / -remote)."""
        o = self.opts
        nodes = ",".join(
            [f"{PRFAAS_NODE}={self.prfaas_url}"]
            + [f"{n.prefill}={n.url},{n.decode}={n.url}" for n in self.pd_nodes]
        )
        receivers = ",".join(f"{k}={v}" for k, v in self.receiver_addresses().items())
        sets = {
            "gateway.listen_host": "127.0.0.1",
            "gateway.listen_port": port,
            "gateway.listen_unix": unix,
            "gateway.router_url": self.router_url if router else "",
            "gateway.router_token": self.gateway_token,
            "gateway.client_tokens": o.client_token,
            "gateway.model": MODEL,
            "gateway.nodes": nodes,
            "gateway.receivers": receivers,
            "gateway.fallback_prefill": prefill,
            "gateway.fallback_decode": decode,
            "gateway.prefill_timeout_s": o.prefill_timeout_s,
            "gateway.router_timeout_s": o.router_timeout_s,
        }
        argv = [sys.executable, "-m", "xdc", "gateway"]
        for k, v in sets.items():
            argv += ["--set", f"{k}={v}"]
        self._popen(name, "b", argv)
        self._wait_socket(name, unix, 30)

    def _wait_socket(self, name: str, path: str, timeout: float) -> None:
        """Until process ``name`` has created its unix socket ``path``."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise UpError(f"{name} did not start:\n{_log_tail(self.logs[name])}")
            time.sleep(0.05)

    @property
    def keep_local_when_faster(self) -> bool:
        """The router's ``keep_local_when_faster``: on with the engines' measured profile
        (equal speeds on one CPU: an offload that is no faster stays local); a given profile
        keeps the paper's rule."""
        return self.opts.profile is None

    def ns_get(self, side: str, url: str, timeout: float = 5.0) -> Any:
        """GET ``url`` from inside a namespace (JSON or text); None when it does not answer."""
        text = self.lab.http(side, url, timeout=timeout)
        if text is None:
            return None
        with contextlib.suppress(ValueError):
            return json.loads(text)
        return text

    def _wait_engines(self, progress: Any) -> None:
        deadline = time.monotonic() + self.opts.ready_timeout_s
        pending = {"vllm-prfaas": ("a", self.prfaas_url)}
        pending.update({n.engine: ("b", n.url) for n in self.pd_nodes})
        while pending:
            for name, (side, url) in list(pending.items()):
                if self.procs[name].poll() is not None:
                    raise UpError(f"{name} exited:\n{_log_tail(self.logs[name])}")
                if self.ns_get(side, url + "/health") is not None:
                    if name != "vllm-prfaas" and needs_warmup("consumer", self.opts.dtype):
                        self._warm_up(name, side, url)
                    progress(f"{name} ready")
                    del pending[name]
            if time.monotonic() > deadline:
                raise UpError(f"{', '.join(pending)} not ready in {self.opts.ready_timeout_s}s")
            time.sleep(1.0)

    def _engines_block_size(self) -> int:
        """The KV block vLLM chose (``vllm:cache_config_info``), which the router hashes
        prompts by: a hybrid model's is raised to fit its state's page (for the hybrid test
        model, asked for 32: 160 tokens where torch sees AVX512-BF16 and vLLM keeps the
        recurrent state in float32, 96 where it keeps it in bf16), and a router hashing at
        another size would drop every KV event (``dropped.block_size`` in its state)."""
        urls = [("vllm-prfaas", "a", self.prfaas_url)]
        urls += [(n.engine, "b", n.url) for n in self.pd_nodes]
        sizes = {}
        for name, side, url in urls:
            text = self.ns_get(side, url + "/metrics")
            size = cache_block_size(text) if isinstance(text, str) else None
            if size is None:
                raise UpError(f"{name}: /metrics names no vllm:cache_config_info block_size")
            sizes[name] = size
        if len(set(sizes.values())) != 1:
            raise UpError(f"the engines' KV blocks differ: {sizes}")
        return next(iter(sizes.values()))

    def _warm_up(self, name: str, side: str, url: str) -> None:
        """One local prefill before the decode engine serves a load (a vLLM CPU issue on
        AMX hosts: ``serve.needs_warmup``)."""
        if self.lab.http(side, url + "/v1/completions", warmup_body(MODEL), timeout=120) is None:
            raise UpError(f"{name}: its warm-up prefill failed:\n{_log_tail(self.logs[name])}")

    def _profile(self, progress: Any) -> Path:
        """The router's profile: the one given, or the engines measured now through their
        OpenAI endpoints from the PD side (``xdc profile measure``), reused from the workdir
        when nothing it depends on changed."""
        o = self.opts
        if o.profile is not None:
            progress(f"router profile: {o.profile} (given, not measured)")
            return o.profile
        out, key_file = self.wd / "profile-measured.toml", self.wd / "profile-measured.key"
        key = measure_key(o, self.model_dir)
        if out.is_file() and key_file.is_file() and key_file.read_text() == key:
            try:
                load_profile(out)
            except ProfileError:
                pass  # rewritten below
            else:
                progress(f"router profile: {out} (measured before, same engines)")
                return out
        argv = [
            sys.executable,
            "-m",
            "xdc",
            "profile",
            "measure",
            "--pd",
            self.pd_nodes[0].url,
            "--prfaas",
            self.prfaas_url,
            "--base",
            str(PROFILE),
            "--out",
            str(out),
            *MEASURE_SWEEP,
            # PrfaaS prompts go through the connector and are claimed at node 0's receiver:
            # the KV sizes are what xdc moved, the PrfaaS prefill what the producer pays
            "--receiver-socket",
            self.receiver_sockets[self.pd_nodes[0].receiver],
            "--egress-gbps",
            str(o.rate_gbit),
            # the system measured: one PrfaaS engine and decode_nodes PD engines, each of which
            # prefills and decodes; the planner's smallest PD split is one prefill and one
            # decode instance (bench/README.md: what one engine doing both costs the model)
            *cluster_counts(o.decode_nodes),
            "--budget-s",
            str(o.measure_budget_s),
        ]
        res = self.lab.run("b", argv, timeout=o.measure_budget_s + 30)
        (self.wd / "profile-measure.log").write_text(res.stderr)
        if res.returncode != 0:
            raise UpError(f"measuring the engines failed:\n{res.stderr[-3000:]}")
        key_file.write_text(key)
        got = json.loads(res.stdout)
        progress(
            f"router profile: measured {out} (PD prefill {got['pd_prefill_s']} s, PrfaaS "
            f"{got['prfaas_prefill_s']} s at {got['lengths']} tokens; KV {got['kv_bytes']} "
            f"bytes moved; decode {got['pd_t_decode_s'] * 1e3:.1f} ms/token at batch "
            f"{got['bs_max']})"
        )
        return out

    def router_state(self) -> dict[str, Any]:
        st = self.ns_get("b", self.router_url + "/v1/state")
        return st if isinstance(st, dict) else {}

    def _wait_router_nodes(self) -> None:
        want = {PRFAAS_NODE, *(x for n in self.pd_nodes for x in (n.prefill, n.decode))}
        deadline = time.monotonic() + 60
        while True:
            nodes = self.router_state().get("nodes", [])
            rows = nodes if isinstance(nodes, list) else [r for v in nodes.values() for r in v]
            seen = {r.get("name") for r in rows if r.get("healthy", True)}
            gw_ok = os.path.exists(self.gateway_unix)
            if want <= seen and gw_ok:
                return
            for name in ("router", "gateway"):
                if self.procs[name].poll() is not None:
                    raise UpError(f"{name} exited:\n{_log_tail(self.logs[name])}")
            if time.monotonic() > deadline:
                raise UpError(
                    f"router sees nodes {sorted(x for x in seen if x)}, wants {sorted(want)}; "
                    f"gateway socket {'up' if gw_ok else 'missing'}:\n"
                    f"{_log_tail(self.logs['router'], 2000)}"
                )
            time.sleep(0.3)

    def kill(self, name: str) -> None:
        """SIGKILL one component's whole process group (a crash, for failure tests)."""
        p = self.procs[name]
        kill_group(p.pid)  # and remove the shared memory it left behind (xdc.lab.crash)
        p.wait(10)

    def log(self, name: str) -> str:
        return _log_tail(self.logs[name], 200_000)

    def close(self) -> None:
        """Stop everything (engines first, so no transfer is in flight), delete the lab.
        A Ctrl-C or SIGTERM meanwhile is noted, not obeyed: it would stop the clean-up half
        way and leave engines, namespaces and shared memory behind."""
        with _signals_deferred():
            self._close()

    def _close(self) -> None:
        order = [
            "vllm-prfaas",
            *(n.engine for n in self.pd_nodes),
            "router",
            "sender",
            *(n.receiver for n in self.pd_nodes),
        ]
        held: dict[int, set[str]] = {}  # what each group maps in /dev/shm: a clean exit
        for name in [n for n in self.procs if n not in order] + order:  # leaves some behind
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            held[p.pid] = shm_mapped_by_group(p.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                kill_group(p.pid, held.get(p.pid, set()))
                p.wait(5)
        remove_unmapped(set().union(*held.values()))
        self.lab.close()
        if self.own_workdir and os.environ.get("XDC_UP_KEEP") != "1":
            shutil.rmtree(self.wd, ignore_errors=True)

    def __enter__(self) -> LocalSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM say "still stopping" instead of raising, until the block ends (only
    the main thread can set handlers; elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: object) -> None:
        print("xdc up: still stopping (engines, daemons, namespaces)", file=sys.stderr, flush=True)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --- `xdc up` ---------------------------------------------------------------------------------


def _listener(port: int) -> socket.socket:
    """The host port, taken before anything starts: a port in use is refused at once, not
    after the engines' minute, and nothing takes it meanwhile (a client that connects early
    waits in the backlog until the system is up)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def _forward(listener: socket.socket, unix_path: str, stop: asyncio.Event) -> None:
    """The host port (``_listener``) -> the gateway's unix socket, byte for byte."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_unix_connection(unix_path), 5)
        except (OSError, TimeoutError):
            cw.close()
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pipe(cr, uw))
            tg.create_task(pipe(ur, cw))

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await stop.wait()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="host port for the gateway")
    parser.add_argument("--rate-gbit", type=float, default=1.0, help="PrfaaS -> PD link rate")
    parser.add_argument("--loss", type=float, default=0.0, help="random loss on it, 0..0.2")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=default_vllm_python(),
        help="python of the vLLM venv (deploy/install-vllm.sh)",
    )
    parser.add_argument("--workdir", type=Path, help="logs, sockets, model (default: temp)")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="the router's profile as given (default: measure the engines at start, "
        "cached in the workdir)",
    )
    parser.add_argument("--token", default="", help="client token (default: generated)")
    parser.add_argument("--no-auth", action="store_true", help="no client token")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the engines' dtype; float32 decodes a long prompt the same after a full "
        "prefill and after a prefix-cache hit (bfloat16 on vLLM's CPU build does not)",
    )
    parser.add_argument(
        "--decode-nodes",
        type=int,
        default=1,
        help=f"PD vLLM instances, each with its own xdc receiver (1..{MAX_DECODE_NODES}); the "
        "router picks one per request and the KV goes to that one's receiver",
    )
    parser.add_argument(
        "--model",
        choices=list(MODELS),
        default="dense",
        help="the seeded test model both engines serve: "
        + "; ".join(f"{k} ({m.help})" for k, m in MODELS.items()),
    )


def run(args: argparse.Namespace) -> int:
    if not 0 < args.rate_gbit <= 100:
        print("xdc up: --rate-gbit must be in (0, 100]", file=sys.stderr)
        return 2
    if not 0 <= args.loss <= 0.2:
        print("xdc up: --loss must be in [0, 0.2]", file=sys.stderr)
        return 2
    if not 1 <= args.port <= 65535:
        print("xdc up: --port must be 1..65535", file=sys.stderr)
        return 2
    if not 1 <= args.decode_nodes <= MAX_DECODE_NODES:
        print(f"xdc up: --decode-nodes must be 1..{MAX_DECODE_NODES}", file=sys.stderr)
        return 2
    from xdc.lab.netlab import unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"xdc up: needs network namespaces: {why}", file=sys.stderr)
        return 2
    try:
        listener = _listener(args.port)
    except OSError as e:
        print(f"xdc up: cannot listen on 127.0.0.1:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    with listener:  # SIGTERM unwinds like Ctrl-C (xdc.cli.OWN_SIGTERM)
        try:
            return _run(args, listener)
        except KeyboardInterrupt:
            print("xdc up: interrupted; stopped", file=sys.stderr, flush=True)
            return 130


def _run(args: argparse.Namespace, listener: socket.socket) -> int:
    token = "" if args.no_auth else (args.token or secrets.token_hex(12))
    opts = UpOptions(
        vllm_python=args.vllm_python,
        workdir=args.workdir,
        rate_gbit=args.rate_gbit,
        loss=args.loss,
        client_token=token,
        dtype=args.dtype,
        decode_nodes=args.decode_nodes,
        profile=args.profile,
        model=args.model,
    )
    try:
        system = LocalSystem(opts)
    except UpError as e:
        print(f"xdc up: {e}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    with system:
        try:
            system.start(progress=lambda m: print(f"xdc up: {m}", flush=True))
        except UpError as e:
            print(f"xdc up: {e}", file=sys.stderr)
            return 1
        auth = f" -H 'Authorization: Bearer {token}'" if token else ""
        print(
            f"\nxdc up: ready. Gateway (OpenAI API) on http://127.0.0.1:{args.port}\n"
            f"  curl -s http://127.0.0.1:{args.port}/v1/completions{auth} "
            "-H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{MODEL}", "prompt": "hello", "max_tokens": 16}}\'\n'
            "  (response header x-xdc-route says where it was prefilled; prompts longer "
            "than the router's threshold, ~2,000 tokens, go to the PrfaaS instance)\n"
            f"  logs: {system.wd}   router state: ip netns exec {system.lab.ns_b} "
            f"curl {system.router_url}/v1/state\n"
            "Ctrl-C stops everything.",
            flush=True,
        )

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await _forward(listener, system.gateway_unix, stop)

        asyncio.run(serve())
        print("xdc up: stopping", flush=True)
    print("xdc up: stopped", flush=True)
    return 0
