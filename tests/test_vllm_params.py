"""The connector's pure parts, without vLLM: per-request transfer parameters and instance
config (every bad value a clear error naming its field), and which blocks move in which step
of a (chunked) prefill."""

from __future__ import annotations

from typing import Any

import pytest

from xdc.integrations.vllm.blocks import SaveState, blocks_for
from xdc.integrations.vllm.params import ConnectorConfig, LoadParams, SendParams, parse_request


def test_requests_parse_into_send_or_load() -> None:
    assert parse_request(None) is None
    assert parse_request({"other": 1}) is None
    assert parse_request({"do_remote_decode": True, "xdc_rid": "r1"}) == SendParams("r1", None)
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
        ({"do_remote_prefill": True, "do_remote_decode": True, "xdc_rid": "r"}, "both"),
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


def test_an_unchunked_prefill_sends_every_block_in_its_one_step() -> None:
    st = SaveState("q", "r", prompt_len=70, block_size=32, deadline_s=30)
    step = st.step([5, 9, 2], computed=0, scheduled=70)
    assert step is not None
    assert (step.first, step.block_ids, step.begin, step.last, step.total_blocks) == (
        0,
        (5, 9, 2),
        True,
        True,
        3,
    )
    assert st.step([], computed=70, scheduled=1) is None  # decode steps send nothing


def test_a_chunked_prefill_sends_each_block_in_the_step_that_completes_it() -> None:
    st = SaveState("q", "r", prompt_len=100, block_size=32, deadline_s=30)
    s1 = st.step([4, 8], computed=0, scheduled=40)  # block 0 final, block 1 half written
    assert s1 is not None and (s1.first, s1.block_ids, s1.begin, s1.last) == (0, (4,), True, False)
    assert st.step([], computed=40, scheduled=20) is None  # 60 tokens: block 1 still open
    s3 = st.step([7, 1], computed=60, scheduled=40)  # prompt done: blocks 1, 2 and partial 3
    assert s3 is not None and (s3.first, s3.block_ids, s3.begin, s3.last) == (
        1,
        (8, 7, 1),
        False,
        True,
    )
    assert blocks_for(100, 32) == 4 == s3.total_blocks


def test_cached_prefix_blocks_go_with_the_first_step() -> None:
    st = SaveState("q", "r", prompt_len=96, block_size=32, deadline_s=30)
    s = st.step([3, 4, 6], computed=64, scheduled=32)  # 64 tokens came from the prefix cache
    assert s is not None and s.block_ids == (3, 4, 6) and s.last
