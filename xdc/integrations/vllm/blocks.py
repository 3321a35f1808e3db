"""Which KV blocks of a request move when: pure bookkeeping, tested without vLLM.

A model's KV cache comes in groups (vLLM's ``kv_cache_groups``): a dense model has one group of
full attention; a hybrid model has several, of several kinds. Each group moves what its kind
needs (``GroupKind``), so a transfer carries one xdc layer per vLLM layer, sized by its group:

- full attention (and MLA's latent KV): every block of the prompt;
- sliding window: only the trailing blocks the window still reads;
- linear attention / SSM state: one block, the request's running state (conv and recurrent
  state), final only once the whole prompt is computed.

A state can not be rewound: vLLM recomputes the last prompt token on the decode side (to sample
the first output token), and a state that already holds that token would take it twice. So with
a state group the producer prefills all but the last token and the consumer loads that much
(``KvPlan.backoff``), as vLLM's own NIXL connector does.

A producer sends each block in the step that makes it final. On CPU, K is stored transposed
inside a block, so a block's bytes are final only once every token in it is written: sending a
partial block early ships bytes that later change (seen: wrong output). So a chunked prefill
sends the blocks each step completes, and the last, partial block when the prompt is done;
a request served from the prefix cache sends its cached blocks with its first step. Block ids
come as the scheduler hands them out (freed ids are reused at once, so they are not in order).
Block id 0 is vLLM's null block (a sliding window's dropped blocks, a state's old slots).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from xdc.config import usable_cores

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class GroupKind(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What one KV cache group keeps per request, as far as moving it is concerned."""

    kind: GroupKind
    block_size: int  # tokens per block (a state group's is irrelevant to what moves)
    window: int = 0  # a sliding window's width in tokens

    def span(self, tokens: int) -> tuple[int, int]:
        """The positions ``[first, end)`` in the request's block list of this group that a
        transfer of ``tokens`` tokens carries (a state group: see ``state_block``)."""
        if self.kind is GroupKind.STATE:
            return 0, 1
        end = blocks_for(tokens, self.block_size)
        if self.kind is GroupKind.FULL:
            return 0, end
        # The decode side recomputes the last token, so its window reaches one token further
        # back than the prompt's end does; one more token of margin costs at most a block.
        return max(0, tokens - self.window - 1) // self.block_size, end

    def count(self, tokens: int) -> int:
        first, end = self.span(tokens)
        return end - first

    def describe(self) -> str:
        if self.kind is GroupKind.STATE:
            return "state"
        if self.kind is GroupKind.WINDOW:
            return f"window{self.window}/bs{self.block_size}"
        return f"full/bs{self.block_size}"


def state_block(block_ids: list[int] | tuple[int, ...]) -> int:
    """Where a state group keeps the request's running state: its last real block (vLLM puts
    the state of the latest position last; earlier slots are null or superseded)."""
    for b in reversed(block_ids):
        if b != NULL_BLOCK:
            return b
    return NULL_BLOCK


@dataclass(frozen=True, slots=True)
class KvPlan:
    """The groups of a model, and which group each of its layers (in transfer order) is in."""

    groups: tuple[GroupSpec, ...]
    layer_groups: tuple[int, ...]

    @staticmethod
    def dense(block_size: int, layers: int) -> KvPlan:
        return KvPlan((GroupSpec(GroupKind.FULL, block_size),), (0,) * layers)

    @property
    def backoff(self) -> int:
        """Prompt tokens the decode side computes itself (see the module docstring)."""
        return 1 if any(g.kind is GroupKind.STATE for g in self.groups) else 0

    def moved_tokens(self, prompt: int) -> int:
        return max(0, prompt - self.backoff)

    def counts(self, tokens: int) -> tuple[int, ...]:
        """Blocks per group in a transfer of ``tokens`` tokens."""
        return tuple(g.count(tokens) for g in self.groups)

    def layer_blocks(self, tokens: int) -> list[int]:
        return self.per_layer(self.counts(tokens))

    def per_layer(self, counts: tuple[int, ...]) -> list[int]:
        """Per-group block counts (``counts``) -> blocks of each layer, in transfer order."""
        return [counts[g] for g in self.layer_groups]

    def describe(self) -> str:
        """The groups and their layers, for the layout both sides must agree on."""
        return ";".join(
            g.describe() + ":" + ",".join(str(i) for i, x in enumerate(self.layer_groups) if x == k)
            for k, g in enumerate(self.groups)
        )


