"""`xdc config check FILE`: validate a config and report every problem at once."""

from __future__ import annotations

import argparse
import sys

from xdc.config import ConfigError, load_config, to_toml


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="TOML config file")
    parser.add_argument(
        "--print", action="store_true", help="print the effective config (file + XDC_* env)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(f"{args.file}: {len(e.problems)} problem(s)", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if args.print:
        print(to_toml(cfg))
    print(f"{args.file}: ok")
    return 0
