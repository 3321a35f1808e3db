"""The connector's inputs, typed and checked: ``kv_connector_extra_config`` (per instance) and
``kv_transfer_params`` (per request, from a gateway or a client). A bad value is a clear
``ValueError`` naming the field; for a request that means local recompute, never a guess.

Per-request contract (a gateway relies on these names):

- prefill instance: ``{"do_remote_decode": true, "xdc_rid": str, "xdc_deadline_s": float?,
  "xdc_peer": "host:port"?}`` (``xdc_peer``: the receiver of the decode node the router chose;
  the sender ships only to receivers its config allows); its response's
  ``kv_transfer_params`` are ``{"do_remote_prefill": true, "xdc_rid": ...,
  "xdc_num_tokens": int, "xdc_ranks": int}``, what the decode instance needs
  (``handover_params``; ``xdc_ranks``: how many transfers the prefill's ranks moved, its
  tensor-parallel size, or 1 when every rank holds the same bytes and rank 0 moves them), or
  ``{"xdc_failed": reason}`` when the KV can not be handed over (``failed_params``: the sender
  is down, draining, refuses that receiver or can not reach it); the gateway reads either with
  ``parse_prefill_answer`` and, on a failure, has the decode prefill by itself at once;
- decode instance: ``{"do_remote_prefill": true, "xdc_rid": str, "xdc_num_tokens": int,
  "xdc_timeout_s": float?, "xdc_arrival_s": float?, "xdc_ranks": int?}``. It may arrive
  before the prefill has begun: the connector waits up to ``xdc_arrival_s`` (default: its
  instance's ``arrival_timeout_s``; never past ``xdc_timeout_s``) for the transfer to
  appear, then recomputes locally (at once, ``rank_mismatch``, when ``xdc_ranks`` is not the
  number of transfers its own ranks read). A gateway that overlaps both requests sends its
  own wait for the prefill as ``xdc_arrival_s``: a prefill queued at a busy PrfaaS cluster
  begins late, and a decode that gave up first would recompute what is still coming.

A gateway writes these with ``prefill_params`` / ``decode_params`` and the connector reads them
with ``parse_request``: one module for both sides of the contract.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xdc.errors import XdcError
from xdc.protocol.engine_control import MAX_RID, check_rid

# An engine split over ranks (tensor parallel) moves one transfer per rank, named by
# ``shard_rid``: the suffix must fit in what the daemons take.
MAX_RANKS = 999
SHARD_MARK = "#"
SHARD_SUFFIX = len(f"{SHARD_MARK}{MAX_RANKS}/{MAX_RANKS}")
MAX_XDC_RID = MAX_RID - SHARD_SUFFIX

MAX_PEER = 255
REASON = re.compile(r"[a-z_]{1,32}")  # a reason word (a metric label)


def _peer(v: Any, where: str) -> str | None:
    """``host:port`` of a receiver (None: the sender's own)."""
    if v is None:
        return None
    if not isinstance(v, str) or not 3 <= len(v) <= MAX_PEER or not v.isprintable():
        raise ValueError(f"{where}: expected host:port")
    host, _, port = v.rpartition(":")
    if not host or " " in host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}: expected host:port, got {v!r:.60}")
    return v


def _rid(v: Any, where: str) -> str:
    """A transfer id the daemons take, with room for a rank's suffix (``shard_rid``): the
    engine protocol's own rule, less the suffix's mark, so that no request's id is another's
    shard (``a#0/2`` of a one-rank engine beside rank 0 of ``a`` on a split one). It once
    allowed 200 characters here, so a decode named by a 129-character id asked the receiver
    about a name it refuses, and every load waiting beside it was failed as if the receiver
    were gone."""
    try:
        rid = check_rid(v)
    except XdcError:
        rid = ""
    if not rid or len(rid) > MAX_XDC_RID or SHARD_MARK in rid:
        raise ValueError(
            f"{where}: expected a printable string of 1..{MAX_XDC_RID} characters without "
            f"{SHARD_MARK!r}"
        )
    return rid


