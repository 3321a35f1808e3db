"""Mutual TLS for the data connections between datacenters.

Both ends present a certificate from the deployment's CA and require one from the peer
(TLS 1.3 only, CERT_REQUIRED both ways); on top of the chain, a peer's identity must be in
``tls.allowed_peers`` when that list is set, and the sender checks the receiver's name like
any TLS client. Every refusal carries a short reason label (for logs and metrics) and a
sentence that tells an operator what to fix, because "handshake failed" alone sends people
reading packet captures.

The classification of errors and the identity check are pure functions over exceptions and
decoded certificates, so they are tested without sockets; the async part is a thin wrapper
around ``trio.SSLStream``.
"""

from __future__ import annotations

import contextlib
import hashlib
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import trio
from xdc.transport.sealed_records import SealedRecords, upgrade
from xdc.transport.tls_records import TlsRecords

from xdc.config import ConfigError, TlsConfig
from xdc.errors import RemoteConnectionError
from xdc.protocol import aead_aegis
from xdc.protocol.aead_records import (
    ALPN_SEALED,
    ALPN_SEALED_V1,
    ALPN_SEALED_V3,
    ALPN_TLS,
    SealedError,
    cipher_of_alpn,
)

DataRecords = TlsRecords | SealedRecords

# OpenSSL X509 verify codes (include/openssl/x509_vfy.h) the refusals are told apart by
_V_NOT_YET_VALID = 9
_V_EXPIRED = 10
_V_UNTRUSTED = frozenset({2, 18, 19, 20, 21})  # no issuer / self-signed / not from our CA
_V_NAME = frozenset({62, 64})  # hostname / IP address mismatch

# OpenSSL reason strings of a peer that does not speak TLS at all
_NOT_TLS = frozenset(
    {
        "WRONG_VERSION_NUMBER",
        "HTTP_REQUEST",
        "HTTPS_PROXY_REQUEST",
        "PACKET_LENGTH_TOO_LONG",
        "UNKNOWN_PROTOCOL",
        "RECORD_LAYER_FAILURE",
        "WRONG_SSL_VERSION",
    }
)


