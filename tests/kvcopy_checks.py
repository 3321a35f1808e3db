"""The KV block copier against the views vLLM 0.32 itself builds, one per KVCacheLayout.

Run by ``tests/integrations/test_kv_copy.py`` with the vLLM venv's Python (torch and vLLM live
there, not in the test runner's): it builds each layout's per-layer views with vLLM's own
``create_kv_cache_views``, copies blocks out and back with ``xdc.integrations.kvcopy`` and
prints one JSON line per case: ``{"case": ..., "ok": bool, "detail": ...}``. The comparisons
are of bytes (uint8 views), so random bit patterns that are NaN compare exactly too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from xdc.integrations.kvcopy import (
    KNOWN_LAYOUTS,
    NULL_BLOCK,
    BlockShape,
    CpuCopier,
    IndexPlans,
    block_shape,
    copier_for,
    same_bytes,
)

LAYERS = 3
NUM_BLOCKS = 24
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
results: list[dict[str, Any]] = []


def case(name: str) -> Callable[[Callable[[], str | None]], None]:
    def run(fn: Callable[[], str | None]) -> None:
        try:
            why = fn()
        except Exception as e:  # a crash is a failed case, with its reason
            why = f"{type(e).__name__}: {e}"
        results.append({"case": name, "ok": why is None, "detail": why or ""})

    return run


def views(layout_name: str, seed: int, kernel_block: int | None = None) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] views over one backing buffer, as vLLM builds them."""
    layout = KVCacheLayout[layout_name]
    strides = compute_layout_strides(SPEC, NUM_BLOCKS, LAYERS, layout)  # manager blocks
    size = SPEC.page_size_bytes * NUM_BLOCKS * LAYERS
    kct = KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(LAYERS)],
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=g)
    views: list[Any] = create_kv_cache_views(raw, SPEC, NUM_BLOCKS, layout, kct, kernel_block)
    return views


def block_bytes(t: torch.Tensor, shape: BlockShape, b: int) -> torch.Tensor:
    rows = t[b * shape.rows : (b + 1) * shape.rows]
    return rows.contiguous().view(-1).view(torch.uint8)


def pool(nbytes: int, fill: int = 0xA5) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8)


def check_save(
    layout: str, ids: tuple[int, ...], first: int, kernel: int | None = None
) -> str | None:
    src = views(layout, 1, kernel)
    cp = CpuCopier()
    for li, t in enumerate(src):
        shape = block_shape(t, NUM_BLOCKS, layout)
        if isinstance(shape, str):
            return shape
        bb = shape.block_bytes
        out = pool((first + len(ids) + 1) * bb)
        before = out.clone()
        copy = cp.save(t, shape, ids, out, first)
        if not copy.done():
            return "a CPU copy is not done when it returns"
        for j, b in enumerate(ids):
            at = (first + j) * bb
            got = out[at : at + bb]
            if b == NULL_BLOCK:
                if not torch.equal(got, before[at : at + bb]):
                    return f"layer {li}: the null block's place was written"
                continue
            if not torch.equal(got, block_bytes(t, shape, b)):
                return f"layer {li}: block {b} at position {first + j} differs"
        if not torch.equal(out[: first * bb], before[: first * bb]):
            return f"layer {li}: bytes before position {first} were written"
        end = (first + len(ids)) * bb
        if not torch.equal(out[end:], before[end:]):
            return f"layer {li}: bytes after the last block were written"
    return None


