"""AEGIS-128L (256-bit tags) from libsodium, as PyNaCl ships it: the cipher of sealed records
version 3, and the one that lets sealing use more than one core.

Why AEGIS-128L over the AES-128-GCM of versions 1 and 2, measured on the 2-core EPYC VM with
256 KiB records (``bench/aead_threads.py``):

- speed: 16 GB/s a core sealing or opening, against 10.5 for ``cryptography``'s AES-GCM
  (its bundled OpenSSL 4) and 3.1 for the system OpenSSL 3.0's through ctypes;
- cores: PyNaCl calls libsodium through cffi, which releases the GIL for the call, so two data
  threads seal 32 GB/s (2.0x); ``AESGCM.encrypt_into`` holds the GIL (0.98x on two threads);
- strength: a 128-bit key, 128-bit nonces and 256-bit tags (draft-irtf-cfrg-aegis-aead),
  no 2^32-record or 64 GiB-per-key bound of the kind GCM has.

The calls go through ``nacl._sodium`` (PyNaCl's cffi module) rather than
``nacl.bindings.crypto_aead_aegis128l_encrypt``, which returns a new ``bytes``: the record is
sealed straight into the output buffer and opened straight into its destination, as with AES-GCM.
The known-answer test in ``tests/protocol/test_sealed_records.py`` pins the cipher.

Same interface as ``AESGCM`` where ``aead_records`` uses it, and the same failure: a record
that does not authenticate raises ``InvalidTag``. Unlike GCM, libsodium writes no plaintext
for such a record (it zeroes ``out``), but callers must not rely on that.
"""

from __future__ import annotations

import functools
from typing import Any

from cryptography.exceptions import InvalidTag

from xdc.errors import ConfigurationError

KEY_BYTES = 16
NONCE_BYTES = 16
TAG_BYTES = 32
Buffer = bytes | bytearray | memoryview


class AegisUnavailable(ConfigurationError, RuntimeError):
    """PyNaCl (1.6 or later, whose libsodium has AEGIS-128L) is not importable: what this
    process was installed with cannot run ``tls.record_cipher = "aegis-128l"``."""


@functools.cache
def _sodium() -> tuple[Any, Any]:
    try:
        from nacl._sodium import ffi, lib  # type: ignore[import-not-found]
    except ImportError as e:
        raise AegisUnavailable(f"PyNaCl is not installed ({e})") from None
    if not hasattr(lib, "crypto_aead_aegis128l_encrypt"):
        raise AegisUnavailable("PyNaCl's libsodium has no AEGIS-128L (PyNaCl 1.6+ has)")
    if lib.sodium_init() < 0:
        raise AegisUnavailable("libsodium failed to initialise")
    if (
        lib.crypto_aead_aegis128l_keybytes(),
        lib.crypto_aead_aegis128l_npubbytes(),
        lib.crypto_aead_aegis128l_abytes(),
    ) != (KEY_BYTES, NONCE_BYTES, TAG_BYTES):
        raise AegisUnavailable("libsodium's AEGIS-128L has unexpected key, nonce or tag sizes")
    return ffi, lib


def available() -> bool:
    """Whether this process can seal AEGIS-128L records."""
    try:
        _sodium()
    except AegisUnavailable:
        return False
    return True


def unavailable_reason() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    try:
        _sodium()
    except AegisUnavailable as e:
        return str(e)
    return ""


class Aegis128L:
    """AEGIS-128L with a fixed key; ``encrypt_into`` / ``decrypt_into`` as ``AESGCM``'s
    (ciphertext followed by the 32-byte tag)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"AEGIS-128L takes a {KEY_BYTES}-byte key")
        self._ffi, self._lib = _sodium()
        self._key = bytes(key)

    def encrypt_into(self, nonce: bytes, data: Buffer, aad: Buffer, out: Buffer) -> int:
        """Seal ``data`` into ``out`` (exactly ``len(data) + 32`` bytes); the bytes written."""
        ffi = self._ffi
        src, dst, ad = memoryview(data), memoryview(out), memoryview(aad)
        n = len(src)
        if len(nonce) != NONCE_BYTES or len(dst) != n + TAG_BYTES or dst.readonly:
            raise ValueError("nonce must be 16 bytes and out writable, len(data) + 32 bytes")
        self._lib.crypto_aead_aegis128l_encrypt(
            ffi.from_buffer(dst),
            ffi.NULL,
            ffi.from_buffer(src),
            n,
            ffi.from_buffer(ad),
            len(ad),
            ffi.NULL,
            nonce,
            self._key,
        )
        return n + TAG_BYTES

    def decrypt_into(self, nonce: bytes, data: Buffer, aad: Buffer, out: Buffer) -> int:
        """Open ``data`` (ciphertext + tag) into ``out`` (exactly ``len(data) - 32`` bytes);
        the plaintext length. InvalidTag if it does not authenticate."""
        ffi = self._ffi
        src, dst, ad = memoryview(data), memoryview(out), memoryview(aad)
        n = len(src) - TAG_BYTES
        if len(nonce) != NONCE_BYTES or n < 0 or len(dst) != n or dst.readonly:
            raise ValueError("nonce must be 16 bytes and out writable, len(data) - 32 bytes")
        if self._lib.crypto_aead_aegis128l_decrypt(
            ffi.from_buffer(dst) if n else ffi.NULL,
            ffi.NULL,
            ffi.NULL,
            ffi.from_buffer(src),
            len(src),
            ffi.from_buffer(ad),
            len(ad),
            nonce,
            self._key,
        ):
            raise InvalidTag()
        return n
