"""The config flags every xdc command shares (``--config`` and ``--set``), beside the config
they load: the daemons' and services' entry points use them without importing the top-level
CLI that dispatches to them."""

from __future__ import annotations

import argparse

from xdc.config import Config, load_config, parse_set_flags


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every daemon shares: a TOML file plus ``--set section.field=value`` overrides."""
    parser.add_argument("--config", "-c", metavar="FILE", help="TOML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field (repeatable); env XDC_SECTION__FIELD works too",
    )


def config_from_args(args: argparse.Namespace, extra: dict[str, object] | None = None) -> Config:
    overrides: dict[str, object] = dict(parse_set_flags(list(args.overrides)))
    overrides.update({k: v for k, v in (extra or {}).items() if v is not None})
    return load_config(getattr(args, "config", None), overrides=overrides)