def shard_rid(rid: str, rank: int, ranks: int) -> str:
    """The transfer one rank of an engine split over ``ranks`` moves for ``rid``: each rank
    holds its own share of the KV heads, so each moves its own transfer, to the rank of the
    same number on the other side. One rank: ``rid`` itself."""
    if ranks == 1:
        return rid
    if not 0 <= rank < ranks <= MAX_RANKS:
        raise ValueError(f"rank {rank} of {ranks}")
    return f"{rid}{SHARD_MARK}{rank}/{ranks}"


def tensor_parallel_size(pc: Any) -> int:
    """Ranks an engine's KV heads are split over (vLLM's ``parallel_config``)."""
    return int(getattr(pc, "tensor_parallel_size", 1) or 1)


def _integer(v: Any, where: str, hi: int, hi_text: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise ValueError(f"{where}: expected an integer in 1..{hi_text}")
    return v


def parallel_split(pc: Any) -> str | None:
    """Why an engine split this way can not move its KV, or None. Under tensor parallel each
    rank holds its share of the KV heads and moves it as a transfer of its own, to the rank
    of the same number on the other side (``shard_rid``; the rank is in the layout string, so
    a share that reached the wrong rank is refused, never loaded). Pipeline stages hold
    different layers and context parallel ranks different tokens of each layer: a transfer
    per rank would not line up with the other side's unless both are split alike, which
    nothing here checks yet."""
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        return f"pipeline parallel size {pp} (each stage holds part of the layers)"
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        n = int(getattr(pc, name, 1) or 1)
        if n > 1:
            return f"{name.replace('_', ' ')} {n} (each rank holds part of the tokens)"
    tp = tensor_parallel_size(pc)
    if tp > MAX_RANKS:
        return f"tensor parallel size {tp} (at most {MAX_RANKS} ranks)"
    return None


ADMIT_WHEN = ("complete", "scheduled")  # the first is the default


def _choice(v: Any, where: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (None: the first)."""
    if v is None:
        return choices[0]
    if v not in choices:
        raise ValueError(f"{where}: expected one of {', '.join(choices)}, got {v!r:.40}")
    return str(v)


MAX_HASH_HELPERS = 64


def _helpers(v: Any, where: str) -> int | str:
    """A count of helper processes in 0..MAX_HASH_HELPERS, or "auto" (None: "auto")."""
    if v is None or v == "auto":
        return "auto"
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_HASH_HELPERS:
        raise ValueError(
            f'{where}: expected "auto" or an integer in 0..{MAX_HASH_HELPERS}, got {v!r:.40}'
        )
    return v


def _seconds(v: Any, where: str, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{where}: expected a number of seconds, got {v!r:.40}")
    if not 0 < v <= 3600:
        raise ValueError(f"{where}: {v} is outside (0, 3600] seconds")
    return float(v)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config``."""

    sender_socket: str = ""  # the local xdc sender's engine socket (producer)
    receiver_socket: str = ""  # the local xdc receiver's engine socket (consumer)
    deadline_s: float = 30.0  # a transfer with nothing moving this long fails (producer)
    timeout_s: float = 60.0  # the longest a decode waits for a transfer (consumer)
    arrival_timeout_s: float = 10.0  # ...for it to begin at all (consumer)
    # when a decode request gets its KV blocks (consumer): "complete", once its transfer is
    # complete at the receiver (none are held while its prefill queues or runs elsewhere:
    # admission.py), or "scheduled", at once, as vLLM schedules it (the router then sees
    # the decodes on their way in the engine's KV usage; with "complete", in its count of
    # deferred requests)
    admit: str = "complete"
    # helper processes that hash a GPU load's arrived blocks (consumer): a count (0: hash in
    # threads of the engine's process), or "auto": none below 8 usable cores, else half of
    # them, at most 8 (xdc.integrations.hash_helpers says why)
    hash_helpers: int | str = "auto"

    @staticmethod
    def parse(
        extra: Mapping[str, Any] | None, *, producer: bool, consumer: bool
    ) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f for f in ConnectorConfig.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        socks = {}
        for name in ("sender_socket", "receiver_socket"):
            v = extra.get(name, "")
            if not isinstance(v, str) or len(v) > 4096:
                raise ValueError(f"kv_connector_extra_config.{name}: expected a socket path")
            socks[name] = v
        if producer and not socks["sender_socket"]:
            raise ValueError(
                "kv_connector_extra_config.sender_socket: a producer needs its xdc sender's "
                "engine socket (sender.control_socket)"
            )
        if consumer and not socks["receiver_socket"]:
            raise ValueError(
                "kv_connector_extra_config.receiver_socket: a consumer needs its xdc "
                "receiver's engine socket (receiver.control_socket)"
            )
        cfg = ConnectorConfig(
            socks["sender_socket"],
            socks["receiver_socket"],
            _seconds(extra.get("deadline_s"), "kv_connector_extra_config.deadline_s", 30.0),
            _seconds(extra.get("timeout_s"), "kv_connector_extra_config.timeout_s", 60.0),
            _seconds(
                extra.get("arrival_timeout_s"),
                "kv_connector_extra_config.arrival_timeout_s",
                10.0,
            ),
            _choice(extra.get("admit"), "kv_connector_extra_config.admit", ADMIT_WHEN),
            _helpers(extra.get("hash_helpers"), "kv_connector_extra_config.hash_helpers"),
        )
        return cfg


@dataclass(frozen=True, slots=True)
class SendParams:
    """A request this (prefill) instance computes for a remote decode."""

    rid: str
    deadline_s: float | None
    peer: str | None = None  # the receiver to ship to (None: the sender's own)


@dataclass(frozen=True, slots=True)
class LoadParams:
    """A request whose KV this (decode) instance loads instead of prefilling."""

    rid: str
    num_tokens: int
    timeout_s: float | None
    # tensor-parallel ranks of the prefill that made the KV, when it says (its answer does):
    # a decode split otherwise can not use it and recomputes at once instead of waiting
    ranks: int | None = None
    # how long to wait for the transfer to begin (None: the instance's arrival_timeout_s)
    arrival_s: float | None = None


def parse_request(params: Mapping[str, Any] | None) -> SendParams | LoadParams | None:
    """What ``kv_transfer_params`` ask of this instance (None: nothing, a plain request).
    ValueError names the bad field."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise ValueError("kv_transfer_params: expected an object")
    send, load = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if send is True and load is True:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill both set")
    if send is True:
        return SendParams(
            _rid(params.get("xdc_rid"), "kv_transfer_params.xdc_rid"),
            None
            if params.get("xdc_deadline_s") is None
            else _seconds(params["xdc_deadline_s"], "kv_transfer_params.xdc_deadline_s", 30.0),
            _peer(params.get("xdc_peer"), "kv_transfer_params.xdc_peer"),
        )
    if load is True:
        n = _integer(
            params.get("xdc_num_tokens"), "kv_transfer_params.xdc_num_tokens", 1 << 24, "2**24"
        )
        ranks = params.get("xdc_ranks")
        if ranks is not None:
            ranks = _integer(ranks, "kv_transfer_params.xdc_ranks", MAX_RANKS, str(MAX_RANKS))
        return LoadParams(
            _rid(params.get("xdc_rid"), "kv_transfer_params.xdc_rid"),
            n,
            None
            if params.get("xdc_timeout_s") is None
            else _seconds(params["xdc_timeout_s"], "kv_transfer_params.xdc_timeout_s", 60.0),
            ranks,
            None
            if params.get("xdc_arrival_s") is None
            else _seconds(params["xdc_arrival_s"], "kv_transfer_params.xdc_arrival_s", 10.0),
        )
    return None


def prefill_params(rid: str, *, deadline_s: float, peer: str | None = None) -> dict[str, Any]:
    """What a gateway puts in a remote prefill request: compute, and ship the KV to ``peer``
    (the chosen decode node's receiver; None: the sender's own)."""
    out: dict[str, Any] = {
        "do_remote_decode": True,
        "xdc_rid": _rid(rid, "xdc_rid"),
        "xdc_deadline_s": deadline_s,
    }
    if peer:
        out["xdc_peer"] = _peer(peer, "xdc_peer")
    return out


def decode_params(
    rid: str, num_tokens: int, *, timeout_s: float, arrival_s: float | None = None
) -> dict[str, Any]:
    """What a gateway puts in the decode request of a remote plan: load the KV of transfer
    ``rid`` (a prompt of ``num_tokens`` tokens) instead of prefilling, waiting at most
    ``timeout_s`` in all and ``arrival_s`` for it to begin (None: the instance's default)."""
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "xdc_rid": _rid(rid, "xdc_rid"),
        "xdc_num_tokens": num_tokens,
        "xdc_timeout_s": timeout_s,
    }
    if arrival_s is not None:
        out["xdc_arrival_s"] = arrival_s
    return out


def handover_params(rid: str, num_tokens: int, ranks: int = 1) -> dict[str, Any]:
    """What a prefill instance answers when it handed transfer ``rid`` over, as ``ranks``
    transfers (one per tensor-parallel rank; 1 when its ranks hold the same bytes): a decode
    that reads otherwise recomputes at once (reason ``rank_mismatch``) instead of waiting for
    names that never come."""
    return {
        "do_remote_prefill": True,
        "xdc_rid": rid,
        "xdc_num_tokens": num_tokens,
        "xdc_ranks": ranks,
    }


def failed_params(reason: str) -> dict[str, Any]:
    """What a prefill instance answers when its KV will not reach the decode: ``reason`` is
    one word (``sender_down``, ``draining``, ``peer_refused``, ``peer_unreachable``,
    ``unsupported_kv``, ``send_failed``...)."""
    return {"xdc_failed": reason if REASON.fullmatch(reason) else "other"}


def reason_word(v: Any) -> str:
    """A reason as a metric label: a short lowercase word, else ``other``."""
    return v if isinstance(v, str) and REASON.fullmatch(v) else "other"


def parse_prefill_answer(params: Any, rid: str, num_tokens: int) -> str | None:
    """The gateway's reading of a prefill answer's ``kv_transfer_params``: None when the KV
    of ``rid`` (``num_tokens`` prompt tokens) was handed over, else why not (one word:
    the engine's ``xdc_failed`` reason, or ``mismatch`` for an answer that names another
    transfer or none)."""
    if isinstance(params, Mapping) and "xdc_failed" in params:
        return reason_word(params["xdc_failed"])
    if (
        isinstance(params, Mapping)
        and params.get("do_remote_prefill") is True
        and params.get("xdc_rid") == rid
        and params.get("xdc_num_tokens") == num_tokens
    ):
        return None
    return "mismatch"


# A load that failed because another part of its request failed first: a tensor-parallel
# rank whose share was refused discards the transfer its sibling ranks read too, and they see
# it CANCELLED, in the same step or a later one. The answer names the first cause instead.
CONSEQUENTIAL_REASONS = frozenset({"cancelled"})


def merge_reasons(into: dict[str, str], new: Mapping[str, str]) -> dict[str, str]:
    """Why each request recomputed, from reports of ranks and parts in any order: a request's
    first reason stays, unless it was a consequence of another part's failure and the new one
    is not (a rank's report can arrive after its sibling's, in the same step or later)."""
    for req_id, why in new.items():
        old = into.get(req_id)
        if old is None or (old in CONSEQUENTIAL_REASONS and why not in CONSEQUENTIAL_REASONS):
            into[req_id] = why
    return into
