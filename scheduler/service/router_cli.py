"""``xdc router``: serve the routing API.

The listening socket is bound before the app starts so that ``--port 0`` works and the URL
printed (the first stdout line, which scripts and the load generator wait for) is the real
one. aiohttp's ``run_app`` turns SIGINT and SIGTERM into a graceful shutdown, which also stops
the long-term planner task.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import secrets
import socket
import sys
from pathlib import Path

from aiohttp import web
from xdc.scheduler.profile import ProfileError, load_profile
from xdc.scheduler.service.router_app import make_router_app
from xdc.scheduler.service.shared import SharedStateError, replica_name

from xdc.config import ConfigError
from xdc.config_flags import add_config_flags, config_from_args
from xdc.logs import setup_logging

DEFAULT_PROFILE = Path("deploy/profiles/prfaas-case-study.toml")


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help=f"profile TOML (default: router.profile, else {DEFAULT_PROFILE} if found)",
    )
    parser.add_argument("--host", help="listen address (router.listen_host)")
    parser.add_argument("--port", type=int, help="listen port, 0 = any (router.listen_port)")


def find_profile(configured: str) -> Path:
    """The configured profile, or the case-study profile from the source tree or CWD."""
    if configured:
        return Path(configured)
    repo = Path(__file__).resolve().parents[2]  # scheduler/service/ -> repo root (editable)
    for base in (repo, Path.cwd()):
        candidate = base / DEFAULT_PROFILE
        if candidate.is_file():
            return candidate
    raise ConfigError(
        [
            "router.profile: not set and "
            f"{DEFAULT_PROFILE} was found neither in {repo} nor in {Path.cwd()}; "
            "pass --profile FILE"
        ]
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(
        args,
        {
            "router.listen_host": args.host,
            "router.listen_port": args.port,
            "router.profile": args.profile,
        },
    )
    setup_logging(cfg.node.log_level, json_lines=cfg.node.log_json, node=cfg.node.id)
    rc = cfg.router
    path = find_profile(rc.profile)
    try:
        profile = load_profile(path)
    except ProfileError as e:
        print(f"xdc router: {e}", file=sys.stderr)
        return 2
    for name in ("gateway_token", "daemon_token"):
        if not getattr(rc, name):
            token = secrets.token_urlsafe(24)
            setattr(rc, name, token)
            print(
                f"xdc router: router.{name} not set; generated for this run: {token}",
                file=sys.stderr,
            )
    try:
        sock = _bind(rc.listen_host, rc.listen_port)
    except OSError as e:
        print(
            f"xdc router: cannot listen on {rc.listen_host}:{rc.listen_port}: {e}", file=sys.stderr
        )
        return 2
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    try:
        app = make_router_app(rc, profile, replica=replica_name(rc, cfg.node.id))
    except SharedStateError as e:
        print(f"xdc router: {e}", file=sys.stderr)
        return 2
    # Everything built so far lives as long as the process. Freezing it keeps full GC passes
    # from re-walking the (int-only, hence untracked-content) index containers every time,
    # which otherwise shows up as multi-millisecond pauses in the route latency tail.
    gc.collect()
    gc.freeze()
    print(f"xdc router listening on http://{shown}:{port} (profile {path})", flush=True)
    try:
        loop = event_loop(rc.event_loop)
    except ConfigError as e:
        print(f"xdc router: {e}", file=sys.stderr)
        return 2
    asyncio.set_event_loop(loop)
    web.run_app(app, sock=sock, print=None, access_log=None, shutdown_timeout=5.0, loop=loop)
    return 0


def event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """uvloop (a libuv event loop in C) when asked for or, with "auto", when installed.

    At 2,000 decisions/s most of a decision's CPU is the event loop and the HTTP transport,
    not the routing; uvloop's C transports and callbacks take a large share of that off.
    """
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ConfigError(
                    ["router.event_loop: uvloop is not installed (pip install uvloop)"]
                ) from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
