"""`xdc config example [--role R]`: print a fully commented TOML config.

The example is generated from the config dataclasses themselves (field names, types and
defaults), so it can never list a field that does not exist or a stale default. Only the prose
lives here, in ``DOCS``; a field without prose there falls back to the comment written above it
in ``xdc/config.py``, and ``undocumented()`` (checked by a test) lists fields that have neither,
so a new config field cannot ship without documentation.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize

from xdc.config import Config, toml_value

# Sections a role uses beyond the shared ones. A section listed under no role (node, tls, and
# any section added later) is shared by every role, so a new section shows up in every example
# instead of silently in none.
ROLE_SECTIONS: dict[str, frozenset[str]] = {
    "sender": frozenset({"limits", "sender", "monitor", "tls", "rdma"}),
    "receiver": frozenset({"limits", "receiver", "tls", "rdma"}),
    "router": frozenset({"router"}),
    "gateway": frozenset({"gateway"}),
}
ROLES = (*ROLE_SECTIONS, "all")
_WIDTH = 96

DOCS: dict[str, str] = {
    # [node]
    "node.id": "Name of this process. Sent in the wire handshake and put on every log line "
    "(the `node` key of JSON logs); make it unique per host, e.g. the hostname.",
    "node.datacenter": "Datacenter this process runs in. Informational only: no code reads it "
    "yet (label metrics by datacenter in the Prometheus scrape config instead).",
    "node.cluster": "Cluster this process belongs to, as the router's profile names it "
    "(`[[cluster.prfaas]] name`, or `prfaas` / `pd` for one PrfaaS cluster). A sender's link "
    "reports name their link node.cluster -> sender.peer_cluster.",
    "node.log_level": "One of debug, info, warning, error. `debug` adds a line per accepted "
    "request on the receiver.",
    "node.log_json": "true: one JSON object per log line (ts, level, logger, node, msg) for log "
    "pipelines; grep a request id across router, sender and receiver logs.",
    "node.allowed_uids": "Extra numeric uids allowed on the engine control "
    "sockets besides the daemon's own uid and root, for engines running as another user.",
    "node.shutdown_drain_s": "On SIGTERM the daemon stops accepting and gives in-flight "
    "transfers this long to finish before failing them (a receiver also gives connected decode "
    "engines this long to take and release complete requests); systemd's TimeoutStopSec must "
    "exceed it.",
    # [limits]
    "limits.max_header_bytes": "Largest frame header either peer accepts (256..65535). Both "
    "peers enforce their own limits on every frame.",
    "limits.max_chunk_bytes": "Largest data chunk accepted on the wire; must be >= the "
    "sender's sender.chunk_bytes.",
    "limits.max_layers": "Most layers one request may declare.",
    "limits.max_request_bytes": "Largest total KV size one request may declare.",
    "limits.max_concurrent_transfers": "Requests in flight at once per daemon; more are refused.",
    "limits.max_block_hashes": "Most prefix block hashes one request may carry.",
    # [sender]
    "sender.peer_host": "Receiver (PD cluster) address the data connections dial.",
    "sender.peer_cluster": "Cluster of the receiver (the PD cluster, `pd` by default): with "
    "node.cluster it names the link this sender reports on to the router.",
    "sender.peer_port": "Receiver data port (receiver.listen_port on the other side).",
    "sender.peer_extra_addresses": "Extra 'host:port,host:port' paths to the same receiver "
    "(more NICs or IPs); the connections are spread round-robin over peer_host:peer_port and "
    "these.",
    "sender.allowed_peers": "Other receivers (decode nodes) a request may name, as entries "
    "'host:port' or 'host:port=tls-name' (the name its certificate must carry under mutual "
    "TLS; default its host). peer_host:peer_port is always allowed; any other address is "
    "refused.",
    "sender.connections": "Parallel TCP connections per receiver. One TCP flow rarely fills a "
    "long fat pipe; 8-16 is typical for 25-100 Gbit/s at tens of ms RTT.",
    "sender.chunk_bytes": "Payload bytes per chunk; the unit of checksumming, acking and resend.",
    "sender.pool_bytes": "Shared-memory send pool the prefill engine writes layers into; bounds "
    "KV bytes held in flight.",
    "sender.control_socket": "Unix socket the prefill engine connects to. Under systemd use "
    "/run/xdc/... (RuntimeDirectory=xdc).",
    "sender.status_port": "HTTP port on status_host for /status, /metrics, /healthz (0 = off). "
    "Prometheus scrapes /metrics here.",
    "sender.status_host": "Address the status endpoint binds. The default 127.0.0.1 needs a "
    "node-local scraper; a management-network address lets a central Prometheus scrape it.",
    "sender.transfer_deadline_s": "A request fails cleanly (its shm is freed and the engine told "
    "why) when this long passes with neither its engine handing new bytes over nor the "
    "receiver acknowledging any, so a long prefill streams for as long as it runs. The "
    "connector's deadline_s / xdc_deadline_s asks for another.",
    "sender.transfer_max_s": "A request not delivered this long after BEGIN fails however it "
    "progresses (bounds an engine that hands bytes over one at a time).",
    "sender.idle_timeout_s": "A data connection silent this long is presumed dead and redialled.",
    "sender.connect_timeout_s": "Give up one connection attempt after this long.",
    "sender.reconnect_backoff_s": "Wait between reconnection attempts.",
    "sender.sndbuf_bytes": "SO_SNDBUF of data sockets (0 = kernel autotuning, usually best).",
    "sender.notsent_lowat_bytes": "Unsent bytes a connection may hold before it stops taking "
    "chunks (TCP_NOTSENT_LOWAT; 0 = kernel default). Bounds what a slow connection holds; "
    "each writer wake-up moves about half of it, so below a chunk it costs CPU.",
    "sender.pacing_rate_bps": "Static pacing cap for the whole link, bits/s (0 = none).",
    "sender.congestion_control": "Pace the connections (SO_MAX_PACING_RATE) so they do not "
    "build a standing queue at the bottleneck: cut when the RTT over its floor passes 8 ms or "
    "ECN marks come back, probe up below 4 ms; never for loss without a queue.",
    "sender.tcp_congestion": "TCP congestion control algorithm for data sockets, e.g. 'bbr' "
    "('' = the host default).",
    "sender.data_threads": "Hash, seal and write chunk payloads in a worker thread per "
    "connection (plain TCP and sealed records; TLS records stay on the event loop): auto, on "
    "or off. auto = plain TCP from 4 cores, sealed records never. The event loop is one "
    "thread; on 16 cores threads took plain TCP on loopback from 15.5 to 34.5 Gbit/s, for ~20% "
    "more CPU per GB, and sealed records from 12.5 down to 10.3 (on = threads for both); "
    "on 2 cores they only cost.",
    "sender.data_workers": "Worker processes that frame, checksum, seal and write chunk "
    "payloads, each lent a share of the connections (plain TCP and sealed records): a count "
    "(0 = none) or auto. auto = none below 8 usable cores, then one per 4 cores, at most 16. "
    "Their GIL is not the event loop's: on many cores sealed records in data threads lost to "
    "the hand-overs of the one GIL; on 2 cores forced workers cost a third of plain TCP's "
    "goodput. Experimental: measured on 2 cores only (docs/data_workers.md).",
    "sender.send_batch_chunks": "With data threads: queued chunks a connection sends in one "
    "hand-off to its thread (only those no idle connection would take; 1 = one a hand-off). "
    "Each hand-off is a thread round trip (~0.1 ms) and GIL time on the event loop.",
    # [receiver]
    "receiver.listen_host": "Address the data listener binds: the PD node's WAN-facing IP.",
    "receiver.listen_port": "Data port the PrfaaS senders dial.",
    "receiver.pool_bytes": "Shared-memory receive pool the decode engine reads from. Senders "
    "are back-pressured when it is full; a request larger than the pool is refused.",
    "receiver.control_socket": "Unix socket the decode engine connects to. Under systemd use "
    "/run/xdc/... (RuntimeDirectory=xdc).",
    "receiver.status_port": "HTTP port on status_host for /status, /metrics, /healthz (0 = off).",
    "receiver.status_host": "Address the status endpoint binds. The default 127.0.0.1 needs a "
    "node-local scraper; a management-network address lets a central Prometheus scrape it.",
    "receiver.transfer_deadline_s": "A request fails and its pool space is freed when this long "
    "(or its sender's shorter deadline) passes with no chunk of it verified and no word from "
    "its sender, which says KEEP at least every second while it holds the request (so keep it "
    "above 2 s).",
    "receiver.transfer_max_s": "A request not complete this long after BEGIN fails however it "
    "progresses (bounds a sender that drips bytes to hold pool space).",
    "receiver.idle_timeout_s": "A data connection silent this long is closed.",
    "receiver.handshake_timeout_s": "A new connection must finish the handshake within this.",
    "receiver.completed_memory": "How many completed request ids are remembered, so late or "
    "duplicate chunks are recognised and dropped.",
    "receiver.rcvbuf_bytes": "SO_RCVBUF of data sockets (0 = kernel autotuning).",
    "receiver.data_threads": "Read, open and verify chunk payloads in a worker thread per "
    "connection (plain TCP and sealed records): auto, on or off. auto = plain TCP from 4 "
    "cores, sealed records never (see sender.data_threads).",
    "receiver.data_workers": "Worker processes that receive, open and verify chunk payloads "
    "in place, each lent a share of the connections: a count (0 = none) or auto (see "
    "sender.data_workers).",
    "receiver.worker_runs": "With data workers (plain TCP or sealed records): each worker "
    "reads its connections' frames and lands the chunks a sender sends for the first time "
    "on its own, reporting them in batches, instead of one round trip through the daemon per chunk "
    "(resends still go through the daemon).",
    "receiver.max_connections": "Data connections held at once; more are closed at accept "
    "(each costs a socket and a read buffer). The descriptor limit may lower it: an eighth of "
    "that limit (at least 16) is kept for engines.",
    "receiver.scratch_buffers": "Chunk-sized buffers lent at once, across all connections, to "
    "resends racing the original copy of a chunk; more are declined with a NACK and resent.",
    "receiver.orphan_grace_s": "A sender session with no connection left keeps its partial "
    "requests this long; a restarted sender retrying the same id replaces them at once.",
    "receiver.unclaimed_ttl_s": "A complete request that no decode engine claims is freed "
    "after this long (logged and counted).",
    # [tls]
    "tls.mode": '"mutual" (both ends present certificates from the deployment CA) or "off" '
    "(plain TCP; only for a link that stays inside one datacenter).",
    "tls.ca_file": "PEM CA certificate of the deployment; the peer's certificate must chain to it.",
    "tls.cert_file": "PEM certificate (chain) this daemon presents.",
    "tls.key_file": "PEM private key of cert_file; readable by the daemon's user only.",
    "tls.allowed_peers": "Comma-separated identities (SAN DNS name or CN) a peer certificate "
    "must carry one of ('' = any certificate issued by the CA).",
    "tls.server_name": "Name the sender expects in the receiver's certificate ('' = the peer "
    "host as dialled).",
    "tls.record_layer": '"sealed" (after the handshake, AEAD records of up to 1 MiB keyed '
    'through TLS: ~0.75x plain TCP on loopback) or "tls" (TLS 1.3\'s 16 KiB records: ~0.47x). '
    "Sealed is used only when both ends say so (ALPN); otherwise TLS records.",
    "tls.record_cipher": '"auto" (AEGIS-128L where both ends have it: faster a core, and '
    'sealing in data threads uses several cores; else AES-128-GCM), "aes-128-gcm" (only '
    'AES-GCM, e.g. where policy requires a NIST cipher) or "aegis-128l" (only AEGIS; a peer '
    "without it gets TLS records).",
    # [rdma]
    "rdma.enabled": "Offer/accept RDMA (pyverbs, RC queue pairs) to peers of the same domain; "
    "needs the `rdma` extra (pyverbs) and a usable device. Anything missing -> TCP, logged once.",
    "rdma.domain": "RDMA fabric this node is on (e.g. the PD cluster's name). Two peers use RDMA "
    "only when both declare the same non-empty domain; cross-datacenter links never should.",
    "rdma.device": "Verbs device to open, e.g. mlx5_0 or rxe0 ('' = the first with an ACTIVE "
    "port in /sys/class/infiniband).",
    "rdma.port": "Port number of that device (1-based).",
    "rdma.gid_index": "GID table index; on RoCEv2 (rxe, mlx5) usually 1 = the IPv4-mapped entry "
    "(`show_gids` lists them).",
    "rdma.verify_every": "Checksum every Nth chunk that arrives by RDMA (1 = all, 0 = none; RC "
    "already has link-level CRCs). A failed sample is rewritten; repeated failures -> TCP.",
    "rdma.max_inflight": "RDMA WRITEs in flight per queue pair (send queue depth); >= 2, as a "
    "sampled chunk posts its checksum and its data.",
    "rdma.recv_depth": "Receives kept posted on the receiver; each WRITE_WITH_IMM consumes one.",
    "rdma.poll_timeout_s": "Longest a completion wait sleeps before re-checking for cancellation.",
    "rdma.reoffer_s": "After an RDMA link failure the peer runs on TCP; RDMA is offered again "
    "after this many seconds, doubling per failure up to 600 (0 = not until the receiver "
    "restarts).",
    "rdma.stall_timeout_s": "No completion for this long with writes in flight = the RDMA link "
    "is dead: the QPs are destroyed and unconfirmed chunks go over TCP.",
    # [monitor]
    "monitor.sample_hz": "tcp_info samples per second of the data sockets.",
    "monitor.link_capacity_bps": "Link capacity in bits/s used for utilisation (0 = estimate it "
    "from the p90 of measured goodput).",
    "monitor.retrans_warn": "Retransmitted/sent ratio above which loss is reported. Loss "
    "without a queue (RTT below rtt_inflation_warn) is random loss: state stays 'ok' with "
    "cause 'random_loss', the router shifts nothing and the sender does not slow down.",
    "monitor.retrans_congested": "Retransmitted/sent ratio that, with the RTT at or above "
    "rtt_inflation_warn (loss that comes with queueing), makes the link 'congested'.",
    "monitor.rtt_inflation_warn": "srtt/max(min_rtt, 10 ms) above which a queue is standing: "
    "'warn' (cause 'queue').",
    "monitor.rtt_inflation_congested": "srtt/max(min_rtt, 10 ms) above which the queue makes "
    "the link 'congested'.",
    "monitor.ecn_warn": "Share of delivered packets echoed Congestion Experienced (ECN marks "
    "from the bottleneck) above which the link is 'warn' (cause 'ecn').",
    "monitor.ecn_congested": "CE-marked share above which the link is 'congested'.",
    "monitor.router_url": "Router base URL the sender posts link state to, e.g. "
    "http://10.1.0.10:8080 ('' = do not publish).",
    "monitor.router_token": "Bearer token for router_url (= the router's daemon_token). A "
    "secret: set XDC_MONITOR__ROUTER_TOKEN in the unit's EnvironmentFile, not here.",
    # [gateway]
    "gateway.listen_port": "Port clients connect to (0 = any; the URL is printed on stdout).",
    "gateway.receivers": "Decode node name -> its xdc receiver's data address as the PrfaaS "
    "senders reach it, 'name=host:port' entries: a remote prefill ships the KV to the "
    "receiver of the decode node the router chose (the senders must list it in "
    "sender.allowed_peers).",
    "gateway.fallback_decode": "Node (in gateway.nodes) that decodes when the router cannot "
    "be asked; with gateway.fallback_prefill naming a node of the same URL, one local "
    "instance does both.",
    # [router]
    "router.listen_host": "Address the routing API (and its /metrics) binds.",
    "router.listen_port": "Routing API port (0 = any; the URL is printed on stdout).",
    "router.profile": "Deployment profile TOML (instance types, counts, link; see "
    "deploy/profiles/README.md).",
    "router.gateway_token": "Bearer token the gateway must send to /v1/route. A secret: set "
    "XDC_ROUTER__GATEWAY_TOKEN in the EnvironmentFile ('' = random per run).",
    "router.daemon_token": "Bearer token daemons and engines must send to /v1/links, "
    "/v1/cache/events and /v1/nodes. A secret: set XDC_ROUTER__DAEMON_TOKEN in the "
    "EnvironmentFile ('' = random per run).",
    "router.block_size": "Tokens per prefix-hash block; must match the engines' KV block size.",
    "router.max_body_bytes": "Largest request body the API accepts.",
    "router.cache_capacity_blocks": "(node, block) entries the prefix index holds before "
    "evicting the least recently used.",
    "router.replan_interval_s": "Seconds between long-term replans (threshold t and the PD "
    "prefill/decode split).",
    "router.ttft_slo_s": "Default TTFT SLO; a request no target can meet is answered 429.",
    "router.keep_local_when_faster": "Keep a request over t in PD-P when the profile predicts "
    "its TTFT there (queue + prefill) no worse than offloaded (queue + prefill + exposed "
    "transfer): for light load on engines of equal speed; off = the paper's rule.",
    "router.util_scarce": "PrfaaS egress utilisation at or above which bandwidth counts as "
    "scarce (each cluster judged on its own cache).",
    "router.util_clear": "Utilisation at or below which (link ok, PrfaaS queue clear) a raised "
    "threshold decays back to the planned one; between it and util_scarce t holds "
    "(hysteresis).",
    "router.link_stale_s": "Link state older than this counts as unknown: bandwidth is treated "
    "as scarce and t neither rises nor falls on link signals.",
    "router.link_dark_s": "A link reported on before and silent this long is dark: nothing is "
    "offloaded over it until its senders report again (they publish every second, so a killed "
    "sender or a cut link shows within this plus a second).",
    "router.outage_hold_s": "A link or decode node taken out by the gateway's failure reports "
    "(POST /v1/outcomes: sender_down, receiver_gone, repeated never_arrived...) stays out this "
    "long; a link out for its sender being down is back at its sender's next report.",
    "router.queue_scarce_s": "Mean predicted wait per PrfaaS prefill instance (seconds) that "
    "counts as a queue surge and raises t, but only while PD-P's predicted wait is shorter.",
    "router.queue_clear_s": "Mean PrfaaS wait per instance (seconds) at or below which the "
    "queue counts as clear, letting a raised t fall back.",
    "router.replan_capacity_change": "Relative change in the reported link capacity (0.25 = "
    "25%) since the last replan that triggers an early replan of t for the live bandwidth.",
    "router.replan_min_interval_s": "Capacity-triggered replans happen at most this often "
    "(seconds), so a flapping capacity estimate cannot keep the planner busy.",
    "router.event_loop": "`auto` runs the router on uvloop (a dependency of xdc) and falls back "
    "to asyncio's own loop if it cannot be imported; `uvloop` insists on it; `asyncio` never "
    "uses it. uvloop takes a large share of the event-loop and HTTP CPU per decision off.",
    "router.shared_state": "`memory`: one router keeps its state in process (the default). "
    "`redis`: several router replicas share link, node and cache state through Redis "
    "(router.redis_url; needs `pip install 'xdc[redis]'`); any replica answers the same, a "
    "killed one loses nothing, and one cut off from Redis keeps routing on its last state "
    "(/healthz says degraded) and catches up when Redis returns.",
    "router.redis_url": "Redis for router.shared_state = redis: redis://host:port/db, rediss:// "
    "for TLS, unix:///path.sock. Put the password in the URL (redis://:secret@host/0).",
    "router.redis_namespace": "Key prefix in Redis: the replicas of one deployment share it; "
    "two deployments on one Redis use two.",
    "router.replica_id": 'This replica\'s name in Redis ("" = host:node.id:pid); must be '
    "unique among the replicas.",
    "router.redis_timeout_s": "Bound on every Redis operation; a report endpoint waits at most "
    "this long for its input to reach Redis before answering (replicated: false).",
    "router.redis_leader_lease_s": "Lease of the replica that runs the threshold controller and "
    "the planner; when it dies another takes over within this long.",
    "router.redis_cache_log": "Cache-event batches kept in Redis; a replica that starts "
    "rebuilds its prefix index from them.",
    "router.vllm_kv_events": "vLLM instances whose KV-cache events (ZMQ, vLLM's "
    "--kv-events-config) feed the prefix index: entries "
    "cluster/node=tcp://host:port, with |tcp://host:replay_port for the replay socket (a "
    "router started late, or one that missed events, asks it again). Needs pyzmq "
    "(pip install 'xdc[vllm-events]').",
    "router.vllm_hash_algo": "The engines' prefix_caching_hash_algo: sha256 (vLLM's default) "
    "or sha256_cbor; xxhash/xxhash_cbor only with vllm_hash_seed. The engines' block size "
    "must equal router.block_size.",
    "router.vllm_hash_seed": "The engines' PYTHONHASHSEED; empty when they run without it "
    "(vLLM then uses its fixed seed for sha256).",
    "router.vllm_kv_group": "The KV cache group whose blocks count, for engines whose events "
    "do not name each group's kind; where they do (vLLM 0.32), the full-attention group counts "
    "and a hybrid model's state group says where a prefix is reusable. Other groups' events "
    "are dropped and counted.",
    "router.vllm_metrics": "vLLM instances whose /metrics the router scrapes for node load "
    "(waiting requests, their expected queue time from the mean prefill time, KV cache "
    "usage): entries cluster/node@prefill|decode=http://host:port/metrics. An "
    "engine that stops answering is reported unhealthy after 3 scrapes.",
    "router.vllm_metrics_interval_s": "Seconds between scrapes of router.vllm_metrics.",
}


def source_comments(cls: type) -> dict[str, str]:
    """Comments written above (or beside) each field in the dataclass source, by field name."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    comments: dict[int, str] = {}  # 1-based row -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    classdef = ast.parse(src).body[0]
    assert isinstance(classdef, ast.ClassDef)
    out: dict[str, str] = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in comments and lines[row - 1].lstrip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        beside = comments.get(node.end_lineno or node.lineno)
        text = " ".join([*above, *([beside] if beside else [])]).strip()
        if text:
            out[node.target.id] = text
    return out


