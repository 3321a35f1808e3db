"""The connector's pure parts, without vLLM: per-request transfer parameters and instance
config (every bad value a clear error naming its field). Which blocks move when:
test_vllm_blocks.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from xdc.integrations.vllm.params import (
    MAX_RANKS,
    MAX_XDC_RID,
    ConnectorConfig,
    LoadParams,
    SendParams,
    decode_params,
    handover_params,
    merge_reasons,
    parallel_split,
    parse_prefill_answer,
    parse_request,
    prefill_params,
    shard_rid,
)
from xdc.protocol.engine_control import MAX_RID, check_rid


def test_requests_parse_into_send_or_load() -> None:
    assert parse_request(None) is None
    assert parse_request({"other": 1}) is None
    assert parse_request({"do_remote_decode": True, "xdc_rid": "r1"}) == SendParams("r1", None)
    longest = "x" * MAX_XDC_RID  # the longest id, with room for a rank's suffix
    assert parse_request({"do_remote_decode": True, "xdc_rid": longest}) == SendParams(
        longest, None
    )
    assert parse_request(
        {"do_remote_prefill": True, "xdc_rid": "r2", "xdc_num_tokens": 40, "xdc_timeout_s": 5}
    ) == LoadParams("r2", 40, 5.0)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"do_remote_decode": True}, "xdc_rid"),
        ({"do_remote_decode": True, "xdc_rid": ""}, "xdc_rid"),
        ({"do_remote_decode": True, "xdc_rid": "a\nb"}, "xdc_rid"),
        ({"do_remote_decode": True, "xdc_rid": "x" * 201}, "xdc_rid"),
        # one past what the daemons take with a rank's suffix, on both roles
        ({"do_remote_decode": True, "xdc_rid": "x" * (MAX_XDC_RID + 1)}, "xdc_rid"),
        (
            {"do_remote_prefill": True, "xdc_rid": "x" * (MAX_XDC_RID + 1), "xdc_num_tokens": 5},
            "xdc_rid",
        ),
        (
            {"do_remote_decode": True, "xdc_rid": "r", "xdc_deadline_s": float("nan")},
            "xdc_deadline_s",
        ),
        ({"do_remote_decode": True, "xdc_rid": "r", "xdc_deadline_s": -1}, "xdc_deadline_s"),
        ({"do_remote_prefill": True, "xdc_rid": "r"}, "xdc_num_tokens"),
        ({"do_remote_prefill": True, "xdc_rid": "r", "xdc_num_tokens": True}, "xdc_num_tokens"),
        ({"do_remote_prefill": True, "xdc_rid": "r", "xdc_num_tokens": 0}, "xdc_num_tokens"),
        (
            {"do_remote_prefill": True, "xdc_rid": "r", "xdc_num_tokens": 5, "xdc_timeout_s": "1"},
            "xdc_timeout_s",
        ),
        *(
            (
                {
                    "do_remote_prefill": True,
                    "xdc_rid": "r",
                    "xdc_num_tokens": 5,
                    "xdc_arrival_s": v,
                },
                "xdc_arrival_s",
            )
            for v in (0, -1, "5", True, float("inf"), 3601)
        ),
        ({"do_remote_prefill": True, "do_remote_decode": True, "xdc_rid": "r"}, "both"),
        *(
            (
                {"do_remote_prefill": True, "xdc_rid": "r", "xdc_num_tokens": 5, "xdc_ranks": v},
                "xdc_ranks",
            )
            for v in (0, True, 2.0, "2", MAX_RANKS + 1)
        ),
    ],
)
def test_bad_request_params_name_their_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_request(params)


def test_instance_config_needs_the_sockets_of_its_role_and_knows_its_fields() -> None:
    with pytest.raises(ValueError, match="sender_socket"):
        ConnectorConfig.parse({}, producer=True, consumer=False)
    with pytest.raises(ValueError, match="receiver_socket"):
        ConnectorConfig.parse({"sender_socket": "/s"}, producer=True, consumer=True)
    with pytest.raises(ValueError, match=r"unknown field.*sender_sock"):
        ConnectorConfig.parse({"sender_sock": "/s"}, producer=True, consumer=False)
    with pytest.raises(ValueError, match="arrival_timeout_s"):
        ConnectorConfig.parse(
            {"receiver_socket": "/r", "arrival_timeout_s": 0}, producer=False, consumer=True
        )
    c = ConnectorConfig.parse(
        {"receiver_socket": "/r", "timeout_s": 9}, producer=False, consumer=True
    )
    assert (c.receiver_socket, c.timeout_s, c.arrival_timeout_s) == ("/r", 9.0, 10.0)
    assert c.admit == "complete"  # KV blocks once the KV is complete at the receiver
    with pytest.raises(ValueError, match=r"admit: expected one of complete, scheduled"):
        ConnectorConfig.parse(
            {"receiver_socket": "/r", "admit": "soon"}, producer=False, consumer=True
        )
    c = ConnectorConfig.parse(
        {"receiver_socket": "/r", "admit": "scheduled"}, producer=False, consumer=True
    )
    assert c.admit == "scheduled"


@pytest.mark.parametrize("bad", [-1, 65, 2.0, True, "four", ""])
def test_a_bad_hash_helper_count_is_a_clear_error(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"hash_helpers: expected \"auto\" or an integer"):
        ConnectorConfig.parse(
            {"receiver_socket": "/r", "hash_helpers": bad}, producer=False, consumer=True
        )


def test_hash_helpers_default_to_auto_and_take_a_count() -> None:
    c = ConnectorConfig.parse({"receiver_socket": "/r"}, producer=False, consumer=True)
    assert c.hash_helpers == "auto"
    for n in (0, 4, 64):
        c = ConnectorConfig.parse(
            {"receiver_socket": "/r", "hash_helpers": n}, producer=False, consumer=True
        )
        assert c.hash_helpers == n


def test_the_gateway_and_the_connector_share_one_contract() -> None:
    """What the gateway writes (prefill_params / decode_params) is what the connector reads
    (parse_request): the decode node's receiver travels with the prefill request."""
    sent = prefill_params("r9", deadline_s=12.0, peer="10.0.0.7:7400")
    assert parse_request(sent) == SendParams("r9", 12.0, "10.0.0.7:7400")
    assert parse_request(prefill_params("r9", deadline_s=12.0)) == SendParams("r9", 12.0, None)
    assert parse_request(decode_params("r9", 321, timeout_s=5.0)) == LoadParams("r9", 321, 5.0)
    waits = decode_params("r9", 321, timeout_s=60.0, arrival_s=30.0)
    assert waits["xdc_arrival_s"] == 30.0
    assert parse_request(waits) == LoadParams("r9", 321, 60.0, arrival_s=30.0)


