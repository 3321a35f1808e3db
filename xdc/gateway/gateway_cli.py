"""``xdc gateway``: serve the OpenAI-compatible API in front of the router and the engines."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from xdc.config_flags import add_config_flags, config_from_args
from xdc.logs import setup_logging


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument("--host", help="listen address (gateway.listen_host)")
    parser.add_argument("--port", type=int, help="listen port, 0 = any (gateway.listen_port)")
    parser.add_argument("--unix", help="also listen on this unix socket (gateway.listen_unix)")
    parser.add_argument("--router-url", help="the router's base URL (gateway.router_url)")
    parser.add_argument("--nodes", help="name=http://host:port,... (gateway.nodes)")
    parser.add_argument("--model", help="model id served (gateway.model)")


async def _serve(
    app: web.Application, host: str, port: int, unix: str, idle_timeout_s: float
) -> None:
    # keepalive_timeout is also aiohttp's only bound on a connection that has not finished a
    # request head (at its start and between requests); a request being handled is not cut
    # handler_cancellation: a client that goes away cancels its handler at once, which
    # closes the engine requests it had open (vLLM aborts them, the connectors drop their
    # transfers and free the blocks) instead of letting them run to the first write
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=idle_timeout_s,
        handler_cancellation=True,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        bound = sockets[0].getsockname()[1] if sockets else port
        shown = f"[{host}]" if ":" in host else host
        where = f"http://{shown}:{bound}"
        if unix:
            await web.UnixSite(runner, unix).start()
            where += f" and unix:{unix}"
        print(f"xdc gateway listening on {where}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(
        args,
        {
            "gateway.listen_host": args.host,
            "gateway.listen_port": args.port,
            "gateway.listen_unix": args.unix,
            "gateway.router_url": args.router_url,
            "gateway.nodes": args.nodes,
            "gateway.model": args.model,
        },
    )
    setup_logging(cfg.node.log_level, json_lines=cfg.node.log_json, node=cfg.node.id)
    gc = cfg.gateway
    log = logging.getLogger("xdc.gateway")
    if not gc.nodes:
        print("xdc gateway: gateway.nodes is empty: no engine to send requests to", file=sys.stderr)
        return 2
    if not gc.client_tokens:
        log.warning("gateway.client_tokens is empty: any client may send requests")
    if not gc.router_url:
        log.warning("gateway.router_url is empty: every request takes the static fallback")
    from xdc.gateway.gateway_app import make_gateway_app

    try:
        asyncio.run(
            _serve(
                make_gateway_app(gc),
                gc.listen_host,
                gc.listen_port,
                gc.listen_unix,
                gc.idle_timeout_s,
            )
        )
    except OSError as e:
        print(f"xdc gateway: cannot listen: {e}", file=sys.stderr)
        return 2
    return 0