def _sections(cfg: Config) -> list[tuple[str, object]]:
    return [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]


def field_docs(cfg: Config | None = None) -> dict[str, str | None]:
    """``section.field`` -> its documentation (None when it has none), for every field."""
    out: dict[str, str | None] = {}
    for name, sect in _sections(cfg or Config()):
        from_source = source_comments(type(sect))
        for f in dataclasses.fields(sect):  # type: ignore[arg-type]
            key = f"{name}.{f.name}"
            out[key] = DOCS.get(key) or from_source.get(f.name)
    return out


def undocumented() -> list[str]:
    return [k for k, v in field_docs().items() if not v]


def sections_for(role: str) -> list[str]:
    """Sections a role's config needs, in Config order."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    owned = frozenset().union(*ROLE_SECTIONS.values())
    mine = ROLE_SECTIONS.get(role, owned)
    return [n for n, _ in _sections(Config()) if n in mine or n not in owned]


def _size_hint(key: str, default: object) -> str:
    value = default
    if not key.endswith("_bytes") or not isinstance(value, int) or isinstance(value, bool):
        return ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale and value % scale == 0:
            return f" Default {value // scale} {unit}."
    return ""


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH - 2, initial_indent="# ", subsequent_indent="# ")


def render_example(role: str = "all", cfg: Config | None = None) -> str:
    """The commented example for ``role`` with the values of ``cfg`` (default: defaults)."""
    cfg = cfg or Config()
    docs = field_docs(cfg)
    wanted = sections_for(role)
    out = [
        f"# xdc configuration example (role: {role}), generated by `xdc config example` from",
        "# the defaults in xdc/config.py: every value below is the default.",
        "# Sources, later ones win: this file < XDC_SECTION__FIELD environment variables <",
        "# --set section.field=value flags. Check a file with `xdc config check FILE`.",
    ]
    for name, sect in _sections(cfg):
        if name not in wanted:
            continue
        out += ["", f"[{name}]"]
        if type(sect).__doc__:
            out += _comment(inspect.cleandoc(type(sect).__doc__ or ""))
        defaults = type(sect)()
        for f in dataclasses.fields(sect):  # type: ignore[arg-type]
            key = f"{name}.{f.name}"
            doc = docs[key] or "(undocumented)"
            out += ["", *_comment(doc + _size_hint(f.name, getattr(defaults, f.name)))]
            out.append(f"{f.name} = {toml_value(getattr(sect, f.name))}")
    return "\n".join(out) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="all",
        help="only the sections this daemon uses (default: all sections)",
    )


def run(args: argparse.Namespace) -> int:
    missing = undocumented()
    if missing:
        print(f"xdc config example: undocumented fields: {', '.join(missing)}", file=sys.stderr)
    sys.stdout.write(render_example(args.role))
    return 0
