"""File descriptors: how many a daemon may spend on unauthenticated data connections.

A receiver's data port is open to the network, its engine socket only to local engines. If
anyone who can reach the data port can use up the process's descriptors, the next decode
engine cannot connect (and before this module, the daemon died of the EMFILE). So data
connections get a budget: what the descriptor limit allows, less what the daemon had open
at start, less a reserve kept for engines and the daemon's own needs (files, pool, status).
"""

from __future__ import annotations

import errno
import os
import resource

# accept() failures that mean "out of a resource for now", not "the listener is broken"
ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# descriptors never handed to data connections: engines, their replies, logs, the status port
MIN_RESERVE = 16
# the most a daemon raises its soft limit to (the hard limit may be 2**20 or more)
NOFILE_TARGET = 65536


def raise_nofile_limit(target: int = NOFILE_TARGET) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``target`` (never above the hard limit) and
    return the soft limit in force. Many hosts start services at 1,024, which a busy
    receiver's legitimate connections alone can use up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def open_descriptors() -> int:
    """Descriptors this process holds now (Linux /proc; 0 where that cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def reserve_for(soft_limit: int) -> int:
    """Descriptors kept back from data connections: an eighth of the limit, at least
    MIN_RESERVE (64 descriptors keep 16 back; 65,536 keep 8,192)."""
    return max(MIN_RESERVE, soft_limit // 8)


def data_connection_budget(configured: int, soft_limit: int, in_use: int) -> int:
    """How many data connections (counted from accept, TLS handshake included) a daemon may
    hold: the configured cap, or fewer where the descriptor limit would not leave the
    reserve. Never below 1, so a badly limited daemon still serves one sender."""
    room = soft_limit - in_use - reserve_for(soft_limit)
    return max(1, min(configured, room))