@dataclass(frozen=True, slots=True)
class Piece:
    """Blocks of one group: transfer blocks ``first .. first + len - 1`` of the group's layers
    are vLLM blocks ``block_ids`` (on the consumer, NULL_BLOCK: not kept there, skip it)."""

    group: int
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SaveStep:
    """What the worker does for one request in one step, for every layer."""

    req_id: str  # vLLM's
    rid: str  # xdc's
    counts: tuple[int, ...]  # the transfer's blocks per group
    pieces: tuple[Piece, ...]  # the blocks final in this step, per group
    begin: bool  # announce the transfer first
    last: bool  # the prompt is complete: hand the layers over whole
    deadline_s: float
    peer: str | None = None  # the receiver to ship to (None: the sender's own)
    prompt_digest: int = 0  # what the KV was made from (prompt_binding)

    def piece(self, group: int) -> Piece | None:
        for p in self.pieces:
            if p.group == group:
                return p
        return None


@dataclass
class SaveState:
    """A producer request's progress: which blocks of each group went out already."""

    req_id: str
    rid: str
    tokens: int  # the prompt tokens whose KV moves (the prompt less the plan's backoff)
    plan: KvPlan
    deadline_s: float
    prompt_len: int = 0  # the whole prompt (what the decode side is told)
    peer: str | None = None  # the decode node's receiver (None: the sender's own)
    prompt_digest: int = 0  # the moved tokens' digest (prompt_binding), sent with the KV
    block_ids: list[list[int]] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # per group: positions handled
    began: bool = False
    complete: bool = False

    def __post_init__(self) -> None:
        n = len(self.plan.groups)
        self.block_ids = self.block_ids or [[] for _ in range(n)]
        self.sent = self.sent or [g.span(self.tokens)[0] for g in self.plan.groups]
        self.prompt_len = self.prompt_len or self.tokens

    @property
    def counts(self) -> tuple[int, ...]:
        return self.plan.counts(self.tokens)

    def step(
        self, new_block_ids: list[list[int]] | tuple[list[int], ...], computed: int, scheduled: int
    ) -> SaveStep | None:
        """This step computes tokens [computed, computed + scheduled); its newly allocated
        blocks are ``new_block_ids`` (one list per group). None when no block becomes final."""
        for mine, new in zip(self.block_ids, new_block_ids, strict=False):
            mine.extend(new)
        if self.complete:
            return None
        done = min(computed + scheduled, self.tokens)
        last = done >= self.tokens
        pieces: list[Piece] = []
        for k, g in enumerate(self.plan.groups):
            ids = self.block_ids[k]
            if g.kind is GroupKind.STATE:
                if last:
                    pieces.append(Piece(k, 0, (state_block(ids),)))
                continue
            first, end = g.span(self.tokens)
            final = end if last else done // g.block_size
            final = min(final, len(ids), end)
            if final > self.sent[k]:
                pieces.append(Piece(k, self.sent[k] - first, tuple(ids[self.sent[k] : final])))
                self.sent[k] = final
        if not pieces:
            return None
        out = SaveStep(
            self.req_id,
            self.rid,
            self.counts,
            tuple(pieces),
            not self.began,
            last,
            self.deadline_s,
            self.peer,
            self.prompt_digest,
        )
        self.began = True
        self.complete = last
        return out


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A decode request's blocks to fill from a transfer of ``tokens`` tokens."""

    req_id: str
    rid: str
    tokens: int
    pieces: tuple[Piece, ...]
    timeout_s: float
    arrival_timeout_s: float
    error: str = ""  # why the blocks can not be filled: the load fails at once
    prompt_digest: int = 0  # this request's own moved tokens (prompt_binding)


