"""Which KV blocks move in which step, per KV cache group (xdc/integrations/vllm/blocks.py),
without vLLM: a dense model's one group of full attention, a hybrid model's linear-attention
state beside full attention, and sliding-window groups that carry only the window's tail."""

from __future__ import annotations

from xdc.integrations.vllm.blocks import (
    NULL_BLOCK,
    GroupKind,
    GroupSpec,
    KvPlan,
    Piece,
    SaveState,
    blocks_for,
    digest_layer_bytes,
    digest_offsets,
    load_pieces,
    state_block,
)

FULL32 = GroupSpec(GroupKind.FULL, 32)
DENSE = KvPlan.dense(32, 4)
# the Qwen3-Next shape: linear attention in layers 0 and 2, full attention in 1 and 3
HYBRID = KvPlan((GroupSpec(GroupKind.STATE, 4096), GroupSpec(GroupKind.FULL, 32)), (0, 1, 0, 1))
# Gemma/MiMo-like: sliding window of 64 tokens beside full attention
SWA = KvPlan((GroupSpec(GroupKind.WINDOW, 32, window=64), FULL32), (0, 0, 0, 1))


def _dense(tokens: int) -> SaveState:
    return SaveState("q", "r", tokens, DENSE, deadline_s=30)


def test_an_unchunked_prefill_sends_every_block_in_its_one_step() -> None:
    st = _dense(70)
    step = st.step([[5, 9, 2]], computed=0, scheduled=70)
    assert step is not None
    assert (step.pieces, step.begin, step.last, step.counts) == (
        (Piece(0, 0, (5, 9, 2)),),
        True,
        True,
        (3,),
    )
    assert st.complete and st.prompt_len == 70
    assert st.step([[]], computed=70, scheduled=1) is None  # decode steps send nothing


def test_a_chunked_prefill_sends_each_block_in_the_step_that_completes_it() -> None:
    st = _dense(100)
    s1 = st.step([[4, 8]], computed=0, scheduled=40)  # block 0 final, block 1 half written
    assert s1 is not None and (s1.pieces, s1.begin, s1.last) == ((Piece(0, 0, (4,)),), True, False)
    assert st.step([[]], computed=40, scheduled=20) is None  # 60 tokens: block 1 still open
    s3 = st.step([[7, 1]], computed=60, scheduled=40)  # prompt done: blocks 1, 2 and partial 3
    assert s3 is not None and (s3.pieces, s3.begin, s3.last) == (
        (Piece(0, 1, (8, 7, 1)),),
        False,
        True,
    )
    assert blocks_for(100, 32) == 4 == s3.counts[0]


def test_cached_prefix_blocks_go_with_the_first_step() -> None:
    st = _dense(96)
    s = st.step([[3, 4, 6]], computed=64, scheduled=32)  # 64 tokens came from the prefix cache
    assert s is not None and s.pieces == (Piece(0, 0, (3, 4, 6)),) and s.last


def test_a_dense_model_moves_its_whole_prompt_and_a_state_group_stops_one_token_short() -> None:
    """A state can not be rewound and the decode side recomputes the last prompt token, so
    a hybrid transfer carries the KV and state of all but that token (as NIXL does)."""
    assert (DENSE.backoff, DENSE.moved_tokens(100)) == (0, 100)
    assert (HYBRID.backoff, HYBRID.moved_tokens(100)) == (1, 99)
    assert HYBRID.moved_tokens(1) == 0  # nothing to move: no transfer
    assert HYBRID.layer_blocks(99) == [1, 4, 1, 4]  # one state block per linear layer
    assert digest_layer_bytes(HYBRID.layer_blocks(99)) == (10 + 1) * 8  # and the prompt's
    assert digest_offsets(HYBRID.layer_blocks(99)) == [0, 1, 5, 6]


