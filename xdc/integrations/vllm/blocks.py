"""Which KV blocks of a request move when: pure bookkeeping, tested without vLLM.

A producer sends each block in the step that makes it final. On CPU, K is stored transposed
inside a block, so a block's bytes are final only once every token in it is written: sending a
partial block early ships bytes that later change (seen: wrong output). So a chunked prefill
sends the blocks each step completes, and the last, partial block when the prompt is done;
a request served from the prefix cache sends its cached blocks with its first step. Block ids
come as the scheduler hands them out (freed ids are reused at once, so they are not in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class SaveStep:
    """What the worker does for one request in one step, for every layer."""

    req_id: str  # vLLM's
    rid: str  # xdc's
    total_blocks: int  # the transfer's layer size, in blocks
    first: int  # index (in the request) of the first block final in this step
    block_ids: tuple[int, ...]  # vLLM block ids of blocks first .. first + len - 1
    begin: bool  # announce the transfer first
    last: bool  # the prompt is complete: hand the layers over whole
    deadline_s: float


@dataclass
class SaveState:
    req_id: str
    rid: str
    prompt_len: int
    block_size: int
    deadline_s: float
    block_ids: list[int] = field(default_factory=list)
    sent: int = 0
    began: bool = False

    @property
    def total_blocks(self) -> int:
        return blocks_for(self.prompt_len, self.block_size)

    def step(self, new_block_ids: list[int], computed: int, scheduled: int) -> SaveStep | None:
        """This step computes tokens [computed, computed + scheduled); its newly allocated
        blocks are ``new_block_ids``. None when no block becomes final."""
        self.block_ids.extend(new_block_ids)
        done = min(computed + scheduled, self.prompt_len)
        final = self.total_blocks if done >= self.prompt_len else done // self.block_size
        final = min(final, len(self.block_ids))
        if final <= self.sent:
            return None
        out = SaveStep(
            self.req_id,
            self.rid,
            self.total_blocks,
            self.sent,
            tuple(self.block_ids[self.sent : final]),
            not self.began,
            final == self.total_blocks,
            self.deadline_s,
        )
        self.sent = final
        self.began = True
        return out


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A decode request's blocks to fill from a transfer: the transfer's blocks
    ``first .. first + len(block_ids) - 1`` go into vLLM blocks ``block_ids``."""

    req_id: str
    rid: str
    num_tokens: int
    first: int
    block_ids: tuple[int, ...]
    timeout_s: float
    arrival_timeout_s: float


# --- integrity to the engine's blocks ---------------------------------------------------------
# A transfer carries, after its KV layers, one more layer: the xxh3-64 of every block of every
# layer as the producer copied it, layer-major (layer i, block j at 8 * (i * blocks + j)). The
# consumer hashes the vLLM blocks it filled, read back from its own KV tensor at the ids it
# wrote, and reports the request loaded only if every hash matches: bytes that were verified
# in the daemons' pools but went to the wrong block, or were torn on the way in, are a
# recompute with a reason, never a decode.
DIGEST_BYTES = 8
LAYOUT_TAG = "xxh3blk"


def digest_layer_bytes(layers: int, total_blocks: int) -> int:
    return layers * total_blocks * DIGEST_BYTES


def digest_index(layer: int, block: int, total_blocks: int) -> int:
    """Where block ``block`` of layer ``layer`` has its digest in the digest layer, read as
    little-endian u64s."""
    return layer * total_blocks + block