class TlsRefused(RemoteConnectionError):
    """A TLS connection refused during or right after the handshake.

    ``reason`` is a short label (metrics, tests); ``str(e)`` says what went wrong and what
    usually fixes it.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TlsPolicy:
    """Everything a daemon needs per connection, built once at start-up."""

    context: ssl.SSLContext
    allowed: frozenset[str]
    server_name: str  # the name the receiver's cert must carry ("" = the peer's host)


def load_policy(tc: TlsConfig, *, server: bool) -> TlsPolicy | None:
    """The daemon's TLS policy, or None when the config says ``mode = "off"``.

    Raises ConfigError naming the field when a file is missing or unusable, so a daemon
    configured for mutual TLS never falls back to plain TCP.
    """
    if tc.mode == "off":
        return None
    problems = tc.ready_problems()
    if problems:
        raise ConfigError(problems)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = not server
    # ALPN chooses the data phase's records inside the authenticated handshake; the server's
    # order wins, so sealed records are used only when both ends list them, and of those the
    # newest both know (AEGIS-128L where both have it and allow it)
    ctx.set_alpn_protocols([*sealed_versions(tc.record_layer, tc.record_cipher), ALPN_TLS])
    if server:
        ctx.num_tickets = 0  # sessions are never resumed: no tickets to send or skip
    try:
        ctx.load_verify_locations(cafile=tc.ca_file)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise ConfigError([f"tls.ca_file: {tc.ca_file}: not a usable CA file ({e})"]) from None
    try:
        ctx.load_cert_chain(tc.cert_file, tc.key_file)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise ConfigError(
            [
                f"tls.cert_file/tls.key_file: {tc.cert_file} with {tc.key_file}: "
                f"not a usable certificate and matching key ({e})"
            ]
        ) from None
    return TlsPolicy(ctx, tc.allowed(), tc.server_name)


# --- pure helpers ---------------------------------------------------------------------------


def peer_identities(cert: dict[str, Any]) -> set[str]:
    """SAN DNS names and subject CNs of a decoded peer certificate (``getpeercert()``)."""
    names = {str(v) for k, v in cert.get("subjectAltName", ()) if k == "DNS"}
    for rdn in cert.get("subject", ()):
        names.update(str(v) for k, v in rdn if k == "commonName")
    return names


def check_allowed(cert: dict[str, Any] | None, allowed: frozenset[str]) -> None:
    """Raise TlsRefused unless the certificate names one of ``allowed`` (empty = anyone the
    CA vouches for)."""
    if not allowed:
        return
    names = peer_identities(cert or {})
    if names & allowed:
        return
    raise TlsRefused(
        "not_allowed",
        f"peer certificate identities {sorted(names) or '(none)'} are not in tls.allowed_peers "
        f"{sorted(allowed)}",
    )


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def classify(exc: BaseException) -> TlsRefused:
    """Turn whatever a TLS handshake (or the first read after it) raised into a refusal with
    a reason label and an operator-facing sentence."""
    for e in _chain(exc):
        if isinstance(e, TlsRefused):
            return e
        if isinstance(e, ssl.SSLCertVerificationError):
            code = e.verify_code
            msg = e.verify_message
            if code == _V_EXPIRED:
                return TlsRefused("expired", f"peer certificate has expired ({msg})")
            if code == _V_NOT_YET_VALID:
                return TlsRefused("not_yet_valid", f"peer certificate is not valid yet ({msg})")
            if code in _V_UNTRUSTED:
                return TlsRefused(
                    "wrong_ca",
                    f"peer certificate does not chain to tls.ca_file ({msg})",
                )
            if code in _V_NAME:
                return TlsRefused(
                    "wrong_name",
                    f"peer certificate is not for the expected name ({msg}); check tls.server_name",
                )
            return TlsRefused("verify_failed", f"peer certificate rejected ({msg})")
        if isinstance(e, ssl.SSLEOFError | ssl.SSLZeroReturnError):
            return _closed()
        if isinstance(e, ssl.SSLError):
            return _classify_reason(str(e.reason or ""), str(e))
    for e in _chain(exc):
        if isinstance(e, trio.TooSlowError):
            return TlsRefused("timeout", "TLS handshake did not finish in time")
        if isinstance(e, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
            return _closed()
    return TlsRefused("other", f"TLS failed: {exc!r}")


def _closed() -> TlsRefused:
    return TlsRefused(
        "closed",
        "peer closed the connection during the TLS handshake (it may have refused our "
        "certificate or identity: see its log; or it does not speak TLS)",
    )


def _classify_reason(reason: str, text: str) -> TlsRefused:
    if reason in _NOT_TLS:
        return TlsRefused("plain_tcp", f"peer is not speaking TLS (plain TCP?): {reason}")
    if reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        return TlsRefused("no_certificate", f"no client certificate presented ({reason})")
    if reason in (
        "UNSUPPORTED_PROTOCOL",
        "TLSV1_ALERT_PROTOCOL_VERSION",
        "NO_PROTOCOLS_AVAILABLE",
        "VERSION_TOO_LOW",
    ):
        return TlsRefused("tls_version", f"peer does not speak TLS 1.3 ({reason})")
    if reason == "TLSV1_ALERT_UNKNOWN_CA":
        return TlsRefused("peer_rejected_ca", "peer refused our certificate: not issued by its CA")
    if reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
        return TlsRefused("peer_rejected_expired", "peer refused our certificate: expired")
    if "ALERT" in reason:
        return TlsRefused("peer_rejected", f"peer refused the handshake ({reason})")
    return TlsRefused("other", f"TLS error: {text}")


class RefusalLog:
    """Which handshake refusals to log: a misconfigured sender retries every connection
    every few seconds, and one line per retry would bury everything else. The first
    refusal per (source host, reason) is logged, then at most one per ``interval_s`` with
    the number left out in between."""

    def __init__(self, interval_s: float = 30.0, max_keys: int = 1024) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def admit(self, source: str, reason: str, now: float) -> int | None:
        """None = stay quiet; else log, mentioning this many refusals not logged before."""
        key = (source, reason)
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            self._last[key] = (seen[0], seen[1] + 1)
            return None
        if seen is None and len(self._last) >= self.max_keys:
            self._last.pop(next(iter(self._last)))
        self._last[key] = (now, 0)
        return seen[1] if seen is not None else 0


# --- handshakes ------------------------------------------------------------------------------


async def server_handshake(sock: trio.socket.SocketType, policy: TlsPolicy) -> DataRecords:
    """Receiver side: TLS over an accepted socket, client certificate and identity checked,
    then the data phase's records (sealed when both ends asked for them). Raises TlsRefused;
    the caller applies its own timeout."""
    records, _who = await server_handshake_identified(sock, policy)
    return records


async def server_handshake_identified(
    sock: trio.socket.SocketType, policy: TlsPolicy
) -> tuple[DataRecords, str]:
    """``server_handshake``, and who the peer proved to be (``certificate_identity``)."""
    stream = trio.SSLStream(trio.SocketStream(sock), policy.context, server_side=True)
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        await _flush_alert(sock, stream)
        raise classify(e) from e
    cert = stream.getpeercert()
    check_allowed(cert, policy.allowed)
    who = certificate_identity(cert, stream.getpeercert(binary_form=True))
    return await _data_records(sock, stream, server_side=True), who


def certificate_identity(cert: dict[str, Any] | None, der: bytes | None) -> str:
    """What a sender session is bound to under mutual TLS: the names its certificate
    proves (SAN DNS, subject CN), or the certificate's digest when it names nothing."""
    names = peer_identities(cert or {})
    if names:
        return "tls:" + ",".join(sorted(names))
    return "tls-sha256:" + hashlib.sha256(der or b"").hexdigest()[:32]


