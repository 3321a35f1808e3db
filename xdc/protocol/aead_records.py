"""Sealed records: the data phase of a mutual-TLS connection, in records of up to 1 MiB
(xdc's sender cuts payloads into 256 KiB records: ``transport/sealed_records.py``).

Why not TLS records: a TLS record carries at most 16 KiB, so Python's ``ssl`` decrypts a 1 MiB
chunk in 64 ``SSL_read`` calls, copies every byte through a memory BIO, and runs the system
OpenSSL's AES-GCM (3.0.x here: ~6 GB/s). Measured with the daemons on loopback that cost 1.27
CPU s/GB against 0.55 for plain TCP. Kernel TLS would take the records off Python's hands,
but this kernel has no ``CONFIG_TLS``. So once the TLS 1.3 handshake has authenticated both
ends, the connection switches to records up to 64 times larger, sealed with AES-128-GCM
from ``cryptography`` (its bundled OpenSSL 4 runs GCM at ~22 GB/s on this CPU), decrypted
straight into the chunk's destination.

What keeps this as strong as the TLS it replaces (docs/protocol.md, "Sealed records"):

- Keys: after the handshake each side sends 32 random bytes *through TLS* (so only the two
  authenticated ends know them); both shares go into HKDF-SHA256, one secret per direction.
  Neither side alone can make a key repeat.
- Nonces: the TLS 1.3 construction, a per-direction IV XOR the record's sequence number, which
  is implicit: a record replayed, dropped or reordered fails to open.
- Each record: a 4-byte length in the clear (authenticated as associated data), the
  ciphertext, the 16-byte GCM tag. Lengths outside ``1..RECORD_MAX`` plaintext bytes are
  refused before anything is read into a buffer.
- Key update: after ``REKEY_BYTES`` of plaintext under one key (16 GiB, well inside AES-GCM's
  limits), both sides derive the next secret from the current one at the same record
  boundary, as TLS 1.3's KeyUpdate does but without a message.
- A connection that ends between records is a lost connection to the xdc protocol (unacked
  chunks are resent elsewhere), so there is no authenticated close; an end inside a record is
  an error.

ALPN picks the record layer during the (authenticated) handshake: a receiver that offers
a sealed version and a sender that asks for it switch; anything else keeps TLS records. The
versions differ in the cipher and in the CHUNK checksums above the records:

- ``xdc-sealed/3``: AEGIS-128L with 256-bit tags (``aead_aegis``: faster per core, and it
  releases the GIL, so sealing in several data threads uses several cores), 128-bit nonces
  built the same way; sampled chunk checksums as version 2. Offered first where PyNaCl has it
  and ``tls.record_cipher`` allows it;

- ``xdc-sealed/1``: every chunk carries and is verified against its xxh3 checksum;
- ``xdc-sealed/2``: one chunk in ``SAMPLE_EVERY`` does (``checksum_sampled``), the others carry
  0 and are not hashed on either end. Every payload byte is still authenticated, by a 128-bit
  GCM tag over its own record, opened straight into its destination: the checksum would check
  the same bytes a second time with a weaker code. What the sampled checksums keep is an
  end-to-end check of xdc's own handling (header and payload paired by the sender, placed by
  the receiver) that runs all the time, as RDMA's sampled checksums do. Measured on loopback
  with 2 MiB chunks: xxh3 on both ends was ~0.06 of TLS's 0.64 CPU s/GB.

This module is pure (no sockets): the I/O shell is ``transport/sealed_records.py``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Protocol, Self

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from xdc.errors import RemoteConnectionError
from xdc.protocol import aead_aegis

ALPN_SEALED_V3 = "xdc-sealed/3"  # AEGIS-128L records, sampled chunk checksums
ALPN_SEALED = "xdc-sealed/2"  # sealed records, sampled chunk checksums
ALPN_SEALED_V1 = "xdc-sealed/1"  # sealed records, every chunk checksummed (older peers)
ALPN_TLS = "xdc/1"
SAMPLE_EVERY = 16  # xdc-sealed/2: chunks whose checksum is computed and verified
_MIX_LAYER = 0x9E3779B97F4A7C15
_MIX_OFFSET = 0xBF58476D1CE4E5B9
_MASK64 = (1 << 64) - 1
SHARE_BYTES = 32  # each side's random contribution to the keys
HEADER = struct.Struct("!I")  # ciphertext length: plaintext + TAG
TAG = 16  # AES-128-GCM's (versions 1 and 2); a Sealer or Opener knows its own: ``.tag``
TAG_MAX = aead_aegis.TAG_BYTES  # the largest tag of any version
RECORD_MAX = 1 << 20  # plaintext per record: one default chunk
REKEY_BYTES = 1 << 34  # plaintext under one key before both sides move to the next

_SALT = b"xdc-sealed/1"


class Aead(Protocol):
    """What a record cipher offers (``AESGCM``'s calls)."""

    def encrypt_into(
        self, nonce: bytes, data: memoryview, aad: bytes | memoryview, out: memoryview
    ) -> int: ...

    def decrypt_into(
        self, nonce: bytes, data: memoryview, aad: bytes | memoryview, out: memoryview
    ) -> int: ...


class Cipher(enum.Enum):
    """A sealed-record cipher: (name, key bytes, IV/nonce bytes, tag bytes)."""

    AES_128_GCM = ("aes-128-gcm", 16, 12, TAG)
    AEGIS_128L = ("aegis-128l", aead_aegis.KEY_BYTES, aead_aegis.NONCE_BYTES, TAG_MAX)

    def __init__(self, label: str, key_bytes: int, iv_bytes: int, tag: int) -> None:
        self.label, self.key_bytes, self.iv_bytes, self.tag = label, key_bytes, iv_bytes, tag

    @classmethod
    def from_label(cls, label: str) -> Cipher:
        """The cipher named ``label`` ("aes-128-gcm", "aegis-128l"); SealedError if none is."""
        for c in cls:
            if c.label == label:
                return c
        raise SealedError(f"unknown sealed-record cipher {label[:40]!r}")

    def aead(self, key: bytes) -> Aead:
        if self is Cipher.AEGIS_128L:
            return aead_aegis.Aegis128L(key)
        return AESGCM(key)


def cipher_of_alpn(protocol: str) -> Cipher:
    """The cipher a sealed ALPN version uses."""
    return Cipher.AEGIS_128L if protocol == ALPN_SEALED_V3 else Cipher.AES_128_GCM


def checksum_sampled(layer: int, offset: int) -> bool:
    """Whether a chunk carries (and must match) its checksum under ``xdc-sealed/2``: a fixed
    function of the chunk's place, so both ends agree without a word, spread over layers and
    offsets alike (the top four bits of a multiplicative mix)."""
    return ((layer * _MIX_LAYER + offset * _MIX_OFFSET) & _MASK64) >> 60 == 0


class SealedError(RemoteConnectionError):
    """A record that must not be used: bad length, failed authentication, cut short."""


def _expand(secret: bytes, label: bytes, n: int) -> bytes:
    return HKDFExpand(hashes.SHA256(), n, _SALT + b" " + label).derive(secret)


def direction_secrets(client_share: bytes, server_share: bytes) -> tuple[bytes, bytes]:
    """(client->server, server->client) secrets from both sides' shares."""
    if len(client_share) != SHARE_BYTES or len(server_share) != SHARE_BYTES:
        raise SealedError(f"key shares must be {SHARE_BYTES} bytes")
    prk = HKDF(hashes.SHA256(), 64, _SALT, b"xdc-sealed/1 directions").derive(
        client_share + server_share
    )
    return prk[:32], prk[32:]


@dataclass(frozen=True, slots=True)
class KeyState:
    """Where one direction's keys stand: enough to go on sealing or opening elsewhere (a data
    worker process) and to take the direction back after (docs/data_workers.md)."""

    secret: bytes  # the current generation's secret
    generation: int
    seq: int  # records under the current key
    used: int  # plaintext bytes under the current key


class _Key:
    """One direction's key state: the AEAD, its IV, the record sequence and bytes under it."""

    def __init__(self, secret: bytes, rekey_bytes: int, cipher: Cipher) -> None:
        self.rekey_bytes = rekey_bytes
        self.cipher = cipher
        self.generation = 0
        self._install(secret)

    def state(self) -> KeyState:
        return KeyState(self.secret, self.generation, self.seq, self.used)

    def resume(self, st: KeyState) -> None:
        """Go on from ``st`` (this direction's own state, advanced elsewhere)."""
        if st.generation < self.generation or (
            st.generation == self.generation and st.secret != self.secret
        ):
            raise SealedError("record state handed back from an earlier key or another direction")
        if st.secret != self.secret:
            self._install(st.secret)
        self.generation, self.seq, self.used = st.generation, st.seq, st.used

    def _install(self, secret: bytes) -> None:
        self.secret = secret
        self.aead = self.cipher.aead(_expand(secret, b"key", self.cipher.key_bytes))
        iv = _expand(secret, b"iv", self.cipher.iv_bytes)
        self._iv_head = iv[:-8]
        self._iv_tail = int.from_bytes(iv[-8:], "big")
        self.seq = 0
        self.used = 0

    def nonce(self) -> bytes:
        return self._iv_head + (self._iv_tail ^ self.seq).to_bytes(8, "big")

    def advance(self, plaintext_bytes: int) -> None:
        self.seq += 1
        self.used += plaintext_bytes
        if self.used >= self.rekey_bytes or self.seq >= 1 << 40:
            self.generation += 1
            self._install(_expand(self.secret, b"key update", 32))


def sealed_size(plaintext_bytes: int, tag: int = TAG) -> int:
    """Bytes on the wire for one record of ``plaintext_bytes`` (with a ``tag``-byte tag)."""
    return HEADER.size + plaintext_bytes + tag


class _Direction:
    def __init__(
        self, secret: bytes, rekey_bytes: int = REKEY_BYTES, cipher: Cipher = Cipher.AES_128_GCM
    ) -> None:
        self._key = _Key(secret, rekey_bytes, cipher)
        self.cipher = cipher
        self.tag = cipher.tag

    @property
    def generation(self) -> int:
        """How many key updates this direction has gone through."""
        return self._key.generation

    @property
    def rekey_bytes(self) -> int:
        return self._key.rekey_bytes

    def key_state(self) -> KeyState:
        """Where this direction stands, to lend it for one job (``resume`` takes it back)."""
        return self._key.state()

    def resume(self, st: KeyState) -> None:
        """Go on from where a job that borrowed this direction left it."""
        self._key.resume(st)

    @classmethod
    def resumed(
        cls, st: KeyState, rekey_bytes: int = REKEY_BYTES, cipher: Cipher = Cipher.AES_128_GCM
    ) -> Self:
        """This direction as a job received it (in a data worker)."""
        d = cls(st.secret, rekey_bytes, cipher)
        d._key.generation = st.generation
        d._key.seq, d._key.used = st.seq, st.used
        return d


class Sealer(_Direction):
    """The sending direction of one connection."""

    def seal_into(self, plain: memoryview, out: memoryview) -> int:
        """Write one record for ``plain`` (1..RECORD_MAX bytes) at the start of ``out``;
        returns the bytes written (``sealed_size(len(plain))``)."""
        n = len(plain)
        if not 0 < n <= RECORD_MAX:
            raise ValueError(f"record plaintext must be 1..{RECORD_MAX} bytes, not {n}")
        header = HEADER.pack(n + self.tag)
        out[: HEADER.size] = header
        end = HEADER.size + n + self.tag
        self._key.aead.encrypt_into(self._key.nonce(), plain, header, out[HEADER.size : end])
        self._key.advance(n)
        return end


class Opener(_Direction):
    """The receiving direction of one connection."""

    def plaintext_length(self, header: bytes | memoryview) -> int:
        """The plaintext length a record header announces; SealedError if no honest sender
        could have written it (checked before any of the record is buffered)."""
        (ct_len,) = HEADER.unpack(header)
        n = int(ct_len) - self.tag
        if not 0 < n <= RECORD_MAX:
            raise SealedError(
                f"record length {ct_len} outside {self.tag + 1}..{RECORD_MAX + self.tag}"
            )
        return n

    def open_into(self, header: memoryview, body: memoryview, dest: memoryview) -> int:
        """Authenticate and decrypt one record (``body`` = ciphertext + tag) into ``dest``
        (exactly the plaintext length). On SealedError ``dest`` may hold unauthenticated
        bytes: the caller must drop the connection and not use them."""
        try:
            n: int = self._key.aead.decrypt_into(self._key.nonce(), body, header, dest)
        except InvalidTag:
            raise SealedError(
                "record failed authentication (tampered, replayed, reordered or corrupted)"
            ) from None
        self._key.advance(n)
        return n


__all__ = [
    "ALPN_SEALED",
    "ALPN_SEALED_V1",
    "ALPN_SEALED_V3",
    "ALPN_TLS",
    "HEADER",
    "RECORD_MAX",
    "REKEY_BYTES",
    "SAMPLE_EVERY",
    "SHARE_BYTES",
    "TAG",
    "TAG_MAX",
    "Cipher",
    "Opener",
    "SealedError",
    "Sealer",
    "checksum_sampled",
    "cipher_of_alpn",
    "direction_secrets",
    "sealed_size",
]
