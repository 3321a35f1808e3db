"""The RDMA settings are the ``[rdma]`` section of the one typed config (``xdc.config``)."""

from __future__ import annotations

from xdc.config import RdmaConfig as RdmaSettings

__all__ = ["RdmaSettings"]