def check_round_trip(src_layout: str, dst_layout: str) -> str | None:
    """Blocks saved from one layout land, block for block, in another (the wire carries a
    block's elements in logical order)."""
    src, dst = views(src_layout, 2), views(dst_layout, 3)
    untouched = [d.clone() for d in dst]
    src_ids = (9, 10, 11, 3, 20, 21)
    dst_ids = (4, 5, 17, 18, 19, 7)
    cp = CpuCopier()
    for li, (s, d) in enumerate(zip(src, dst, strict=True)):
        ss, ds = block_shape(s, NUM_BLOCKS, src_layout), block_shape(d, NUM_BLOCKS, dst_layout)
        if isinstance(ss, str) or isinstance(ds, str):
            return f"refused: {ss if isinstance(ss, str) else ds}"
        if ss.block_bytes != ds.block_bytes:
            return f"block bytes differ between layouts: {ss.block_bytes} vs {ds.block_bytes}"
        buf = pool(len(src_ids) * ss.block_bytes)
        cp.save(s, ss, src_ids, buf, 0)
        cp.load(d, ds, dst_ids, buf, 0)
        for a, b in zip(src_ids, dst_ids, strict=True):
            if not torch.equal(block_bytes(d, ds, b), block_bytes(s, ss, a)):
                return f"layer {li}: block {a} did not land as block {b}"
        for b in range(NUM_BLOCKS):
            if b not in dst_ids and not torch.equal(
                block_bytes(d, ds, b), block_bytes(untouched[li], ds, b)
            ):
                return f"layer {li}: block {b}, not a target, changed"
    return None


def check_load_partial(layout: str) -> str | None:
    """A later chunk's blocks (``first`` > 0) with a null block among them: only the kept
    blocks are written, from their own positions."""
    dst = views(layout, 4)
    before = [d.clone() for d in dst]
    ids = (6, NULL_BLOCK, 8, 13)
    first = 5
    cp = CpuCopier()
    for li, d in enumerate(dst):
        shape = block_shape(d, NUM_BLOCKS, layout)
        if isinstance(shape, str):
            return shape
        bb = shape.block_bytes
        g = torch.Generator().manual_seed(li)
        buf = torch.randint(0, 256, ((first + len(ids)) * bb,), dtype=torch.uint8, generator=g)
        cp.load(d, shape, ids, buf, first)
        for j, b in enumerate(ids):
            if b == NULL_BLOCK:
                continue
            at = (first + j) * bb
            if not torch.equal(block_bytes(d, shape, b), buf[at : at + bb]):
                return f"layer {li}: block {b} does not hold position {first + j}'s bytes"
        for b in range(NUM_BLOCKS):
            if b not in ids and not torch.equal(
                block_bytes(d, shape, b), block_bytes(before[li], shape, b)
            ):
                return f"layer {li}: block {b}, not a target, changed"
    return None


def refusals() -> str | None:
    expect: dict[str, object] = {
        "a list": block_shape([1, 2], 4),
        "1-D": block_shape(torch.zeros(8), 8),
        "(2, B, ...)": block_shape(torch.zeros(2, 40, 4, 16), 40),
        "unknown layout": block_shape(torch.zeros(40, 4, 16), 40, "NHD"),
        "meta device": block_shape(torch.zeros(40, 4, device="meta"), 40),
        "two devices": copier_for([torch.zeros(1), torch.zeros(1, device="meta")]),
    }
    for what, got in expect.items():
        if not isinstance(got, str):
            return f"{what} was accepted: {got}"
    named = str(expect["unknown layout"])
    if "NHD" not in named:
        return f"the refusal does not name the layout: {named}"
    if "(2)" not in str(expect["(2, B, ...)"]):
        return f"the refusal does not say what the first dimension was: {expect['(2, B, ...)']}"
    return None