def sealed_versions(record_layer: str, record_cipher: str) -> list[str]:
    """The sealed-record ALPN versions this end offers, newest first."""
    if record_layer != "sealed":
        return []
    aegis = [ALPN_SEALED_V3] if aead_aegis.available() else []
    if record_cipher == "aegis-128l":
        return aegis
    if record_cipher == "aes-128-gcm":
        return [ALPN_SEALED, ALPN_SEALED_V1]
    return [*aegis, ALPN_SEALED, ALPN_SEALED_V1]


async def _data_records(
    sock: trio.socket.SocketType, stream: trio.SSLStream[trio.SocketStream], *, server_side: bool
) -> DataRecords:
    """The records the data phase runs on: TLS records, or sealed ones if ALPN chose them."""
    records = TlsRecords(sock, stream)
    chosen = stream.selected_alpn_protocol()
    if chosen not in (ALPN_SEALED_V3, ALPN_SEALED, ALPN_SEALED_V1):
        return records
    try:
        return await upgrade(
            records,
            server_side=server_side,
            tls_version=records.version(),
            sampled_checksums=chosen != ALPN_SEALED_V1,
            cipher=cipher_of_alpn(chosen),
        )
    except SealedError as e:
        raise TlsRefused("sealed_setup", f"sealed record set-up failed: {e}") from e
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        raise classify(e) from e


async def _flush_alert(
    sock: trio.socket.SocketType, stream: trio.SSLStream[trio.SocketStream]
) -> None:
    """Send the alert OpenSSL wrote for a failed handshake (trio drops it), so the peer
    learns *why* (unknown CA, expired certificate) instead of seeing a bare close."""
    alert = stream._outgoing.read()  # private: trio has no public way to flush it
    if alert:
        with trio.move_on_after(0.5), contextlib.suppress(OSError):
            await sock.send(alert)


async def client_handshake(
    sock: trio.socket.SocketType,
    policy: TlsPolicy,
    peer_host: str,
    server_name: str | None = None,
) -> DataRecords:
    """Sender side: TLS over a connected socket; the receiver's certificate must carry
    ``server_name`` (a peer from ``sender.allowed_peers``), else ``tls.server_name``
    (default: the host we dialled) and, if set, an allowed identity.

    With TLS 1.3 the client finishes its handshake before the server has judged the client
    certificate, so a refusal by the receiver surfaces on the first read instead: with sealed
    records that is the read of the receiver's key share, here; with TLS records the caller's
    first read, whose errors callers pass through ``classify`` too.
    """
    stream = trio.SSLStream(
        trio.SocketStream(sock),
        policy.context,
        server_hostname=server_name or policy.server_name or peer_host,
    )
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        await _flush_alert(sock, stream)
        raise classify(e) from e
    check_allowed(stream.getpeercert(), policy.allowed)
    return await _data_records(sock, stream, server_side=False)


__all__ = [
    "DataRecords",
    "RefusalLog",
    "TlsPolicy",
    "TlsRefused",
    "check_allowed",
    "classify",
    "client_handshake",
    "load_policy",
    "peer_identities",
    "server_handshake",
]
