"""Sealed records (xdc.protocol.aead_records), without sockets: what a record carries, what
makes one fail to open, and that both ends move to the next key at the same record; each for
both ciphers (AES-128-GCM, AEGIS-128L), and AEGIS-128L pinned by the spec's test vector."""

from __future__ import annotations

import os

import pytest
from cryptography.exceptions import InvalidTag

from xdc.protocol.aead_aegis import Aegis128L
from xdc.protocol.aead_records import (
    ALPN_SEALED,
    ALPN_SEALED_V1,
    ALPN_SEALED_V3,
    HEADER,
    RECORD_MAX,
    SHARE_BYTES,
    TAG,
    Cipher,
    Opener,
    SealedError,
    Sealer,
    cipher_of_alpn,
    direction_secrets,
    sealed_size,
)


@pytest.fixture(params=list(Cipher), ids=lambda c: c.label)
def cipher(request: pytest.FixtureRequest) -> Cipher:
    """A test that takes it runs once per cipher."""
    c: Cipher = request.param
    return c


def _pair(cipher: Cipher, rekey_bytes: int = 1 << 34) -> tuple[Sealer, Opener, Sealer, Opener]:
    """(client sealer, server opener, server sealer, client opener) from fresh shares."""
    c2s, s2c = direction_secrets(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
    return (
        Sealer(c2s, rekey_bytes, cipher),
        Opener(c2s, rekey_bytes, cipher),
        Sealer(s2c, rekey_bytes, cipher),
        Opener(s2c, rekey_bytes, cipher),
    )


def _seal(sealer: Sealer, plain: bytes) -> bytes:
    out = bytearray(sealed_size(len(plain), sealer.tag))
    assert sealer.seal_into(memoryview(plain), memoryview(out)) == len(out)
    return bytes(out)


def _open(opener: Opener, record: bytes) -> bytes:
    view = memoryview(record)
    n = opener.plaintext_length(view[: HEADER.size])
    dest = bytearray(n)
    assert opener.open_into(view[: HEADER.size], view[HEADER.size :], memoryview(dest)) == n
    return bytes(dest)


def test_records_round_trip_in_order_and_hide_the_plaintext(cipher: Cipher) -> None:
    tx, rx, _, _ = _pair(cipher)
    msgs = [os.urandom(n) for n in (1, 17, 4096, RECORD_MAX)]
    records = [_seal(tx, m) for m in msgs]
    for m, r in zip(msgs, records, strict=True):
        assert len(r) == HEADER.size + len(m) + cipher.tag
        if len(m) >= 16:
            assert m[:16] not in r  # the payload does not travel in the clear
        assert _open(rx, r) == m


def test_same_plaintext_twice_gives_different_records(cipher: Cipher) -> None:
    tx, _, _, _ = _pair(cipher)
    plain = b"\x00" * 4096
    assert _seal(tx, plain) != _seal(tx, plain)  # the sequence number is in the nonce


@pytest.mark.parametrize("where", ["header", "ciphertext", "tag"])
def test_any_flipped_bit_fails_authentication(cipher: Cipher, where: str) -> None:
    tx, rx, _, _ = _pair(cipher)
    record = bytearray(_seal(tx, os.urandom(1000)))
    pos = {"header": 3, "ciphertext": HEADER.size + 500, "tag": len(record) - 1}[where]
    if where == "header":  # a length still in range, so it is the tag that refuses it
        record[pos] ^= 0x01
        record.extend(b"\x00")
    else:
        record[pos] ^= 0x01
    with pytest.raises(SealedError, match="authentication"):
        _open(rx, bytes(record))


def test_replayed_dropped_or_reordered_records_fail(cipher: Cipher) -> None:
    tx, rx, _, _ = _pair(cipher)
    r0, r1, r2 = (_seal(tx, bytes([i]) * 100) for i in range(3))
    assert _open(rx, r0) == b"\x00" * 100
    with pytest.raises(SealedError):
        _open(rx, r0)  # replay of the previous record
    tx2, rx2, _, _ = _pair(cipher)
    s0, s1 = _seal(tx2, b"a" * 10), _seal(tx2, b"b" * 10)
    with pytest.raises(SealedError):
        _open(rx2, s1)  # s0 dropped, or the two swapped
    del r1, r2, s0


def test_a_record_from_the_other_direction_or_another_connection_fails(cipher: Cipher) -> None:
    tx, rx, rtx, _ = _pair(cipher)
    with pytest.raises(SealedError):
        _open(rx, _seal(rtx, b"x" * 64))  # server->client record fed back to the server
    other_tx, _, _, _ = _pair(cipher)
    with pytest.raises(SealedError):
        _open(rx, _seal(other_tx, b"x" * 64))
    assert _open(rx, _seal(tx, b"ok")) == b"ok"  # a failed open does not move the sequence


@pytest.mark.parametrize("case", ["empty", "one byte", "tag only", "over the max", "2^32-1"])
def test_lengths_no_honest_sender_writes_are_refused_from_the_header(
    cipher: Cipher, case: str
) -> None:
    _, rx, _, _ = _pair(cipher)
    ct_len = {
        "empty": 0,
        "one byte": 1,
        "tag only": rx.tag,
        "over the max": RECORD_MAX + rx.tag + 1,
        "2^32-1": 0xFFFFFFFF,
    }[case]
    with pytest.raises(SealedError, match="record length"):
        rx.plaintext_length(HEADER.pack(ct_len))


def test_sealer_refuses_empty_and_oversized_plaintext(cipher: Cipher) -> None:
    tx, _, _, _ = _pair(cipher)
    out = memoryview(bytearray(sealed_size(RECORD_MAX + 1, tx.tag)))
    for n in (0, RECORD_MAX + 1):
        with pytest.raises(ValueError):
            tx.seal_into(memoryview(bytes(n)), out)


def test_both_ends_move_to_the_next_key_at_the_same_record(cipher: Cipher) -> None:
    tx, rx, _, _ = _pair(cipher, rekey_bytes=10_000)
    for i in range(25):
        plain = os.urandom(1000 + i)
        assert _open(rx, _seal(tx, plain)) == plain
    assert tx.generation == rx.generation >= 2
    # the key really changes: an opener that did not move with it cannot open the next record
    c2s, _ = direction_secrets(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
    moving = Sealer(c2s, rekey_bytes=10_000, cipher=cipher)
    staying = Opener(c2s, rekey_bytes=1 << 34, cipher=cipher)
    first = os.urandom(10_000)
    assert _open(staying, _seal(moving, first)) == first  # sealed under key 0
    assert moving.generation == 1 and staying.generation == 0
    with pytest.raises(SealedError):
        _open(staying, _seal(moving, b"next"))


def test_key_shares_must_be_full_length() -> None:
    with pytest.raises(SealedError):
        direction_secrets(b"short", os.urandom(SHARE_BYTES))
    a, b = os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES)
    assert direction_secrets(a, b) == direction_secrets(a, b)
    assert direction_secrets(a, b) != direction_secrets(b, a)
    c2s, s2c = direction_secrets(a, b)
    assert c2s != s2c


def test_checksum_sample_picks_about_one_chunk_in_sixteen_across_layers_and_offsets() -> None:
    from xdc.protocol.aead_records import SAMPLE_EVERY, checksum_sampled

    picks = [checksum_sampled(layer, k << 21) for layer in range(64) for k in range(128)]
    assert abs(sum(picks) / len(picks) - 1 / SAMPLE_EVERY) < 0.01
    # every layer and every offset column gets some: a bug at one place cannot hide for long
    assert (
        sum(any(checksum_sampled(layer, k << 21) for k in range(128)) for layer in range(64)) > 60
    )
    assert checksum_sampled(0, 0) and checksum_sampled(3, 7 << 21) == checksum_sampled(3, 7 << 21)


def test_aegis_128l_matches_the_specs_test_vector() -> None:
    """draft-irtf-cfrg-aegis-aead, AEGIS-128L test vector 1 (256-bit tag)."""
    aead = Aegis128L(bytes.fromhex("10010000000000000000000000000000"))
    out = bytearray(16 + 32)
    nonce = bytes.fromhex("10000200000000000000000000000000")
    assert aead.encrypt_into(nonce, bytes(16), b"", out) == 48
    assert out.hex() == (
        "c1c0e58bd913006feba00f4b3cc3594e"
        "25835bfbb21632176cf03840687cb968cace4617af1bd0f7d064c639a5c79ee4"
    )
    plain = bytearray(16)
    out[0] ^= 1
    with pytest.raises(InvalidTag):
        aead.decrypt_into(nonce, out, b"", plain)
    out[0] ^= 1
    assert aead.decrypt_into(nonce, out, b"", plain) == 16 and plain == bytes(16)


def test_a_record_sealed_with_one_cipher_does_not_open_with_the_other(cipher: Cipher) -> None:
    c2s, _ = direction_secrets(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
    other = next(c for c in Cipher if c is not cipher)
    record = _seal(Sealer(c2s, cipher=cipher), os.urandom(5000))
    with pytest.raises(SealedError):
        _open(Opener(c2s, cipher=other), record)


def test_the_alpn_version_names_the_cipher() -> None:
    assert cipher_of_alpn(ALPN_SEALED_V3) is Cipher.AEGIS_128L
    assert cipher_of_alpn(ALPN_SEALED) is cipher_of_alpn(ALPN_SEALED_V1) is Cipher.AES_128_GCM
    assert Cipher.AES_128_GCM.tag == TAG and Cipher.AEGIS_128L.tag == 32
