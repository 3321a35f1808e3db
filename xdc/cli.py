"""The `xdc` console script.

Subcommands live in their own modules and are imported only when chosen, so `xdc sender`
does not pay for aiohttp and `xdc router` does not pay for trio. A command module provides
``configure(parser)`` to add its flags and ``run(args) -> int`` to do the work.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

from xdc import __version__
from xdc.errors import ConfigurationError, StartupError

# name -> (module, one-line help). Two-word commands ("bench transfer") are spelled with a space.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("xdc.demo", "run receiver, sender and a synthetic prefill engine locally"),
    "sender": ("xdc.transport.sender_main", "run the prefill-side sender daemon"),
    "receiver": ("xdc.transport.receiver_main", "run the decode-side receiver daemon"),
    "bench transfer": (
        "xdc.lab.bench_transfer",
        "xdc goodput vs iperf3 on loopback and shaped links",
    ),
    "plan": ("xdc.scheduler.cli_plan", "solve threshold t and N_p/N_d from a profile"),
    "profile measure": (
        "xdc.scheduler.profile_measure_cli",
        "measure the engines through their OpenAI API and write a profile",
    ),
    "router": ("xdc.scheduler.service.router_cli", "run the gateway-facing routing service"),
    "gateway": (
        "xdc.gateway.gateway_cli",
        "OpenAI-compatible API: asks the router, drives the engines",
    ),
    "up": ("xdc.gateway.up", "bring a whole local PrfaaS system up (vLLM, xdc, router, gateway)"),
    "replay": ("xdc.scheduler.sim.replay_cli", "replay a trace through simulated clusters"),
    "monitor": ("xdc.monitor.monitor_cli", "print live link state of a running daemon"),
    "config check": ("xdc.config_check", "validate a config file and report every problem"),
    "config example": ("xdc.config_example", "print a fully commented example config"),
}


# The daemons and servers stop cleanly on SIGTERM by themselves (trio's and aiohttp's signal
# handling). Every other command is a foreground tool that starts processes, namespaces or
# shared memory and stops them on the way out: for those SIGTERM (`timeout`, `kill`, a
# supervisor) unwinds like Ctrl-C, where its default would end the process with all of that
# left behind (`xdc bench transfer` left both daemons, their pools and its namespaces).
OWN_SIGTERM = frozenset({"sender", "receiver", "router", "gateway"})


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _top_help() -> str:
    width = max(len(n) for n in COMMANDS)
    rows = "\n".join(f"  {n:<{width}}  {h}" for n, (_, h) in COMMANDS.items())
    return (
        f"usage: xdc COMMAND [options]\n\ncommands:\n{rows}\n\n"
        "Run `xdc COMMAND --help` for a command's options."
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_help())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"xdc {__version__}")
        return 0
    name = argv[0]
    rest = argv[1:]
    if len(argv) > 1 and f"{argv[0]} {argv[1]}" in COMMANDS:
        name, rest = f"{argv[0]} {argv[1]}", argv[2:]
    if name not in COMMANDS:
        print(f"xdc: unknown command {name!r}\n\n{_top_help()}", file=sys.stderr)
        return 2
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"xdc {name}", description=help_text)
    module.configure(parser)
    args = parser.parse_args(rest)
    if name not in OWN_SIGTERM:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(module.run(args))
    except StartupError as e:
        print(f"xdc {name}: cannot start: {e.message}", file=sys.stderr)
        return 2
    except ConfigurationError as e:
        # a config, profile, trace or flag that cannot run: one message, no traceback
        print(f"xdc {name}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