def load_pieces(
    plan: KvPlan, tokens: int, computed: int, block_ids: tuple[list[int], ...] | list[list[int]]
) -> tuple[Piece, ...] | str:
    """What a consumer fills: for each group, the transfer's blocks it does not hold yet
    (``computed`` tokens came from its own prefix cache), into the blocks vLLM allocated
    (``block_ids``, one list per group). A str says why it cannot (the decode recomputes)."""
    if len(block_ids) != len(plan.groups):
        return f"{len(block_ids)} block lists for {len(plan.groups)} KV cache groups"
    out: list[Piece] = []
    for k, g in enumerate(plan.groups):
        ids = list(block_ids[k])
        if g.kind is GroupKind.STATE:
            b = state_block(ids)
            if b == NULL_BLOCK:
                return f"group {k} ({g.describe()}) has no block for the state"
            out.append(Piece(k, 0, (b,)))
            continue
        first, end = g.span(tokens)
        if len(ids) < end:
            return f"group {k} ({g.describe()}) has {len(ids)} blocks, {end} needed"
        start = max(first, computed // g.block_size)
        if g.kind is GroupKind.WINDOW and tokens > g.window:
            # recomputing the last token reads back to token tokens - window: vLLM sized the
            # allocation by the tokens loaded and may have dropped that token's block
            need = (tokens - g.window) // g.block_size
            if need >= start and ids[need] == NULL_BLOCK:
                token = tokens - g.window
                return f"group {k} ({g.describe()}): vLLM kept no block for token {token}"
        if start < end:
            out.append(Piece(k, start - first, tuple(ids[start:end])))
    return tuple(out)


# --- integrity to the engine's blocks ---------------------------------------------------------
# A transfer carries, after its KV layers, one more layer: the xxh3-64 of every block of every
# layer as the producer copied it, layer-major (``KvPlan.digest_offsets``). The consumer hashes
# the vLLM blocks it filled, read back from its own KV tensor at the ids it wrote, and reports
# the request loaded only if every hash matches: bytes that were verified in the daemons' pools
# but went to the wrong block, or were torn on the way in, are a recompute with a reason, never
# a decode.
#
# The digest layer ends with one more digest: the prompt the KV was made from
# (``prompt_binding``). A valid transfer of another prompt's KV (a gateway that reused or
# mixed up a transfer id, a client that named someone else's) hashes right block by block and
# decodes into wrong tokens; the consumer compares that digest with its own prompt's first.
DIGEST_BYTES = 8
LAYOUT_TAG = "xxh3blk+prompt"


def digest_layer_bytes(layer_blocks: list[int]) -> int:
    return (sum(layer_blocks) + 1) * DIGEST_BYTES


def prompt_slot(layer_blocks: list[int]) -> int:
    """Where the prompt's digest is in the digest layer (in digests): after every block's."""
    return sum(layer_blocks)


def digest_offsets(layer_blocks: list[int]) -> list[int]:
    """Where each layer's block digests start in the digest layer (in digests)."""
    out, at = [], 0
    for n in layer_blocks:
        out.append(at)
        at += n
    return out


def hash_threads() -> int:
    """Threads that hash a GPU load's arrived bytes when no helper process does
    (``hash_helpers``): never more than a quarter of the cores the engine's process may use,
    at most 8. python-xxhash keeps the GIL for a block of 64 KiB or less, so more threads
    buy little there (device machine, 2026-11-30: 4 threads no faster than one)."""
    return max(1, min(8, usable_cores() // 4))


def arrival_positions(
    piece: Piece, digests: np.ndarray[Any, np.dtype[np.uint64]], at: int
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.uint64]]]:
    """The positions (in the transfer's layer) of ``piece``'s blocks that landed, and the
    digests the producer copied for them."""
    pos = np.array(
        [piece.first + j for j, b in enumerate(piece.block_ids) if b != NULL_BLOCK],
        dtype=np.int64,
    )
    return pos, digests[at + pos] if len(pos) else np.zeros(0, dtype=np.uint64)


def arrival_message(layer: int, pos: int) -> str:
    return f"layer {layer} block {pos} arrived not hashing to what the producer copied"


def arrival_mismatch(
    host: np.ndarray[Any, np.dtype[np.uint8]],
    bb: int,
    piece: Piece,
    digests: np.ndarray[Any, np.dtype[np.uint64]],
    at: int,
    layer: int,
) -> str | None:
    """Why layer ``layer``'s arrived blocks are not what the producer copied, or None."""
    positions, expected = arrival_positions(piece, digests, at)
    for pos, want in zip(positions.tolist(), expected.tolist(), strict=True):
        if xxhash.xxh3_64_intdigest(host[pos * bb : (pos + 1) * bb].data) != want:
            return arrival_message(layer, pos)
    return None
