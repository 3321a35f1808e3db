"""Record sealing in N threads: does it use N cores? (issue 30: sealed records in data threads)

Sealed records seal and open each 256 KiB record in the connection's data thread. Whether
that scales with cores depends on the AEAD call releasing the GIL. Three backends, 256 KiB
records:

* ``cryptography`` (``AESGCM.encrypt_into``, xdc-sealed/2's AES-128-GCM): its own OpenSSL,
  fast on one core, but the call holds the GIL;
* ``libcrypto`` (the same AES-128-GCM from the system OpenSSL's EVP interface through ctypes,
  which drops the GIL around every foreign call; its output checked against ``cryptography``);
* ``aegis128l`` (xdc-sealed/3's AEGIS-128L, ``xdc.protocol.aead_aegis``: libsodium through
  PyNaCl's cffi, which releases the GIL too).

Reports aggregate GB/s per thread count and the speedup over one thread, medians of repeats.

    python bench/aead_threads.py [--threads 1,2,4,8,16] [--seconds 1] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from xdc.protocol import aead_aegis

RECORD = 256 * 1024
TAG = 16
EVP_CTRL_GCM_GET_TAG = 0x10


class EvpSealer:
    """AES-128-GCM sealing through libcrypto's EVP calls (one context per thread)."""

    def __init__(self, lib: ctypes.CDLL, key: bytes) -> None:
        self.lib, self.key = lib, key
        self.ctx = lib.EVP_CIPHER_CTX_new()
        if not self.ctx or not lib.EVP_EncryptInit_ex(
            self.ctx, lib.EVP_aes_128_gcm(), None, key, None
        ):
            raise RuntimeError("EVP_EncryptInit_ex failed")
        self._n = ctypes.c_int()

    def seal_into(self, nonce: bytes, plain: bytearray, out: bytearray) -> None:
        lib, n = self.lib, len(plain)
        src = (ctypes.c_char * n).from_buffer(plain)
        dst = (ctypes.c_char * (n + TAG)).from_buffer(out)
        ok = (
            lib.EVP_EncryptInit_ex(self.ctx, None, None, None, nonce)
            and lib.EVP_EncryptUpdate(self.ctx, dst, ctypes.byref(self._n), src, n)
            and lib.EVP_EncryptFinal_ex(self.ctx, None, ctypes.byref(self._n))
            and lib.EVP_CIPHER_CTX_ctrl(
                self.ctx, EVP_CTRL_GCM_GET_TAG, TAG, ctypes.addressof(dst) + n
            )
        )
        if not ok:
            raise RuntimeError("EVP sealing failed")


def load_libcrypto() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("crypto")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    vp, ip, i = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int
    lib.EVP_CIPHER_CTX_new.restype = vp
    lib.EVP_aes_128_gcm.restype = vp
    lib.EVP_EncryptInit_ex.argtypes = [vp, vp, vp, ctypes.c_char_p, ctypes.c_char_p]
    lib.EVP_EncryptUpdate.argtypes = [vp, vp, ip, vp, i]
    lib.EVP_EncryptFinal_ex.argtypes = [vp, vp, ip]
    lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, i, i, vp]
    return lib


Sealer = Callable[[bytes, bytearray, bytearray], object]


def sealer_of(backend: str, key: bytes, lib: ctypes.CDLL | None) -> Sealer:
    if backend == "cryptography":
        aead = AESGCM(key)
        return lambda nonce, plain, out: aead.encrypt_into(nonce, plain, b"", out)
    if backend == "aegis128l":
        aegis = aead_aegis.Aegis128L(key)
        return lambda nonce, plain, out: aegis.encrypt_into(nonce + bytes(4), plain, b"", out)
    assert lib is not None
    return EvpSealer(lib, key).seal_into


def aggregate_gbps(backend: str, threads: int, seconds: float, lib: ctypes.CDLL | None) -> float:
    """GB/s sealed by ``threads`` threads together, each with its own key and buffers."""
    done = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def work(i: int) -> None:
        seal = sealer_of(backend, os.urandom(16), lib)
        tag = aead_aegis.TAG_BYTES if backend == "aegis128l" else TAG
        plain, out = bytearray(os.urandom(RECORD)), bytearray(RECORD + tag)
        start.wait()
        k = 0
        while not stop.is_set():
            seal(k.to_bytes(12, "big"), plain, out)
            k += 1
        done[i] = k

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()
    return sum(done) * RECORD / (time.perf_counter() - t0) / 1e9


def interop(lib: ctypes.CDLL) -> None:
    """A record libcrypto sealed opens with ``cryptography``: the same AES-GCM."""
    key, nonce = os.urandom(16), os.urandom(12)
    plain, out = bytearray(os.urandom(RECORD)), bytearray(RECORD + TAG)
    EvpSealer(lib, key).seal_into(nonce, plain, out)
    if AESGCM(key).decrypt(nonce, bytes(out), b"") != bytes(plain):
        raise SystemExit("libcrypto and cryptography disagree: not measuring")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0))
    ap.add_argument(
        "--threads",
        default=",".join(str(n) for n in (1, 2, 4, 8, 16) if n <= cores),
        help="thread counts (default: powers of two up to the usable cores)",
    )
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    counts = [int(x) for x in a.threads.split(",") if x.strip()]
    lib = load_libcrypto()
    backends = ["cryptography"]
    if lib is None:
        print("no libcrypto found: cryptography only", file=sys.stderr)
    else:
        interop(lib)
        backends.append("libcrypto")
    if aead_aegis.available():
        backends.append("aegis128l")
    else:
        print(f"no AEGIS-128L: {aead_aegis.unavailable_reason()}", file=sys.stderr)
    import ssl

    from cryptography.hazmat.bindings._rust import openssl as rust_openssl

    out: dict[str, object] = {
        "machine": f"{cores} cores, {platform.processor() or platform.machine()}",
        "cryptography_openssl": rust_openssl.openssl_version_text(),
        "libcrypto": ssl.OPENSSL_VERSION if lib is not None else None,
        "record_bytes": RECORD,
        "results": {},
    }
    results: dict[str, dict[int, float]] = {b: {} for b in backends}
    for n in counts:
        for b in backends:
            runs = [aggregate_gbps(b, n, a.seconds, lib) for _ in range(a.repeats)]
            results[b][n] = statistics.median(runs)
    print(f"{'threads':>8}" + "".join(f"{b:>26}" for b in backends))
    for n in counts:
        row = f"{n:>8}"
        for b in backends:
            g = results[b][n]
            row += f"{g:>14.2f} GB/s ({g / results[b][counts[0]]:4.2f}x)"
        print(row)
    out["results"] = {b: {str(n): round(g, 3) for n, g in r.items()} for b, r in results.items()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