@pytest.mark.parametrize("peer", ["nohost", "h:0", "h:99999", ":1", "h h:1", 7, "h:1\n"])
def test_a_bad_peer_is_a_clear_error_naming_the_field(peer: Any) -> None:
    with pytest.raises(ValueError, match="xdc_peer"):
        parse_request({"do_remote_decode": True, "xdc_rid": "r", "xdc_peer": peer})


def test_each_rank_of_a_split_engine_moves_a_transfer_the_daemons_take() -> None:
    """Tensor parallel: one transfer per rank, named apart; the longest id a request may
    carry still fits the engine protocol (MAX_RID) with the largest suffix."""
    assert shard_rid("r1", 0, 1) == "r1"
    assert {shard_rid("r1", r, 2) for r in range(2)} == {"r1#0/2", "r1#1/2"}
    longest = shard_rid("x" * MAX_XDC_RID, MAX_RANKS - 1, MAX_RANKS)
    assert len(longest) == MAX_RID and check_rid(longest) == longest
    with pytest.raises(ValueError, match="rank 2 of 2"):
        shard_rid("r1", 2, 2)


def test_a_prefills_answer_names_its_ranks_and_the_decode_reads_them() -> None:
    """A gateway that passes the prefill's answer on (vLLM's proxy does) tells the decode
    how the KV was split; one that builds the decode's parameters itself leaves it out."""
    answer = handover_params("r5", 70, 4)
    assert parse_prefill_answer(answer, "r5", 70) is None
    assert parse_request(answer) == LoadParams("r5", 70, None, 4)
    assert parse_request(decode_params("r5", 70, timeout_s=5.0)) == LoadParams("r5", 70, 5.0)
    assert handover_params("r5", 70)["xdc_ranks"] == 1


@pytest.mark.parametrize("rid", ["a#0/2", "#", "x#1"])
def test_a_transfer_id_with_the_shard_mark_is_refused_on_both_roles(rid: str) -> None:
    """``a#0/2`` of a one-rank engine would be rank 0's transfer of ``a`` on a split one."""
    with pytest.raises(ValueError, match="xdc_rid"):
        prefill_params(rid, deadline_s=5.0)
    with pytest.raises(ValueError, match="xdc_rid"):
        decode_params(rid, 9, timeout_s=5.0)
    with pytest.raises(ValueError, match="xdc_rid"):
        parse_request({"do_remote_decode": True, "xdc_rid": rid})
    with pytest.raises(ValueError, match="xdc_rid"):
        parse_request({"do_remote_prefill": True, "xdc_rid": rid, "xdc_num_tokens": 9})


def test_an_engine_split_over_layers_or_tokens_is_refused_by_name_and_over_heads_is_not() -> None:
    def pc(**kw: int) -> SimpleNamespace:
        return SimpleNamespace(**{"tensor_parallel_size": 1, **kw})

    assert parallel_split(pc()) is None
    assert parallel_split(pc(tensor_parallel_size=8)) is None
    assert parallel_split(pc(tensor_parallel_size=MAX_RANKS)) is None
    assert "at most" in str(parallel_split(pc(tensor_parallel_size=MAX_RANKS + 1)))
    assert parallel_split(pc(pipeline_parallel_size=2)) == (
        "pipeline parallel size 2 (each stage holds part of the layers)"
    )
    why = parallel_split(pc(decode_context_parallel_size=4))
    assert why == "decode context parallel size 4 (each rank holds part of the tokens)"


def test_a_recompute_is_named_by_its_first_cause_not_a_siblings_consequence() -> None:
    """A tensor-parallel rank whose share was refused by layout discards the transfer its
    sibling rank reads too, which that rank then sees CANCELLED, in the same step (reports
    merged in rank order) or a later one: the answer names the layout, whichever order the
    reports come in. Otherwise the first reason stays."""
    for reports in (
        [{"r": "layout_mismatch"}, {"r": "cancelled"}],
        [{"r": "cancelled"}, {"r": "layout_mismatch"}],
    ):
        got: dict[str, str] = {}
        for rep in reports:
            merge_reasons(got, rep)
        assert got == {"r": "layout_mismatch"}
    got = merge_reasons({"r": "timeout"}, {"r": "integrity", "s": "cancelled"})
    assert got == {"r": "timeout", "s": "cancelled"}
