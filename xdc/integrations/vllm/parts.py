"""Which transfers a request's KV moves as under tensor parallel: pure, tested without vLLM.

Under tensor parallel a KV cache group is held by the ranks in one of three ways:

- split by heads (attention with at least as many KV heads as ranks, a linear-attention or
  SSM state): every rank holds its own share, ``ranks`` distinct copies;
- whole at every rank (MLA's latent, not split by heads; attention with one KV head): every
  rank holds the same bytes, one distinct copy;
- replicated in between (attention with K KV heads, 1 < K < ranks): vLLM gives rank r the
  head r * K // ranks, so K distinct copies, each held by ranks / K ranks.

A group's number of distinct copies is its ``shards``. Groups with the same number move
together as one transfer per copy: ``rid`` for one copy, ``rid#i/shards`` for copy i (so a
split-only engine names its transfers as before, one per rank). Copy i is moved by the first
rank that holds it and read, on the decode side, by every rank that holds it (the receiver's
shared read, ``readers``). Before this, an engine with the latent beside a split state (Kimi
Linear's shape) had every rank move its own copy of the latent: the link carried it
``ranks`` times, which is the bulk of such a model's KV for a long prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from xdc.integrations.vllm.blocks import KvPlan, LoadSpec, Piece
from xdc.integrations.vllm.params import merge_reasons, shard_rid


@dataclass(frozen=True, slots=True)
class Part:
    """The groups with ``shards`` distinct copies, as this rank moves or reads them."""

    shards: int  # distinct copies of these groups across the ranks
    index: int  # the copy this rank holds
    readers: int  # ranks that hold that copy (each reads it on the decode side)
    mover: bool  # this rank moves that copy (the first rank that holds it)
    groups: tuple[int, ...]  # the engine's KV cache group ids in this part, ascending
    layers: tuple[int, ...]  # the engine's layer indices, in this part's transfer order
    plan: KvPlan  # this part's groups (renumbered 0..) and layers, as its transfer carries

    def rid(self, rid: str) -> str:
        """The transfer of this rank's copy for the request ``rid``."""
        return shard_rid(rid, self.index, self.shards)

    def counts(self, counts: Sequence[int]) -> tuple[int, ...]:
        """The engine's blocks per group -> this part's."""
        return tuple(counts[g] for g in self.groups)

    def pieces(self, pieces: Sequence[Piece]) -> tuple[Piece, ...]:
        """The engine's pieces -> those of this part's groups, renumbered as its plan is."""
        at = {g: k for k, g in enumerate(self.groups)}
        return tuple(Piece(at[p.group], p.first, p.block_ids) for p in pieces if p.group in at)


def split_parts(plan: KvPlan, shards: Sequence[int], rank: int, ranks: int) -> list[Part] | str:
    """The parts of ``plan`` at ``rank`` of ``ranks``, given each group's ``shards``; fewest
    copies first. A str says why the groups can not be moved this way (the engine then
    serves its requests locally)."""
    if not 0 <= rank < ranks:
        return f"rank {rank} of {ranks}"
    if len(shards) != len(plan.groups):
        return f"{len(shards)} shard counts for {len(plan.groups)} KV cache groups"
    for k, s in enumerate(shards):
        if not 1 <= s <= ranks or ranks % s:
            return (
                f"KV cache group {k} has {s} distinct copies across {ranks} ranks "
                "(expected a divisor of the rank count)"
            )
    out: list[Part] = []
    for s in sorted(set(shards)):
        groups = tuple(k for k, n in enumerate(shards) if n == s)
        renumber = {g: k for k, g in enumerate(groups)}
        layers = tuple(i for i, g in enumerate(plan.layer_groups) if g in renumber)
        sub = KvPlan(
            tuple(plan.groups[g] for g in groups),
            tuple(renumber[plan.layer_groups[i]] for i in layers),
        )
        per_copy = ranks // s
        out.append(Part(s, rank // per_copy, per_copy, rank % per_copy == 0, groups, layers, sub))
    return out


def transfers_per_request(shards: Sequence[int], ranks: int) -> int:
    """What a prefill's answer says (``xdc_ranks``) and a decode must match: the most
    distinct copies of any group (1 when every rank holds all of it; ``ranks`` when any
    group is split by heads). The layout of each transfer checks the rest."""
    return max(shards, default=1) if ranks > 1 else 1


def transfer_names(rid: str, shards: Sequence[int]) -> tuple[str, ...]:
    """Every transfer a decode engine's ranks read for ``rid``, given each group's distinct
    copies: one per copy of each part (``rid`` alone for an engine of one rank, or whose
    ranks all hold the same bytes)."""
    return tuple(shard_rid(rid, i, s) for s in sorted(set(shards) or {1}) for i in range(s))


class PartLoader(Protocol):
    """What ``PartLoaders`` needs of a part's loader (``loads.Loader``)."""

    reasons: dict[str, str]

    def add(self, specs: list[LoadSpec]) -> None: ...

    def drop(self, req_ids: list[str], why: str = ...) -> None: ...

    def take(self) -> tuple[set[str], set[str]]: ...

    def stop(self) -> None: ...


class PartLoaders:
    """The decode side of an engine whose request KV comes as several transfers per rank (a
    latent every rank holds beside a state split by heads): one loader per part, and a vLLM
    request is reported once every part reported it, failed if any part failed. A part that
    fails first drops the request in the other parts (their transfers are discarded, and a
    load under way on a device still completes before it is counted), so a request is never
    reported while any of its copies may still write its blocks. One part (every other
    engine) passes its loader's answers through."""

    def __init__(
        self, loaders: list[tuple[Part, PartLoader]], rid_of: Callable[[Part, str], str]
    ) -> None:
        self.loaders = loaders
        self._rid_of = rid_of
        self._heard: dict[str, tuple[int, bool]] = {}  # req_id -> (parts reported, any failed)

    def add(self, specs: list[LoadSpec]) -> None:
        for part, ld in self.loaders:
            ld.add(
                [
                    replace(s, rid=self._rid_of(part, s.rid), pieces=part.pieces(s.pieces))
                    for s in specs
                ]
            )

    def drop(self, req_ids: list[str]) -> None:
        for _, ld in self.loaders:
            ld.drop(req_ids)

    def take(self) -> tuple[set[str], set[str]]:
        if len(self.loaders) == 1:
            return self.loaders[0][1].take()
        done: set[str] = set()
        failed: set[str] = set()
        dropped = True
        while dropped:  # a part dropped meanwhile reports it at once: ask again
            dropped = False
            for k, (_, ld) in enumerate(self.loaders):
                ok, bad = ld.take()
                for req_id in ok | bad:
                    heard, lost = self._heard.get(req_id, (0, False))
                    if req_id in bad and not lost:
                        dropped = True
                        for m, (_, other) in enumerate(self.loaders):
                            if m != k:
                                other.drop([req_id], "another part of it failed")
                    heard, lost = heard + 1, lost or req_id in bad
                    if heard < len(self.loaders):
                        self._heard[req_id] = (heard, lost)
                        continue
                    self._heard.pop(req_id, None)
                    (failed if lost else done).add(req_id)
        return done, failed

    @property
    def reasons(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for _, ld in self.loaders:
            merge_reasons(out, ld.reasons)
        return out

    def clear_reasons(self) -> None:
        for _, ld in self.loaders:
            ld.reasons = {}

    def stop(self) -> None:
        for _, ld in self.loaders:
            ld.stop()


__all__ = [
    "Part",
    "PartLoader",
    "PartLoaders",
    "split_parts",
    "transfer_names",
    "transfers_per_request",
]