def same_bytes_sees_one_flipped_byte() -> str | None:
    """The GPU load's placement check (``same_bytes``) on CPU tensors: word-sized and odd
    sizes, equal and with one byte flipped anywhere, and a bf16 NaN payload (compared as bytes,
    not as numbers, so NaN == NaN and -0 != +0)."""
    for n in (64 * 1024, 8, 7, 13):
        a = torch.randint(0, 256, (n,), dtype=torch.uint8)
        if not bool(same_bytes(a, a.clone()).item()):
            return f"{n} equal bytes compared unequal"
        for at in {0, n // 2, n - 1}:
            b = a.clone()
            b[at] ^= 0x01
            if bool(same_bytes(a, b).item()):
                return f"a flipped byte at {at} of {n} went unseen"
    nan = torch.full((4, 16), float("nan"), dtype=torch.bfloat16)
    if not bool(same_bytes(nan, nan.clone()).item()):
        return "identical NaN blocks compared unequal"
    if bool(same_bytes(torch.zeros(8), -torch.zeros(8)).item()):
        return "+0 and -0 compared equal"
    return None


def plans_are_made_once_per_id_list() -> str | None:
    """Every layer copied with the same block ids shares one plan (the index tensors are
    made once, not per layer); a kernel-block split of the same ids is a plan of its own; the
    least recently used plan is the one dropped, and one asked for again is made again, the
    same."""
    src = views("LBHNC", 5)
    cp = CpuCopier()
    ids = (17, 2, NULL_BLOCK, 9, 10, 23)
    for t in src:
        shape = block_shape(t, NUM_BLOCKS, "LBHNC")
        if isinstance(shape, str):
            return shape
        cp.save(t, shape, ids, pool((len(ids) + 1) * shape.block_bytes), 0)
        cp.load(t, shape, ids, pool((len(ids) + 1) * shape.block_bytes), 0)
    if cp.plans.built != 1:
        return f"{LAYERS} layers' saves and loads of one id list made {cp.plans.built} plans"
    if cp.plans.get(ids, 2) is cp.plans.get(ids, 1):
        return "two rows per block shared the plan of one row per block"
    lru = IndexPlans(lambda lists: ([torch.tensor(r, dtype=torch.long) for r in lists], None), 2)
    a, b, c = (3, 4, 9), (5, 6), (7, NULL_BLOCK, 8)
    first_a = lru.get(a, 1)
    lru.get(b, 1)
    if lru.get(a, 1) is not first_a:
        return "a plan in the cache was made again"
    lru.get(c, 1)  # evicts b, the least recently used
    built = lru.built
    if lru.get(a, 1) is not first_a or lru.built != built:
        return "the most recently used plan was dropped"
    again = lru.get(b, 1)
    if lru.built != built + 1:
        return "a dropped plan was not made again"
    want = [(0, [5, 6])]
    if again.stretches != want or [i.tolist() for i in again.index] != [[5, 6]]:
        return f"the plan made again differs: {again.stretches} {again.index}"
    split = lru.get(c, 2)
    if split.stretches != [(0, [14, 15]), (2, [16, 17])]:
        return f"null block or rows per block wrong in the plan: {split.stretches}"
    return None


def main() -> int:
    for name in KNOWN_LAYOUTS:
        case(f"save_contiguous[{name}]")(partial(check_save, name, tuple(range(5, 13)), 0))
        case(f"save_scattered_with_null[{name}]")(
            partial(check_save, name, (17, 2, NULL_BLOCK, 9, 10, 23), 3)
        )
        case(f"round_trip_from_LBHNC[{name}]")(partial(check_round_trip, "LBHNC", name))
        case(f"round_trip_to_LBNHC[{name}]")(partial(check_round_trip, name, "LBNHC"))
        case(f"load_partial[{name}]")(partial(check_load_partial, name))
    # a manager block split into kernel blocks (layer-compact layouts only, as vLLM allows)
    case("save_kernel_blocks[LBHNC]")(lambda: check_save("LBHNC", (3, 4, 11), 1, kernel=8))
    case("refusals_name_what_they_found")(refusals)
    case("same_bytes_sees_one_flipped_byte")(same_bytes_sees_one_flipped_byte)
    case("plans_are_made_once_per_id_list")(plans_are_made_once_per_id_list)
    case("cpu_tensors_get_the_cpu_copier")(
        lambda: (
            None
            if isinstance(copier_for([torch.zeros(2)]), CpuCopier)
            else "no CpuCopier for CPU tensors"
        )
    )
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
