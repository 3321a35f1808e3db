"""A synthetic prefill engine shaped like the PrfaaS case-study model (Kimi-Linear-style hybrid).

Sizes and timing come from the paper's Table 5 (1T hybrid model, 8xH200 per instance):
KV bytes and prefill seconds at 1K/8K/32K/128K tokens, interpolated piecewise-linearly. The KV
splits into a fixed per-request state (the linear-attention layers: ~174 MiB, the intercept of
Table 5) and a part that grows with length (the full-attention layers, 1 in 4). Layers are
produced one by one at the pace of prefill, so the transport sees the real layer-wise shape.
Bytes are pseudo-random but reproducible from (rid, layer), so the decode side can check every
byte end to end, independently of the protocol's own chunk checksums.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

MIB = 1024 * 1024
# PrfaaS Table 5: sequence length -> (KV size MiB, prefill seconds on 8xH200)
TABLE5: tuple[tuple[int, float, float], ...] = (
    (1024, 190.8, 0.44),
    (8192, 308.9, 0.72),
    (32768, 701.3, 1.84),
    (131072, 2316.3, 7.40),
)
# Workload of the case study: input length ~ truncated log-normal(mu=9.90, sigma=1.00)
LOGNORMAL_MU, LOGNORMAL_SIGMA, MIN_LEN, MAX_LEN = 9.90, 1.00, 128, 131072


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def kv_mib(length: int) -> float:
    return _interp(length, [r[0] for r in TABLE5], [r[1] for r in TABLE5])


def prefill_s(length: int) -> float:
    return _interp(length, [r[0] for r in TABLE5], [r[2] for r in TABLE5])


STATE_MIB = kv_mib(0)  # fixed-size part: the intercept of Table 5's first segment


@dataclass(frozen=True)
class SyntheticRequest:
    rid: str
    prompt_tokens: int
    layer_sizes: tuple[int, ...]
    layer_seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_sizes)


def layer_sizes(length: int, layers: int, scale: float, full_every: int = 4) -> tuple[int, ...]:
    """Split one request's KV over layers: 1 in ``full_every`` layers hold the growing
    full-attention KV, the rest hold equal shares of the fixed linear-attention state."""
    total = kv_mib(length) * MIB * scale
    state = min(total, STATE_MIB * MIB * scale)
    n_full = max(1, layers // full_every)
    n_lin = layers - n_full
    grow = total - state if n_lin else total
    sizes = []
    for i in range(layers):
        full = (i % full_every) == full_every - 1 or n_lin == 0
        share = grow / n_full if full else state / max(1, n_lin)
        sizes.append(max(1, int(share)))
    return tuple(sizes)


def sample_lengths(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        x = rng.lognormal(LOGNORMAL_MU, LOGNORMAL_SIGMA)
        if MIN_LEN <= x <= MAX_LEN:
            out.append(int(x))
    return out


def make_requests(
    n: int, *, layers: int = 48, scale: float = 0.05, time_scale: float | None = None, seed: int = 1
) -> list[SyntheticRequest]:
    """``scale`` shrinks KV bytes; prefill time shrinks by ``time_scale`` (default: the same
    factor, which keeps the per-instance KV production rate of Table 5, ~3 Gbit/s)."""
    ts = scale if time_scale is None else time_scale
    reqs = []
    for i, length in enumerate(sample_lengths(n, seed)):
        reqs.append(
            SyntheticRequest(
                rid=f"demo-{seed}-{i:05d}",
                prompt_tokens=length,
                layer_sizes=layer_sizes(length, layers, scale),
                layer_seconds=prefill_s(length) * ts / layers,
            )
        )
    return reqs


_SPAN = 2 << 20
_BASE = np.random.default_rng(12345).integers(0, 256, size=2 * _SPAN, dtype=np.uint8)


def fill_layer(out: npt.NDArray[np.uint8], rid: str, layer: int) -> None:
    """Reproducible bytes for (rid, layer): a window of a random base picked and xored by a
    per-(rid, layer) key. Runs at memory speed so the engine, not this, sets the pace."""
    key = int.from_bytes(
        hashlib.blake2b(f"{rid}/{layer}".encode(), digest_size=8).digest(), "little"
    )
    shift = key % _SPAN
    n = out.size
    pos = 0
    while pos < n:
        k = min(n - pos, _SPAN)
        out[pos : pos + k] = _BASE[shift : shift + k]
        pos += k
    words = n // 8
    if words:
        w = out[: words * 8].view(np.uint64)
        np.bitwise_xor(w, np.uint64(key), out=w)
    for i in range(words * 8, n):
        out[i] ^= (key >> (8 * (i % 8))) & 0xFF


def layer_digest(data: npt.NDArray[np.uint8] | memoryview) -> int:
    view = data.data if isinstance(data, np.ndarray) else data
    return int(xxhash.xxh3_64_intdigest(view))


def expected_digest(rid: str, layer: int, size: int) -> int:
    buf = np.empty(size, dtype=np.uint8)
    fill_layer(buf, rid, layer)
    return layer_digest(buf)