def test_the_state_moves_once_in_the_step_that_finishes_the_prompt() -> None:
    st = SaveState("q", "r", 99, HYBRID, deadline_s=30, prompt_len=100)
    s1 = st.step([[7], [4, 8]], computed=0, scheduled=40)
    assert s1 is not None and s1.pieces == (Piece(1, 0, (4,)),)  # the state is not final yet
    s2 = st.step([[], [9, 1]], computed=40, scheduled=59)
    assert s2 is not None and s2.last
    assert s2.pieces == (Piece(0, 0, (7,)), Piece(1, 1, (8, 9, 1)))
    assert st.prompt_len == 100  # what the decode side is told: its whole prompt


def test_the_running_state_is_the_last_real_block_of_a_position_indexed_list() -> None:
    """With prefix caching vLLM keeps a state group position by position ('align' mode):
    earlier positions are null or superseded, the running state is the last real block."""
    assert state_block([0, 0, 0, 3, 7]) == 7
    assert state_block([5]) == 5
    assert state_block([0, 0]) == NULL_BLOCK
    st = SaveState("q", "r", 699, HYBRID, deadline_s=30)
    st.step([[1], [2]], computed=0, scheduled=160)
    st.step([[3], [4]], computed=160, scheduled=160)
    last = st.step([[1], [5, 6, 7]], computed=320, scheduled=379)
    assert last is not None and last.piece(0) == Piece(0, 0, (1,))


def test_a_sliding_window_moves_only_the_blocks_its_window_still_reads() -> None:
    """Window 64 over 300 tokens: the decode recomputing token 299 reads back to token 236,
    block 7; one token of margin makes it block 7 too. Blocks 0..6 never move."""
    g = SWA.groups[0]
    assert g.span(300) == (7, 10)
    assert SWA.layer_blocks(300) == [3, 3, 3, 10]
    st = SaveState("q", "r", 300, SWA, deadline_s=30)
    s1 = st.step([list(range(1, 8)), list(range(11, 18))], computed=0, scheduled=224)
    assert s1 is not None and s1.pieces == (Piece(1, 0, tuple(range(11, 18))),)
    s2 = st.step([[8, 9, 10], [18, 19, 20]], computed=224, scheduled=76)
    assert s2 is not None and s2.last
    assert s2.pieces == (Piece(0, 0, (8, 9, 10)), Piece(1, 7, (18, 19, 20)))


def test_a_consumer_fills_what_it_lacks_and_skips_the_blocks_vllm_does_not_keep() -> None:
    # dense: 64 tokens from its own prefix cache; blocks 2 and 3 come from the transfer
    assert load_pieces(DENSE, 100, 64, [[5, 6, 7, 8]]) == (Piece(0, 2, (7, 8)),)
    # hybrid: the state goes into the last real block of its group
    assert load_pieces(HYBRID, 99, 0, [[0, 0, 9], [1, 2, 3, 4]]) == (
        Piece(0, 0, (9,)),
        Piece(1, 0, (1, 2, 3, 4)),
    )
    # a window group's dropped blocks (null) before the window are not in the span
    ids = [NULL_BLOCK] * 7 + [31, 32, 33]
    assert load_pieces(SWA, 300, 0, [ids, list(range(1, 11))])[0] == Piece(0, 0, (31, 32, 33))


def test_a_consumer_that_can_not_hold_what_moves_says_why() -> None:
    assert "no block for the state" in str(load_pieces(HYBRID, 99, 0, [[0], [1, 2, 3, 4]]))
    assert "2 blocks, 4 needed" in str(load_pieces(HYBRID, 99, 0, [[9], [1, 2]]))
    assert "block lists for 2" in str(load_pieces(HYBRID, 99, 0, [[9]]))
    # the block of the window's first token dropped by vLLM: recompute rather than read a hole
    ids = [NULL_BLOCK] * 8 + [32, 33]
    assert "no block for token 236" in str(load_pieces(SWA, 300, 0, [ids, list(range(1, 11))]))


def test_the_layout_description_names_every_group_and_its_layers() -> None:
    assert HYBRID.describe() == "state:0,2;full/bs32:1,3"
    assert SWA.describe() == "window64/bs32:0,1,2;full/bs32:3"
    assert DENSE.describe() == "full/bs32:0,1,2,3"
