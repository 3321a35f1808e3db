"""Which transfers a request's KV moves as under tensor parallel (xdc/integrations/vllm/parts.py),
without vLLM: groups split by heads move one transfer per rank, groups every rank holds whole
move once, replicated ones once per distinct copy; and a decode rank reports a request only
once every part of it was heard from."""

from __future__ import annotations

from dataclasses import dataclass, field

from xdc.integrations.vllm.blocks import GroupKind, GroupSpec, KvPlan, LoadSpec, Piece
from xdc.integrations.vllm.parts import Part, PartLoaders, split_parts, transfers_per_request

STATE = GroupSpec(GroupKind.STATE, 4096)
FULL = GroupSpec(GroupKind.FULL, 32)
# Kimi Linear's shape in small: linear-attention state in layers 0, 1, 3; attention in 2 and 4
KIMI = KvPlan((STATE, FULL), (0, 0, 1, 0, 1))


def _parts(plan: KvPlan, shards: list[int], rank: int, ranks: int) -> list[Part]:
    parts = split_parts(plan, shards, rank, ranks)
    assert not isinstance(parts, str), parts
    return parts


def test_groups_split_by_heads_move_one_transfer_per_rank_as_before() -> None:
    for rank in range(4):
        (part,) = _parts(KIMI, [4, 4], rank, 4)
        assert (part.shards, part.index, part.readers, part.mover) == (4, rank, 1, True)
        assert part.layers == (0, 1, 2, 3, 4) and part.plan == KIMI
        assert part.rid("r") == f"r#{rank}/4"


def test_one_rank_moves_everything_as_one_transfer_named_as_the_request() -> None:
    (part,) = _parts(KIMI, [1, 1], 0, 1)
    assert (part.rid("r"), part.readers, part.mover, part.plan) == ("r", 1, True, KIMI)


def test_a_latent_every_rank_holds_moves_once_beside_the_split_state() -> None:
    at = {rank: _parts(KIMI, [4, 1], rank, 4) for rank in range(4)}
    for rank, (whole, split) in at.items():
        # the attention group: one copy, moved by rank 0, read by all four
        assert (whole.shards, whole.index, whole.readers) == (1, 0, 4)
        assert whole.mover == (rank == 0)
        assert whole.rid("r") == "r"
        assert whole.groups == (1,) and whole.layers == (2, 4)
        assert whole.plan == KvPlan((FULL,), (0, 0))
        # the state: one share per rank, as before
        assert (split.shards, split.index, split.readers, split.mover) == (4, rank, 1, True)
        assert split.rid("r") == f"r#{rank}/4"
        assert split.groups == (0,) and split.layers == (0, 1, 3)
        assert split.plan == KvPlan((STATE,), (0, 0, 0))
    assert transfers_per_request([4, 1], 4) == 4


def test_kv_heads_fewer_than_ranks_move_once_per_distinct_copy() -> None:
    """Two KV heads over eight ranks: vLLM gives rank r head r * 2 // 8, so ranks 0-3 hold
    one copy and 4-7 the other; ranks 0 and 4 move them, each read by four ranks."""
    plan = KvPlan.dense(32, 2)
    got = {rank: _parts(plan, [2], rank, 8)[0] for rank in range(8)}
    assert [p.index for p in got.values()] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r for r, p in got.items() if p.mover] == [0, 4]
    assert {p.readers for p in got.values()} == {4}
    assert got[5].rid("r") == "r#1/2"
    assert transfers_per_request([2], 8) == 2


def test_every_layer_is_in_exactly_one_part() -> None:
    plan = KvPlan((STATE, FULL, GroupSpec(GroupKind.WINDOW, 32, 64)), (0, 1, 2, 0, 2, 1))
    parts = _parts(plan, [4, 1, 2], 1, 4)
    assert [p.shards for p in parts] == [1, 2, 4]
    layers = sorted(i for p in parts for i in p.layers)
    assert layers == list(range(6))
    for p in parts:  # a part's plan renumbers its groups and keeps its layers' order
        assert [p.groups[g] for g in p.plan.layer_groups] == [
            plan.layer_groups[i] for i in p.layers
        ]


def test_shard_counts_that_do_not_divide_the_ranks_are_refused_with_the_group() -> None:
    assert "group 1" in str(split_parts(KIMI, [4, 3], 0, 4))
    assert "group 0" in str(split_parts(KIMI, [0, 1], 0, 4))
    assert "2 shard counts for 1" in str(split_parts(KvPlan.dense(32, 2), [1, 1], 0, 2))
    assert "rank 4 of 4" in str(split_parts(KIMI, [4, 1], 4, 4))


