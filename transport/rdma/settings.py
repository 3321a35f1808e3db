"""RDMA settings, kept in this package until the lead moves them into ``xdc.config``.

Every field has a default that leaves RDMA off, so a config without an ``rdma`` section behaves
exactly like today's TCP-only daemon.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RdmaSettings:
    # Off by default: RDMA is an optimisation inside one datacenter, never a requirement.
    enabled: bool = False
    # Peers that declare the same non-empty domain share an RDMA fabric (one PD cluster).
    domain: str = ""
    # Device to open ("" = the first usable one in /sys/class/infiniband).
    device: str = ""
    port: int = 1
    # RoCE needs a GID; index 1 is usually the RoCEv2 IPv4-mapped entry on rxe/mlx5.
    gid_index: int = 1
    # Checksum every Nth chunk (1 = every chunk, 0 = none): RC has link-level CRCs, so a
    # sample is enough to catch a buggy peer or a bad buffer mapping at a fraction of the CPU.
    verify_every: int = 16
    # Work requests in flight per queue pair; bounds the send queue and the pinned staging.
    max_inflight: int = 64
    # Receive work requests kept posted (each WRITE_WITH_IMM consumes one).
    recv_depth: int = 256
    # How long a blocked completion wait may sleep before it re-checks for cancellation.
    poll_timeout_s: float = 0.05
    # An RC connection with nothing completing for this long is declared dead (-> TCP).
    stall_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.verify_every < 0:
            raise ValueError("rdma.verify_every must be >= 0")
        if self.max_inflight < 1 or self.recv_depth < 1:
            raise ValueError("rdma.max_inflight and rdma.recv_depth must be >= 1")
        if not 1 <= self.port <= 255 or not 0 <= self.gid_index <= 255:
            raise ValueError("rdma.port must be 1..255 and rdma.gid_index 0..255")
        if self.poll_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("rdma timeouts must be > 0")
