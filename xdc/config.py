"""One typed configuration object for every xdc process.

Sources are layered, later ones win: built-in defaults < TOML file < ``XDC_SECTION__FIELD``
environment variables < command-line flags (``--set section.field=value`` and the few
subcommand-specific flags). Every value is checked against the dataclass field's type and
range, and *all* problems are reported at once, each naming its field, so an operator fixes
a config in one round instead of one error per restart.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xdc.config_entries import (
    BOOL_WORDS,
    check_vllm_hash,
    entries,
    parse_addresses,
    parse_allowed_peers,
    parse_endpoints,
    parse_nodes,
    parse_receivers,
    parse_targets,
)
from xdc.errors import ConfigurationError
from xdc.linkreport import CLUSTER_NAME
from xdc.protocol import aead_aegis
from xdc.protocol.wire.limits import Limits
from xdc.textfile import UnreadableFile, read_text_file

ENV_PREFIX = "XDC_"


class ConfigError(ConfigurationError, ValueError):
    """Raised with every problem found, one per line, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; /dev/zero or a log file named by mistake is not


def _check(cond: bool, problems: list[str], msg: str) -> None:
    if not cond:
        problems.append(msg)


@dataclass
class NodeConfig:
    """Identity of this process; the peer id travels in the wire handshake."""

    id: str = "xdc-node"
    datacenter: str = "dc-a"
    # Cluster this process belongs to, as the router's profile names it: a sender's link
    # reports name their link node.cluster -> sender.peer_cluster.
    cluster: str = "prfaas"
    log_level: str = "info"
    log_json: bool = False
    # Extra uids allowed on the engine sockets besides the daemon's own uid and root: the
    # engines may run as a different service user than the daemon.
    allowed_uids: tuple[int, ...] = ()
    # On SIGTERM, in-flight transfers get this long to finish before they are failed.
    shutdown_drain_s: float = 10.0

    def validate(self, p: list[str]) -> None:
        _check(bool(self.id) and len(self.id) <= 128, p, "node.id: must be 1..128 characters")
        _check(
            bool(CLUSTER_NAME.match(self.cluster)),
            p,
            f"node.cluster: {self.cluster[:80]!r} is not a cluster name ({CLUSTER_NAME.pattern})",
        )
        for uid in self.allowed_uids:
            _check(0 <= uid < 1 << 32, p, f"node.allowed_uids: {uid} is not a uid")
        _check(self.shutdown_drain_s >= 0, p, "node.shutdown_drain_s: must be >= 0")
        _check(
            self.log_level in ("debug", "info", "warning", "error"),
            p,
            f"node.log_level: {self.log_level!r} is not one of debug, info, warning, error",
        )


@dataclass
class LimitsConfig:
    """Hard protocol limits; both peers enforce them on every frame. The config section of
    the protocol's ``Limits`` (same fields, same defaults), validated; ``limits()`` is the
    value the daemons use."""

    # the defaults are the protocol's own (one place: xdc.protocol.wire.limits)
    max_header_bytes: int = Limits.max_header_bytes
    max_chunk_bytes: int = Limits.max_chunk_bytes
    max_layers: int = Limits.max_layers
    max_request_bytes: int = Limits.max_request_bytes
    max_concurrent_transfers: int = Limits.max_concurrent_transfers
    max_block_hashes: int = Limits.max_block_hashes

    def limits(self) -> Limits:
        return Limits(**dataclasses.asdict(self))

    def validate(self, p: list[str]) -> None:
        _check(256 <= self.max_header_bytes <= 65535, p, "limits.max_header_bytes: 256..65535")
        _check(
            4096 <= self.max_chunk_bytes <= 64 * 1024**2,
            p,
            "limits.max_chunk_bytes: 4096..67108864",
        )
        _check(1 <= self.max_layers <= 65535, p, "limits.max_layers: 1..65535")
        _check(self.max_request_bytes >= 1, p, "limits.max_request_bytes: must be >= 1")
        _check(
            1 <= self.max_concurrent_transfers <= 65535,
            p,
            "limits.max_concurrent_transfers: 1..65535",
        )
        _check(self.max_block_hashes >= 0, p, "limits.max_block_hashes: must be >= 0")


