"""Hard limits both peers enforce on every frame.

Field names mirror :class:`xdc.config.LimitsConfig` so a loaded config converts with
``cfg.limits.limits()``; the protocol package stays free of config
loading. The defaults bound what one malicious or buggy peer can make us allocate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 16 * 1024
    max_chunk_bytes: int = 4 * 1024 * 1024
    max_layers: int = 1024
    max_request_bytes: int = 16 * 1024**3
    # Not checked per frame: requests span connections, so the daemon enforces it (TOO_BUSY).
    max_concurrent_transfers: int = 256
    max_block_hashes: int = 65536
