"""Logging set-up shared by every daemon: plain lines for people, or one JSON object per line
(``node.log_json``) for log pipelines, with the node id on every record so lines from the
sender, receiver and router can be joined by request id."""

from __future__ import annotations

import json
import logging
import sys
import time


def safe(text: object, limit: int = 200) -> str:
    """An id or name from outside, fit for one log line: as it is when printable, else its
    escaped repr (a newline or NUL in a request id must not forge or cut log lines), cut to
    ``limit`` characters."""
    s = str(text)
    if s.isprintable() and len(s) <= limit:
        return s
    shown = s if s.isprintable() else repr(s)
    return shown[:limit] + ("..." if len(shown) > limit else "")


class JsonFormatter(logging.Formatter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "node": self.node,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def setup_logging(level: str = "info", *, json_lines: bool = False, node: str = "xdc") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter(node))
    else:
        fmt = logging.Formatter(f"%(asctime)s {node} %(levelname)s %(name)s: %(message)s")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
