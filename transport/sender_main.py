"""`xdc sender`: the prefill-side daemon."""

from __future__ import annotations

import argparse

from xdc.transport.daemon import run as run_to_end
from xdc.transport.sender import Sender

from xdc.config_flags import add_config_flags, config_from_args
from xdc.logs import setup_logging


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument("--peer", metavar="HOST:PORT", help="receiver address (sender.peer_*)")
    parser.add_argument("--connections", type=int, help="parallel TCP connections per peer")
    parser.add_argument("--control-socket", help="Unix socket the prefill engine connects to")
    parser.add_argument("--status-port", type=int, help="HTTP /status and /metrics port (0 = off)")


def run(args: argparse.Namespace) -> int:
    extra: dict[str, object] = {
        "sender.connections": args.connections,
        "sender.control_socket": args.control_socket,
        "sender.status_port": args.status_port,
    }
    if args.peer:
        host, _, port = args.peer.rpartition(":")
        extra["sender.peer_host"] = host
        extra["sender.peer_port"] = port
    cfg = config_from_args(args, extra)
    setup_logging(cfg.node.log_level, json_lines=cfg.node.log_json, node=cfg.node.id)
    sender = Sender(cfg)
    return run_to_end(
        sender, cfg.sender.status_host, cfg.sender.status_port, sender.metrics.registry
    )