@dataclass
class SenderConfig:
    """The prefill-side daemon: takes layers from the engine, stripes them over N connections."""

    peer_host: str = "127.0.0.1"
    peer_port: int = 7400
    # Cluster of the receiver this sender streams to: the link is node.cluster -> peer_cluster.
    peer_cluster: str = "pd"
    # Extra "host:port" paths to the same receiver (several NICs or IPs); the N connections
    # are spread round-robin over peer_host:peer_port and these.
    peer_extra_addresses: tuple[str, ...] = ()
    # The other receivers this sender may stream to when an engine names one (the decode node
    # the router chose for a request): "host:port" or "host:port=tls-name" entries
    # (the name that receiver's certificate must carry under mutual TLS; default its host).
    # peer_host:peer_port is always allowed; a request naming any other address is refused,
    # so no engine and no gateway client can make the sender ship KV anywhere else.
    allowed_peers: tuple[str, ...] = ()
    connections: int = 8
    # 2 MiB: half the per-chunk work (frames, ACKs, wake-ups) of 1 MiB; side by side on this
    # 2-core box, 10 Gbit/s link 1.05 -> 0.98 CPU s/GB, loopback 22.8 -> 28.7 Gbit/s. A layer
    # still spreads over every connection once it is larger than 2 MiB x connections.
    chunk_bytes: int = 2 * 1024 * 1024
    pool_bytes: int = 1024 * 1024**2
    control_socket: str = "/tmp/xdc-sender.sock"
    status_port: int = 0
    # address the /status and /metrics endpoint binds (127.0.0.1: scrape with a node-local agent)
    status_host: str = "127.0.0.1"
    # a request fails when this long passes with neither its engine handing new bytes over nor
    # the receiver acknowledging any, and at the latest transfer_max_s after BEGIN
    transfer_deadline_s: float = 30.0
    transfer_max_s: float = 600.0
    idle_timeout_s: float = 3.0
    connect_timeout_s: float = 3.0
    reconnect_backoff_s: float = 0.2
    sndbuf_bytes: int = 0
    # unsent bytes a connection may hold before it stops taking chunks (0 = kernel default).
    # One default chunk: a writer is woken once notsent falls under half of this, so the mark
    # sets the bytes per wake-up. 512 KiB -> 2 MiB, side by side (exp_knob, 3 repeats):
    # loopback 30.4 -> 33.9 Gbit/s, 10 Gbit/s link 0.73 -> 0.68 daemon CPU s/GB.
    notsent_lowat_bytes: int = 2 * 1024 * 1024
    pacing_rate_bps: int = 0
    # back off (AIMD on SO_MAX_PACING_RATE) when the monitor says the link is congested
    congestion_control: bool = True
    # TCP congestion control algorithm for data sockets ("" = the host's default, e.g. bbr)
    tcp_congestion: str = ""
    # chunk payloads (hash, seal, write) in a worker thread per connection, plain or sealed:
    # "auto" = plain TCP from DATA_THREADS_MIN_CORES cores, sealed records never ("on" = both;
    # see data_threads_for)
    data_threads: str = "auto"
    # with data threads, queued chunks a connection sends in one hand-off to its thread (only
    # those no idle connection would take; 1 = one chunk a hand-off)
    send_batch_chunks: int = 4
    # worker processes that frame, checksum, seal and write chunk payloads (0 = none; plain TCP
    # and sealed records; docs/data_workers.md): a count, or "auto" = from the cores this
    # process may use (data_workers_for). Experimental: not measured on many cores yet
    data_workers: int | str = 0

    def extra_addresses(self) -> tuple[tuple[str, int], ...]:
        """``peer_extra_addresses`` parsed: more (host, port) paths to the sender's own
        receiver. ValueError names a bad entry."""
        return parse_addresses(self.peer_extra_addresses, "sender.peer_extra_addresses")

    def allowed_peer_names(self) -> dict[tuple[str, int], str | None]:
        """``allowed_peers`` parsed: (host, port) -> the TLS name its certificate must carry
        (None: the host). ValueError names a bad entry."""
        return parse_allowed_peers(self.allowed_peers)

    def validate(self, p: list[str]) -> None:
        _check(1 <= self.peer_port <= 65535, p, "sender.peer_port: 1..65535")
        try:
            self.allowed_peer_names()
        except ValueError as e:
            _check(False, p, str(e))
        _check_data_threads(self.data_threads, p, "sender")
        _check(1 <= self.send_batch_chunks <= 64, p, "sender.send_batch_chunks: 1..64")
        _check_data_workers(self.data_workers, p, "sender")
        _check(
            bool(CLUSTER_NAME.match(self.peer_cluster)),
            p,
            f"sender.peer_cluster: {self.peer_cluster[:80]!r} is not a cluster name",
        )
        _check(1 <= self.connections <= 256, p, "sender.connections: 1..256")
        try:
            self.extra_addresses()
        except ValueError as e:
            p.append(str(e))
        _check(
            4096 <= self.chunk_bytes <= 64 * 1024**2,
            p,
            "sender.chunk_bytes: 4096..67108864",
        )
        _check(self.pool_bytes >= self.chunk_bytes, p, "sender.pool_bytes: must be >= chunk_bytes")
        _check(0 <= self.status_port <= 65535, p, "sender.status_port: 0..65535 (0 = off)")
        _check(bool(self.status_host), p, "sender.status_host: must not be empty")
        for name in ("transfer_deadline_s", "idle_timeout_s", "connect_timeout_s"):
            _check(getattr(self, name) > 0, p, f"sender.{name}: must be > 0")
        _check(
            self.transfer_max_s >= self.transfer_deadline_s,
            p,
            "sender.transfer_max_s: must be >= sender.transfer_deadline_s",
        )
        _check(self.reconnect_backoff_s >= 0, p, "sender.reconnect_backoff_s: must be >= 0")
        _check(self.sndbuf_bytes >= 0, p, "sender.sndbuf_bytes: must be >= 0 (0 = kernel)")
        _check(self.pacing_rate_bps >= 0, p, "sender.pacing_rate_bps: must be >= 0 (0 = off)")
        _check(self.notsent_lowat_bytes >= 0, p, "sender.notsent_lowat_bytes: must be >= 0")