def test_a_part_keeps_only_its_groups_pieces_renumbered() -> None:
    whole, split = _parts(KIMI, [4, 1], 0, 4)
    pieces = (Piece(0, 0, (7,)), Piece(1, 2, (3, 4)))
    assert whole.pieces(pieces) == (Piece(0, 2, (3, 4)),)
    assert split.pieces(pieces) == (Piece(0, 0, (7,)),)
    assert whole.counts((1, 5)) == (5,) and split.counts((1, 5)) == (1,)


@dataclass
class _Loader:
    """A part's loader as PartLoaders drives it: what it was given, and what it reports."""

    added: list[LoadSpec] = field(default_factory=list)
    pending: set[str] = field(default_factory=set)
    dropped: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    reasons: dict[str, str] = field(default_factory=dict)
    stopped: bool = False

    def add(self, specs: list[LoadSpec]) -> None:
        self.added.extend(specs)
        self.pending.update(s.req_id for s in specs)

    def drop(self, req_ids: list[str], why: str = "") -> None:
        # as loads.Loader: a request still pending is reported finished at the next take
        for r in set(req_ids) & self.pending:
            self.dropped.append(r)
            self.done.add(r)

    def take(self) -> tuple[set[str], set[str]]:
        out = (self.done, self.failed)
        self.pending -= self.done | self.failed
        self.done, self.failed = set(), set()
        return out

    def stop(self) -> None:
        self.stopped = True


def _kimi_loaders() -> tuple[PartLoaders, _Loader, _Loader]:
    whole, split = _parts(KIMI, [4, 1], 2, 4)
    a, b = _Loader(), _Loader()
    return PartLoaders([(whole, a), (split, b)], lambda p, rid: p.rid(rid)), a, b


def _spec(req_id: str) -> LoadSpec:
    return LoadSpec(req_id, "r", 40, (Piece(0, 0, (7,)), Piece(1, 0, (3, 4))), 60.0, 10.0)


def test_each_part_is_asked_for_its_own_transfer_with_its_own_blocks() -> None:
    loads, whole, split = _kimi_loaders()
    loads.add([_spec("q")])
    (w,) = whole.added
    (s,) = split.added
    assert (w.rid, w.pieces) == ("r", (Piece(0, 0, (3, 4)),))
    assert (s.rid, s.pieces) == ("r#2/4", (Piece(0, 0, (7,)),))


def test_a_request_is_loaded_only_once_every_part_landed() -> None:
    loads, whole, split = _kimi_loaders()
    loads.add([_spec("q")])
    whole.done.add("q")
    assert loads.take() == (set(), set())  # the state has not landed yet
    split.done.add("q")
    assert loads.take() == ({"q"}, set())
    assert loads.take() == (set(), set())  # reported once


def test_a_part_that_fails_drops_the_others_and_the_request_recomputes() -> None:
    loads, whole, split = _kimi_loaders()
    loads.add([_spec("q"), _spec("p")])
    split.failed.add("q")
    split.reasons["q"] = "timeout"
    assert loads.take() == (set(), {"q"})  # the whole part was dropped and heard from
    assert whole.dropped == ["q"] and split.dropped == []
    assert loads.reasons == {"q": "timeout"}
    loads.clear_reasons()
    assert loads.reasons == {}
    # the other request is unaffected
    whole.done.add("p")
    split.done.add("p")
    assert loads.take() == ({"p"}, set())


def test_a_failure_after_the_other_part_landed_still_fails_the_request() -> None:
    loads, whole, split = _kimi_loaders()
    loads.add([_spec("q")])
    whole.done.add("q")
    assert loads.take() == (set(), set())
    split.failed.add("q")
    assert loads.take() == (set(), {"q"})
    assert whole.dropped == []  # it had landed already: nothing left to drop


def test_one_part_passes_its_loader_through_and_stop_reaches_every_part() -> None:
    (part,) = _parts(KIMI, [4, 4], 1, 4)
    one = _Loader()
    loads = PartLoaders([(part, one)], lambda p, rid: p.rid(rid))
    loads.add([_spec("q")])
    assert one.added[0].rid == "r#1/4" and one.added[0].pieces == _spec("q").pieces
    one.failed.add("q")
    assert loads.take() == (set(), {"q"})
    loads.stop()
    assert one.stopped
