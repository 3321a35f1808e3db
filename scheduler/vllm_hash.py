"""vLLM's prefix-cache block hash, computed the way the engine computes it.

A router can find a prompt that a vLLM instance has cached only if it names the prompt's blocks
exactly as that instance does in its KV events. vLLM (0.32) keys block i as
``hash_fn((parent_digest, tuple(block_token_ids), extra_keys))`` with the first block's parent
``NONE_HASH = hash_fn(seed)``; ``hash_fn`` is the engine's ``prefix_caching_hash_algo``
(``sha256``: SHA-256 over the pickled tuple, the default; ``sha256_cbor``: over canonical
CBOR), and ``seed`` is ``PYTHONHASHSEED`` when the engine has it set, else the fixed string
``"vllm-none-hash"``. The 64-bit key the index stores is what vLLM publishes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the digest read big-endian, low 64 bits.

Requests that carry extra keys (LoRA, multimodal inputs, ``cache_salt``) hash differently in the
engine; this scheme keys plain token prompts only, so such prompts simply find no prefix, which
is the isolation the salt asks for. The xxhash algorithms are refused unless a seed is given:
vLLM seeds them randomly per process, so nobody outside the engine can reproduce them.

``tests/scheduler/test_vllm_events.py`` checks these keys against vLLM's own ``hash_block_tokens``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xdc.config_entries import VLLM_HASH_ALGOS, check_vllm_hash

DEFAULT_SEED = "vllm-none-hash"
_MASK = (1 << 64) - 1


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError:  # pragma: no cover - the vllm-events extra brings it
        raise ValueError(
            "vllm_hash_algo *_cbor needs the cbor2 package (pip install 'xdc[vllm-events]')"
        ) from None
    out: bytes = cbor2.dumps(obj, canonical=True)
    return out


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name`` for the algorithms a router can reproduce."""
    if algo == "sha256":
        return lambda obj: hashlib.sha256(_pickled(obj)).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(_cbor(obj)).digest()
    if algo in ("xxhash", "xxhash_cbor"):
        import xxhash

        ser = _pickled if algo == "xxhash" else _cbor
        return lambda obj: xxhash.xxh3_128_digest(ser(obj))
    raise ValueError(f"vllm_hash_algo: {algo!r} is not one of {', '.join(VLLM_HASH_ALGOS)}")


def external_key(engine_hash: bytes | int) -> int:
    """The 64-bit index key of a block hash as a vLLM KV event carries it (bytes, or an int
    when the engine runs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    if isinstance(engine_hash, bytes):
        return int.from_bytes(engine_hash, "big") & _MASK
    return engine_hash & _MASK


@dataclass(frozen=True)
class VllmBlockHash:
    """The ``KeyScheme`` of vLLM instances that share one algorithm, seed and block size."""

    block_size: int
    algo: str = "sha256"
    seed: str = ""
    name: str = "vllm"
    _fn: Callable[[Any], bytes] = field(init=False, repr=False, compare=False)
    _none: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        check_vllm_hash(self.algo, self.seed)
        fn = hash_function(self.algo)
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_none", fn(self.seed or DEFAULT_SEED))

    def digests(self, token_ids: Sequence[int]) -> list[bytes]:
        """The engine's full block hash of every full block of ``token_ids``."""
        out: list[bytes] = []
        parent = self._none
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            parent = self._fn((parent, tuple(token_ids[i * bs : (i + 1) * bs]), None))
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        return [external_key(d) for d in self.digests(token_ids)]

    def describe(self) -> dict[str, object]:
        """What a gateway needs to compute the same keys (``scheme_from``)."""
        return {
            "name": self.name,
            "kind": "vllm",
            "block_size": self.block_size,
            "algo": self.algo,
            "seed": self.seed,
        }