@dataclass
class ReceiverConfig:
    """The decode-side daemon: owns the shared-memory pool the decode engine reads from."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 7400
    pool_bytes: int = 2 * 1024**3
    control_socket: str = "/tmp/xdc-receiver.sock"
    status_port: int = 0
    # address the /status and /metrics endpoint binds (127.0.0.1: scrape with a node-local agent)
    status_host: str = "127.0.0.1"
    # a request fails when this long (or the sender's shorter window) passes with no chunk of
    # it verified and no KEEP or END from its sender, and at the latest transfer_max_s after
    # BEGIN
    transfer_deadline_s: float = 30.0
    transfer_max_s: float = 600.0
    idle_timeout_s: float = 3.0
    handshake_timeout_s: float = 3.0
    completed_memory: int = 4096
    rcvbuf_bytes: int = 0
    # data connections held at once (each costs a socket and a read buffer; more are closed)
    max_connections: int = 1024
    # chunk-sized buffers lent at once, across all connections, to resends that race the
    # original copy of a chunk (each is limits.max_chunk_bytes; more racing copies are
    # declined with a NACK and resent)
    scratch_buffers: int = 8
    # a sender session with no connection left keeps its partial requests this long (a
    # reconnect continues them; a restarted sender's retry replaces them at once)
    orphan_grace_s: float = 10.0
    # a complete request that no decode engine claims is freed after this long
    unclaimed_ttl_s: float = 300.0
    # chunk payloads (read, open, verify) in a worker thread per connection, plain or sealed:
    # "auto" = plain TCP from DATA_THREADS_MIN_CORES cores, sealed never (data_threads_for)
    data_threads: str = "auto"
    # worker processes that receive, open and verify chunk payloads in place (0 = none; a
    # count or "auto", see sender.data_workers)
    data_workers: int | str = 0
    # with data workers and plain TCP: a worker reads a connection's frames itself and lands
    # the first sends of chunks of the session's requests without asking the daemon per chunk
    # (docs/data_workers.md, step 2). Experimental, as data_workers
    worker_runs: bool = False

    def validate(self, p: list[str]) -> None:
        _check(0 <= self.listen_port <= 65535, p, "receiver.listen_port: 0..65535")
        _check_data_threads(self.data_threads, p, "receiver")
        _check_data_workers(self.data_workers, p, "receiver")
        _check(1 <= self.max_connections <= 65536, p, "receiver.max_connections: 1..65536")
        _check(1 <= self.scratch_buffers <= 1024, p, "receiver.scratch_buffers: 1..1024")
        _check(self.orphan_grace_s > 0, p, "receiver.orphan_grace_s: must be > 0")
        _check(self.unclaimed_ttl_s > 0, p, "receiver.unclaimed_ttl_s: must be > 0")
        _check(self.pool_bytes >= 4096, p, "receiver.pool_bytes: must be >= 4096")
        _check(0 <= self.status_port <= 65535, p, "receiver.status_port: 0..65535 (0 = off)")
        _check(bool(self.status_host), p, "receiver.status_host: must not be empty")
        for name in ("transfer_deadline_s", "idle_timeout_s", "handshake_timeout_s"):
            _check(getattr(self, name) > 0, p, f"receiver.{name}: must be > 0")
        _check(
            self.transfer_max_s >= self.transfer_deadline_s,
            p,
            "receiver.transfer_max_s: must be >= receiver.transfer_deadline_s",
        )
        _check(self.completed_memory >= 16, p, "receiver.completed_memory: must be >= 16")
        _check(self.rcvbuf_bytes >= 0, p, "receiver.rcvbuf_bytes: must be >= 0 (0 = kernel)")


DATA_THREADS = ("auto", "on", "off")
MAX_DATA_WORKERS = 64
# "auto" starts data worker processes from this many usable cores, one per this many cores,
# at most AUTO_DATA_WORKERS_MAX. Below it there is no spare core for a worker: on 2 cores,
# workers forced on cost plain TCP 16.9 -> 11.5 Gbit/s and sealed records 14.1 -> 7.9
# (bench/README.md). The sender and receiver of one host pair each take their share.
DATA_WORKERS_MIN_CORES = 8
CORES_PER_DATA_WORKER = 4
AUTO_DATA_WORKERS_MAX = 16
# "auto" turns data threads on from this many cores. A daemon's event loop is one thread; the
# payload copies and hashes it hands to threads only run faster where there are spare cores
# for them. On 2 cores the sender, the receiver and the kernel's softirqs already share both,
# and the thread hand-offs are pure cost there (bench/README.md, "data threads").
DATA_THREADS_MIN_CORES = 4


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (taskset, cpusets), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class DataThreads:
    """Which connections of a daemon move chunk payloads in data threads, by record layer
    (TLS records never do: their record layer stays on the event loop)."""

    plain: bool  # plain TCP
    sealed: bool  # sealed records

    def any(self) -> bool:
        return self.plain or self.sealed


def data_threads_for(setting: str, cores: int | None = None) -> DataThreads:
    """What ``data_threads = setting`` means here. ``auto``: plain TCP from
    DATA_THREADS_MIN_CORES cores, sealed records never. Threads made sealed records slower on
    every machine measured: 16 cores, 12.5 -> 10.3 Gbit/s (AES-GCM) and 12.3 -> 9.5
    (AEGIS-128L) at 1.7x the CPU, while plain TCP went 15.8 -> 28.4; on 2 cores both lose
    (bench/README.md, "On 16 cores, sealed records in data threads lose"). ``on`` forces both."""
    if setting == "auto":
        n = cores if cores is not None else usable_cores()
        return DataThreads(plain=n >= DATA_THREADS_MIN_CORES, sealed=False)
    return DataThreads(plain=setting == "on", sealed=setting == "on")


def data_workers_for(setting: int | str, cores: int | None = None) -> int:
    """How many data worker processes ``data_workers = setting`` starts here. A count is
    taken as given; ``auto`` is none below DATA_WORKERS_MIN_CORES usable cores (a worker only
    pays where it has a core of its own: on 2 cores forced workers lost a third of plain TCP's
    goodput and half of sealed records'), then one per CORES_PER_DATA_WORKER cores, leaving the
    rest to the daemon's event loop, the peer daemon on the same host and the kernel's
    softirqs, up to AUTO_DATA_WORKERS_MAX."""
    if setting != "auto":
        return int(setting)
    n = cores if cores is not None else usable_cores()
    if n < DATA_WORKERS_MIN_CORES:
        return 0
    return min(AUTO_DATA_WORKERS_MAX, n // CORES_PER_DATA_WORKER)


def _check_data_workers(value: int | str, p: list[str], section: str) -> None:
    _check(
        value == "auto" or (isinstance(value, int) and 0 <= value <= MAX_DATA_WORKERS),
        p,
        f"{section}.data_workers: {str(value)[:40]!r} is not 0..{MAX_DATA_WORKERS} worker"
        " processes (0 = none) or auto",
    )


def _check_data_threads(value: str, p: list[str], section: str) -> None:
    _check(
        value in DATA_THREADS,
        p,
        f"{section}.data_threads: {value[:40]!r} is not one of {', '.join(DATA_THREADS)}",
    )


TLS_MODES = ("mutual", "off")
TLS_FILES = ("ca_file", "cert_file", "key_file")
TLS_RECORD_LAYERS = ("sealed", "tls")
TLS_RECORD_CIPHERS = ("auto", "aegis-128l", "aes-128-gcm")


@dataclass
class TlsConfig:
    """Mutual TLS on the data connections between datacenters.

    The default is "mutual" so that a link runs in the clear only because its config says
    ``mode = "off"`` (e.g. both ends inside one datacenter), never because a file was missing.
    """

    mode: str = "mutual"
    ca_file: str = ""  # the deployment's CA: peers must chain to it
    cert_file: str = ""  # this daemon's certificate (chain), PEM
    key_file: str = ""  # its private key, PEM
    # Identities (SAN DNS names or CN) a peer certificate must carry one of; empty = any
    # certificate issued by the CA.
    allowed_peers: tuple[str, ...] = ()
    # The name the sender expects in the receiver's certificate ("" = the peer's host).
    server_name: str = ""
    # The data phase after the handshake: "sealed" = AES-GCM records of up to 1 MiB keyed
    # through the TLS connection (xdc.protocol.aead_records; both ends must say so, via ALPN),
    # "tls" = TLS 1.3's own 16 KiB records (about half the goodput on one core per GB).
    record_layer: str = "sealed"
    # The sealed records' cipher: "auto" = AEGIS-128L where both ends have it (PyNaCl 1.6+;
    # faster a core, and sealing in data threads uses several cores), else AES-128-GCM;
    # "aes-128-gcm" = only AES-GCM (e.g. where policy requires a NIST cipher); "aegis-128l" =
    # only AEGIS-128L (a peer without it gets TLS records).
    record_cipher: str = "auto"

    def allowed(self) -> frozenset[str]:
        return frozenset(entries(self.allowed_peers))

    def validate(self, p: list[str]) -> None:
        _check(
            self.mode in TLS_MODES,
            p,
            f"tls.mode: {self.mode!r} is not one of {', '.join(TLS_MODES)}",
        )
        _check(
            self.record_layer in TLS_RECORD_LAYERS,
            p,
            f"tls.record_layer: {self.record_layer!r} is not one of {', '.join(TLS_RECORD_LAYERS)}",
        )
        _check(
            self.record_cipher in TLS_RECORD_CIPHERS,
            p,
            f"tls.record_cipher: {self.record_cipher[:40]!r} is not one of "
            f"{', '.join(TLS_RECORD_CIPHERS)}",
        )
        if self.record_cipher == "aegis-128l" and not aead_aegis.available():
            p.append(f"tls.record_cipher: aegis-128l: {aead_aegis.unavailable_reason()}")
        if self.mode != "mutual":
            return
        # A config that names some TLS files but not all is a mistake in any process. One
        # that names none is fine for processes without data links (router, planner); the
        # daemons call ready_problems() and refuse to start.
        if any(getattr(self, f) for f in TLS_FILES):
            p.extend(self.ready_problems())

    def ready_problems(self) -> list[str]:
        """What keeps a daemon from running this TLS config, one problem per field."""
        if self.mode != "mutual":
            return []
        out: list[str] = []
        for name in TLS_FILES:
            path = getattr(self, name)
            if not path:
                out.append(
                    f'tls.{name}: required when tls.mode = "mutual" '
                    '(set tls.mode = "off" only for a link that stays inside one datacenter)'
                )
            elif not os.path.isfile(path):
                out.append(f"tls.{name}: {path}: no such file")
            elif not os.access(path, os.R_OK):
                out.append(f"tls.{name}: {path}: not readable")
        return out


@dataclass
class MonitorConfig:
    """Congestion monitor sampling and link-state thresholds."""

    sample_hz: float = 10.0
    link_capacity_bps: float = 0.0
    retrans_warn: float = 0.002
    retrans_congested: float = 0.01
    rtt_inflation_warn: float = 1.5
    rtt_inflation_congested: float = 2.0  # 20 ms of queue on a short path (10 ms floor)
    ecn_warn: float = 0.001
    ecn_congested: float = 0.01
    router_url: str = ""
    router_token: str = ""

    def validate(self, p: list[str]) -> None:
        _check(0 < self.sample_hz <= 1000, p, "monitor.sample_hz: 0 < hz <= 1000")
        _check(self.link_capacity_bps >= 0, p, "monitor.link_capacity_bps: must be >= 0")
        _check(
            0 <= self.retrans_warn <= self.retrans_congested <= 1,
            p,
            "monitor.retrans_warn/retrans_congested: need 0 <= warn <= congested <= 1",
        )
        _check(
            1 <= self.rtt_inflation_warn <= self.rtt_inflation_congested,
            p,
            "monitor.rtt_inflation_warn/congested: need 1 <= warn <= congested",
        )
        _check(
            0 < self.ecn_warn <= self.ecn_congested <= 1,
            p,
            "monitor.ecn_warn/ecn_congested: need 0 < warn <= congested <= 1",
        )


@dataclass
class RouterConfig:
    """The gateway-facing scheduler service."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    profile: str = ""
    gateway_token: str = ""
    daemon_token: str = ""
    block_size: int = 512
    max_body_bytes: int = 1024 * 1024
    cache_capacity_blocks: int = 1_000_000
    replan_interval_s: float = 300.0
    ttft_slo_s: float = 10.0
    # an offload whose predicted TTFT is no better than keeping the request in PD-P stays
    # local (off: the paper's rule, offload above t whatever the TTFT)
    keep_local_when_faster: bool = False
    util_scarce: float = 0.8
    util_clear: float = 0.6
    link_stale_s: float = 5.0
    # a link reported on before and silent this long is dark: nothing is offloaded over it
    link_dark_s: float = 2.0
    # a link or decode node taken out by the gateway's failure reports stays out this long
    outage_hold_s: float = 10.0
    queue_scarce_s: float = 8.0
    queue_clear_s: float = 2.0
    replan_capacity_change: float = 0.25
    replan_min_interval_s: float = 10.0
    # "auto" (uvloop when installed), "uvloop" or "asyncio"
    event_loop: str = "auto"
    # "memory" (one router) or "redis" (replicas sharing link, node and cache state)
    shared_state: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_namespace: str = "xdc"
    # this replica's name in Redis ("" = host:node.id:pid)
    replica_id: str = ""
    redis_timeout_s: float = 1.0
    redis_leader_lease_s: float = 3.0
    redis_cache_log: int = 1_000_000
    # vLLM instances whose KV events (ZMQ) feed the prefix index: "cluster/node=tcp://host:port"
    # entries (append "|tcp://host:replay_port" for the replay socket)
    vllm_kv_events: tuple[str, ...] = ()
    # how those engines hash blocks (their prefix_caching_hash_algo and PYTHONHASHSEED;
    # "" = vLLM's fixed default seed); their block size must equal router.block_size
    vllm_hash_algo: str = "sha256"
    vllm_hash_seed: str = ""
    # the KV cache group whose blocks count (a hybrid model's full-attention group)
    vllm_kv_group: int = 0
    # vLLM instances whose /metrics give node load: "cluster/node@prefill|decode=http://host:port/metrics"
    # entries
    vllm_metrics: tuple[str, ...] = ()
    vllm_metrics_interval_s: float = 1.0

    def validate(self, p: list[str]) -> None:
        _check(0 <= self.listen_port <= 65535, p, "router.listen_port: 0..65535")
        if self.vllm_kv_events:
            for check in (
                lambda: parse_endpoints(self.vllm_kv_events),
                lambda: check_vllm_hash(self.vllm_hash_algo, self.vllm_hash_seed),
            ):
                try:
                    check()
                except ValueError as e:
                    p.append(str(e) if str(e).startswith("router.") else f"router.{e}")
        _check(0 <= self.vllm_kv_group < 1024, p, "router.vllm_kv_group: 0..1023")
        if self.vllm_metrics:
            try:
                parse_targets(self.vllm_metrics)
            except ValueError as e:
                p.append(str(e))
        _check(
            0.05 <= self.vllm_metrics_interval_s <= 3600,
            p,
            "router.vllm_metrics_interval_s: 0.05..3600",
        )
        _check(
            self.event_loop in ("auto", "uvloop", "asyncio"),
            p,
            f"router.event_loop: {self.event_loop!r} is not one of auto, uvloop, asyncio",
        )
        _check(
            self.shared_state in ("memory", "redis"),
            p,
            f"router.shared_state: {self.shared_state!r} is not one of memory, redis",
        )
        if self.shared_state == "redis":
            _check(
                self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                p,
                "router.redis_url: expected redis://host:port/db, rediss://... or unix://path",
            )
        _check(
            bool(CLUSTER_NAME.match(self.redis_namespace)),
            p,
            "router.redis_namespace: letters, digits, '.', '_' or '-' (1..64)",
        )
        _check(len(self.replica_id) <= 128, p, "router.replica_id: at most 128 characters")
        _check(0 < self.redis_timeout_s <= 60, p, "router.redis_timeout_s: 0 < s <= 60")
        _check(
            self.redis_leader_lease_s >= 3 * self.redis_timeout_s,
            p,
            "router.redis_leader_lease_s: must be >= 3 x redis_timeout_s",
        )
        _check(self.redis_cache_log >= 1000, p, "router.redis_cache_log: must be >= 1000")
        _check(1 <= self.block_size <= 1 << 20, p, "router.block_size: 1..1048576")
        _check(self.max_body_bytes >= 1024, p, "router.max_body_bytes: must be >= 1024")
        _check(self.cache_capacity_blocks >= 1, p, "router.cache_capacity_blocks: must be >= 1")
        _check(self.replan_interval_s > 0, p, "router.replan_interval_s: must be > 0")
        _check(self.ttft_slo_s > 0, p, "router.ttft_slo_s: must be > 0")
        _check(0 < self.util_scarce <= 1, p, "router.util_scarce: 0 < u <= 1")
        _check(
            0 <= self.util_clear < self.util_scarce,
            p,
            "router.util_clear: need 0 <= util_clear < util_scarce",
        )
        _check(self.link_stale_s > 0, p, "router.link_stale_s: must be > 0")
        _check(0 < self.link_dark_s <= 3600, p, "router.link_dark_s: 0 < seconds <= 3600")
        _check(0 < self.outage_hold_s <= 3600, p, "router.outage_hold_s: 0 < seconds <= 3600")
        _check(
            0 <= self.queue_clear_s < self.queue_scarce_s,
            p,
            "router.queue_clear_s/queue_scarce_s: need 0 <= queue_clear_s < queue_scarce_s",
        )
        _check(self.replan_capacity_change > 0, p, "router.replan_capacity_change: must be > 0")
        _check(self.replan_min_interval_s >= 0, p, "router.replan_min_interval_s: must be >= 0")


@dataclass
class GatewayConfig:
    """The OpenAI-compatible front door (``xdc gateway``): asks the router, drives the engines."""

    # address and port clients connect to (0 = any port; the URL is printed on stdout)
    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    # also serve on this unix socket path ("" = no): for a local proxy, or a client outside
    # the gateway's network namespace
    listen_unix: str = ""
    # the router's base URL ("" = no router: every request takes the static fallback)
    router_url: str = ""
    # bearer token for the router's /v1/route (= router.gateway_token); a secret
    router_token: str = ""
    # the longest a route call may take before the static fallback is used
    router_timeout_s: float = 0.5
    # bearer tokens clients must send (none = no client auth; warned at start)
    client_tokens: tuple[str, ...] = ()
    # the model id clients name and the engines serve (their --served-model-name)
    model: str = "xdc-test"
    # router node name -> engine base URL, "name=http://host:port" entries; several names may
    # share one URL (one PD instance that both prefills and decodes)
    nodes: tuple[str, ...] = ()
    # decode node name -> its xdc receiver's data address as the PrfaaS senders reach it,
    # "name=host:port" entries: a remote prefill ships the KV to the receiver of the decode
    # node the router chose (unlisted: the sender's own peer)
    receivers: tuple[str, ...] = ()
    # node names used when the router is down or unset: prefill there, decode there (the same
    # URL = one local instance does both)
    fallback_prefill: str = ""
    fallback_decode: str = ""
    # a remote prefill must answer within this; past it (or on any error) the decode instance
    # prefills itself. The decode waits as long for the transfer to begin (xdc_arrival_s):
    # a prefill queued at a busy PrfaaS cluster begins late
    prefill_timeout_s: float = 30.0
    # what the decode instance waits for a transfer in all (its connector's xdc_timeout_s)
    kv_timeout_s: float = 60.0
    # the longest a whole request may take at the engine
    request_timeout_s: float = 600.0
    # largest client body accepted
    max_body_bytes: int = 4 * 1024 * 1024
    # a client connection that has not sent a whole request head this long after it opened
    # (or after its last answer) is closed: a client that trickles its headers (slowloris)
    # cannot hold a descriptor for aiohttp's default of an hour
    idle_timeout_s: float = 75.0
    # the longest a client may take to send its body once the headers are in (then 408)
    body_timeout_s: float = 30.0
    # largest max_tokens a client may ask for
    max_tokens_limit: int = 4096
    # default max_tokens when a completion request gives none (OpenAI's default is 16)
    default_max_tokens: int = 16

    def validate(self, p: list[str]) -> None:
        _check(0 <= self.listen_port <= 65535, p, "gateway.listen_port: 0..65535")
        _check(len(self.listen_unix) < 100, p, "gateway.listen_unix: at most 99 characters")
        if self.router_url:
            _check(
                self.router_url.startswith(("http://", "https://")),
                p,
                "gateway.router_url: expected http://host:port or https://host:port",
            )
        for name in (
            "router_timeout_s",
            "prefill_timeout_s",
            "kv_timeout_s",
            "idle_timeout_s",
            "body_timeout_s",
        ):
            v = getattr(self, name)
            _check(0 < v <= 3600, p, f"gateway.{name}: 0 < s <= 3600")
        _check(0 < self.request_timeout_s <= 86400, p, "gateway.request_timeout_s: 0 < s <= 86400")
        _check(self.max_body_bytes >= 1024, p, "gateway.max_body_bytes: must be >= 1024")
        _check(1 <= self.max_tokens_limit <= 1 << 20, p, "gateway.max_tokens_limit: 1..1048576")
        _check(
            1 <= self.default_max_tokens <= self.max_tokens_limit,
            p,
            "gateway.default_max_tokens: 1..max_tokens_limit",
        )
        _check(bool(self.model) and len(self.model) <= 256, p, "gateway.model: 1..256 chars")
        try:
            nodes = parse_nodes(self.nodes)
            receivers = parse_receivers(self.receivers)
        except ValueError as e:
            p.append(str(e))
            return
        for name in receivers:
            if nodes and name not in nodes:
                p.append(f"gateway.receivers: node {name!r} is not in gateway.nodes")
        for name in ("fallback_prefill", "fallback_decode"):
            v = getattr(self, name)
            if v and v not in nodes:
                p.append(f"gateway.{name}: {v!r} is not in gateway.nodes")


@dataclass
class RdmaConfig:
    """RDMA inside one datacenter (PD-P to PD-D); off by default, TCP is always the fallback.

    Every default leaves RDMA off, so a config without an ``[rdma]`` section behaves exactly
    like a TCP-only daemon.
    """

    enabled: bool = False
    # Peers that declare the same non-empty domain share an RDMA fabric (one PD cluster).
    domain: str = ""
    # Device to open ("" = the first usable one in /sys/class/infiniband).
    device: str = ""
    port: int = 1
    # RoCE needs a GID; index 1 is usually the RoCEv2 IPv4-mapped entry on rxe/mlx5.
    gid_index: int = 1
    # Checksum every Nth chunk (1 = every chunk, 0 = none): RC has link-level CRCs, so a
    # sample is enough to catch a buggy peer or a bad buffer mapping at a fraction of the CPU.
    verify_every: int = 16
    # Work requests in flight per queue pair; bounds the send queue and the pinned staging.
    max_inflight: int = 64
    # Receive work requests kept posted (each WRITE_WITH_IMM consumes one).
    recv_depth: int = 256
    # How long a blocked completion wait may sleep before it re-checks for cancellation.
    poll_timeout_s: float = 0.05
    # An RC connection with nothing completing for this long is declared dead (-> TCP).
    stall_timeout_s: float = 5.0
    # After the RDMA link failed (and the peer went on over TCP), offer RDMA again after this
    # long, doubling per failure up to 10 minutes (0 = never again for that receiver session).
    reoffer_s: float = 30.0

    def validate(self, p: list[str]) -> None:
        _check(self.verify_every >= 0, p, "rdma.verify_every: must be >= 0 (0 = never)")
        _check(
            self.max_inflight >= 2,
            p,
            "rdma.max_inflight: must be >= 2 (a sampled chunk posts its checksum and its data)",
        )
        _check(self.recv_depth >= 1, p, "rdma.recv_depth: must be >= 1")
        _check(1 <= self.port <= 255, p, "rdma.port: 1..255")
        _check(0 <= self.gid_index <= 255, p, "rdma.gid_index: 0..255")
        _check(self.poll_timeout_s > 0, p, "rdma.poll_timeout_s: must be > 0")
        _check(self.stall_timeout_s > 0, p, "rdma.stall_timeout_s: must be > 0")
        _check(self.reoffer_s >= 0, p, "rdma.reoffer_s: must be >= 0 (0 = never re-offer)")
        _check(
            not self.enabled or bool(self.domain),
            p,
            "rdma.domain: required when rdma.enabled = true (peers in the same domain use RDMA)",
        )


@dataclass
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    sender: SenderConfig = field(default_factory=SenderConfig)
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def validate(self) -> None:
        problems: list[str] = []
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(problems)
        if problems:
            raise ConfigError(problems)


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _coerce(value: Any, typ: Any, where: str, problems: list[str]) -> Any:
    """Turn a TOML/env/flag value into the field's type, or record why it cannot be."""
    origin = typing.get_origin(typ)
    if origin in (types.UnionType, typing.Union):
        choices = [t for t in typing.get_args(typ) if t is not type(None)]
        if len(choices) > 1:
            # a setting that is a count or a word (``data_workers = 4`` or ``"auto"``): the
            # first type the value converts to, so "4" from an env var is the count 4
            for choice in choices:
                tried: list[str] = []
                got = _coerce(value, choice, where, tried)
                if not tried:
                    return got
            names = " or ".join(getattr(t, "__name__", str(t)) for t in choices)
            problems.append(f"{where}: expected {names}, got {value!r:.100}")
            return None
        typ = choices[0]
    if typing.get_origin(typ) is tuple:
        # a list setting: a TOML array, or the same entries comma-separated (env, --set)
        item = typing.get_args(typ)[0]
        if isinstance(value, str):
            value = entries(value)
        if not isinstance(value, list | tuple):
            problems.append(f"{where}: expected a list, got {value!r:.100}")
            return None
        before = len(problems)
        items = [
            _coerce(v.strip() if isinstance(v, str) else v, item, where, problems) for v in value
        ]
        return tuple(items) if len(problems) == before else None
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in BOOL_WORDS:
                return BOOL_WORDS[value.lower()]
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        pass
    name = getattr(typ, "__name__", str(typ))
    problems.append(f"{where}: expected {name}, got {value!r}")
    return None


def _apply(cfg: Config, section: str, key: str, value: Any, source: str, p: list[str]) -> None:
    where = f"{section}.{key}"
    sect = getattr(cfg, section, None) if section in _sections() else None
    if sect is None:
        known = ", ".join(_sections())
        p.append(f"{where} ({source}): unknown section {section!r}; known: {known}")
        return
    types_ = _field_types(type(sect))
    if key not in types_:
        p.append(f"{where} ({source}): unknown field; known: {', '.join(sorted(types_))}")
        return
    coerced = _coerce(value, types_[key], f"{where} ({source})", p)
    if coerced is not None:
        setattr(sect, key, coerced)


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build and validate the Config; raise ConfigError listing every problem."""
    cfg = Config()
    problems: list[str] = []
    if path is not None:
        try:
            data = tomllib.loads(read_text_file(path, MAX_CONFIG_BYTES))
        except UnreadableFile as e:
            raise ConfigError([f"config file {path}: {e}"]) from None
        except ValueError as e:  # TOMLDecodeError, or an integer of over 4300 digits
            raise ConfigError([f"config file {path}: not valid TOML: {e}"]) from None
        for section, body in data.items():
            if not isinstance(body, dict):
                problems.append(f"{section} (file {path}): expected a [section] table")
                continue
            for key, value in body.items():
                _apply(cfg, section, key, value, f"file {path}", problems)
    env = os.environ if env is None else env
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].partition("__")
        _apply(cfg, section.lower(), key.lower(), value, f"env {name}", problems)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        _apply(cfg, section, key, value, "flag", problems)
    # Range checks run even when some values did not parse (those keep their defaults), so
    # one run reports every problem in the file.
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).validate(problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_set_flags(items: list[str]) -> dict[str, str]:
    """Parse repeated ``--set section.field=value`` flags."""
    out: dict[str, str] = {}
    bad = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            bad.append(f"--set {item!r}: expected section.field=value")
            continue
        out[key.strip()] = value
    if bad:
        raise ConfigError(bad)
    return out


def to_toml(cfg: Config) -> str:
    """Render a config (e.g. for `xdc demo` child daemons)."""
    lines: list[str] = []
    for f in dataclasses.fields(cfg):
        lines.append(f"[{f.name}]")
        for key, value in dataclasses.asdict(getattr(cfg, f.name)).items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: object) -> str:
    """A TOML literal for a config value (bool, int, float, str, or a tuple of them: an
    array). The one renderer: config files written by ``to_toml`` and the examples."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON escapes are TOML basic-string escapes, except that TOML wants no surrogate
        # pairs (hence ensure_ascii=False) and no raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML rendering for {type(value).__name__}")
