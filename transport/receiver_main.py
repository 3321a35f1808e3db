"""`xdc receiver`: the decode-side daemon."""

from __future__ import annotations

import argparse

from xdc.transport.daemon import run as run_to_end
from xdc.transport.receiver import Receiver

from xdc.config_flags import add_config_flags, config_from_args
from xdc.logs import setup_logging


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument(
        "--listen", metavar="HOST:PORT", help="data listen address (receiver.listen_*)"
    )
    parser.add_argument("--control-socket", help="Unix socket the decode engine connects to")
    parser.add_argument("--pool-mib", type=int, help="receive pool size in MiB")
    parser.add_argument("--status-port", type=int, help="HTTP /status and /metrics port (0 = off)")


def run(args: argparse.Namespace) -> int:
    extra: dict[str, object] = {
        "receiver.control_socket": args.control_socket,
        "receiver.status_port": args.status_port,
        "receiver.pool_bytes": args.pool_mib * 1024 * 1024 if args.pool_mib else None,
    }
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        extra["receiver.listen_host"] = host
        extra["receiver.listen_port"] = port
    cfg = config_from_args(args, extra)
    setup_logging(cfg.node.log_level, json_lines=cfg.node.log_json, node=cfg.node.id)
    receiver = Receiver(cfg)
    return run_to_end(
        receiver, cfg.receiver.status_host, cfg.receiver.status_port, receiver.metrics.registry
    )
