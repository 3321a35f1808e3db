"""The gateway's pure parts: node map, router decision -> plan, client request checks."""

from __future__ import annotations

import pytest

from xdc.config import GatewayConfig
from xdc.config_entries import parse_nodes, parse_receivers
from xdc.gateway import openai, plan
from xdc.gateway.gateway_app import Gateway, _producer_kv

NODES = parse_nodes("prfaas-a=http://10.0.0.1:8100, pd-p=http://pd:8200/, pd-d=http://pd:8200")


def _decision(**kw: object) -> dict[str, object]:
    d: dict[str, object] = {"target": "prfaas", "prefill_node": "prfaas-a", "decode_node": "pd-d"}
    d.update(kw)
    return d


def test_nodes_sharing_a_url_are_one_instance_and_bad_entries_are_named() -> None:
    assert NODES["pd-p"] == NODES["pd-d"] == "http://pd:8200"
    for bad, why in (
        ("pd-p", "expected name=http"),
        ("pd-p=ftp://x", "is not http"),
        ("a=http://x:1,a=http://y:2", "listed twice"),
        ("bad name=http://x:1", "expected name=http"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_nodes(bad)


def test_each_decode_nodes_receiver_is_named_and_bad_entries_are_refused() -> None:
    assert parse_receivers("pd-d=10.0.0.5:7400, pd-e = rx-e.example:7401") == {
        "pd-d": "10.0.0.5:7400",
        "pd-e": "rx-e.example:7401",
    }
    for bad, why in (
        ("pd-d", "expected name=host:port"),
        ("pd-d=10.0.0.5", "is not host:port"),
        ("pd-d=h:0", "not 1..65535"),
        ("a=h:1,a=h:2", "listed twice"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_receivers(bad)
    problems: list[str] = []
    GatewayConfig(nodes=("pd-d=http://pd:8200",), receivers=("pd-x=h:1",)).validate(problems)
    assert any("pd-x" in p and "gateway.nodes" in p for p in problems), problems


def test_a_remote_prefill_ships_to_the_receiver_of_the_chosen_decode_node() -> None:
    """The router's choice of decode node reaches the bytes: the prefill request names that
    node's receiver (issue 28); a node without one leaves it to the sender's own peer."""
    cfg = GatewayConfig(
        nodes=("prfaas-a=http://10.0.0.1:8100", "pd-d=http://pd:8200", "pd-e=http://pe:8200"),
        receivers=("pd-d=10.0.0.5:7400", "pd-e=10.0.0.6:7400"),
    )
    gw = Gateway(cfg)
    to_e = gw._shipping(plan.from_decision(_decision(decode_node="pd-e"), gw.nodes))
    assert to_e.decode_receiver == "10.0.0.6:7400"
    assert _producer_kv(gw, "r1", to_e)["xdc_peer"] == "10.0.0.6:7400"
    bare = Gateway(GatewayConfig(nodes=cfg.nodes))
    p = bare._shipping(plan.from_decision(_decision(), bare.nodes))
    assert "xdc_peer" not in _producer_kv(bare, "r2", p)


def test_offload_is_remote_and_pd_prefill_on_the_decode_instance_is_local() -> None:
    p = plan.from_decision(_decision(), NODES)
    assert (p.path, p.prefill_url, p.decode_url) == (
        plan.Path.REMOTE,
        NODES["prfaas-a"],
        NODES["pd-d"],
    )
    local = plan.from_decision(_decision(target="pd", prefill_node="pd-p"), NODES)
    assert local.path is plan.Path.LOCAL and local.source is plan.Source.ROUTER
    assert "path=local" in local.header() and "prefill=pd-p" in local.header()


def test_a_prefix_cached_in_prfaas_moves_the_prefill_there() -> None:
    xfer = {"source_cluster": "prfaas", "source_node": "prfaas-a", "dest_cluster": "pd"}
    p = plan.from_decision(
        _decision(target="pd", prefill_node="pd-p", cache_transfer=xfer, cached_tokens=2976),
        NODES,
    )
    assert p.path is plan.Path.REMOTE and p.prefill_node == "prfaas-a"
    assert p.cache_transfer == "moved" and "cached=2976" in p.header()


def test_a_prefix_cached_in_pd_cannot_move_to_prfaas_so_it_is_recomputed_there() -> None:
    xfer = {"source_cluster": "pd", "source_node": "pd-p", "dest_cluster": "prfaas"}
    p = plan.from_decision(_decision(cache_transfer=xfer), NODES)
    assert p.path is plan.Path.REMOTE and p.prefill_node == "prfaas-a"
    assert p.cache_transfer == "recompute"


def test_unknown_nodes_and_malformed_decisions_are_plan_errors() -> None:
    with pytest.raises(plan.PlanError, match="prfaas-0"):
        plan.from_decision(_decision(prefill_node="prfaas-0"), NODES)
    with pytest.raises(plan.PlanError):
        plan.from_decision({"target": "pd", "prefill_node": None, "decode_node": 3}, NODES)


def test_recovery_and_fallback_plans() -> None:
    rec = plan.recovery(plan.from_decision(_decision(), NODES))
    assert rec.path is plan.Path.LOCAL and rec.source is plan.Source.RECOVERY
    assert rec.prefill_url == rec.decode_url == NODES["pd-d"]
    fb = plan.fallback("pd-p", "pd-d", NODES)
    assert fb.path is plan.Path.LOCAL and fb.source is plan.Source.FALLBACK


def _parse(body: object, chat: bool = False) -> openai.Job:
    return openai.parse(body, chat=chat, model="m", default_max_tokens=16, max_tokens_limit=100)


def test_requests_become_jobs_with_token_ids_text_or_messages() -> None:
    j = _parse({"model": "m", "prompt": [1, 2, 3], "temperature": 0, "stop": "x", "seed": 3})
    assert j.prompt_ids == [1, 2, 3] and j.max_tokens == 16
    body = j.engine_body([1, 2, 3], max_tokens=1, kv={"a": 1}, stream=False)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 1 and body["stop"] == ["x"]
    assert body["kv_transfer_params"] == {"a": 1} and body["seed"] == 3
    assert _parse({"model": "m", "prompt": "hi"}).prompt_text == "hi"
    assert _parse({"model": "m", "prompt": [[5, 6]]}).prompt_ids == [5, 6]
    c = _parse(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "stream": True,
        },
        chat=True,
    )
    assert c.messages == [{"role": "user", "content": "hi"}] and c.max_tokens == 5 and c.stream


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ([], None, 400),
        ({"model": "other", "prompt": [1]}, "model", 404),
        ({"model": "m", "prompt": [1], "kv_transfer_params": {}}, "kv_transfer_params", 400),
        ({"model": "m", "prompt": [1], "bogus": 1}, "bogus", 400),
        ({"model": "m", "prompt": []}, "prompt", 400),
        ({"model": "m", "prompt": [-1]}, "prompt", 400),
        ({"model": "m", "prompt": [True]}, "prompt", 400),
        ({"model": "m", "prompt": [[1], [2]]}, "prompt", 400),
        ({"model": "m", "prompt": ""}, "prompt", 400),
        ({"model": "m", "prompt": [1], "max_tokens": 0}, "max_tokens", 400),
        ({"model": "m", "prompt": [1], "max_tokens": 101}, "max_tokens", 400),
        ({"model": "m", "prompt": [1], "temperature": float("nan")}, "temperature", 400),
        ({"model": "m", "prompt": [1], "temperature": "hot"}, "temperature", 400),
        ({"model": "m", "prompt": [1], "n": 2}, "n", 400),
        ({"model": "m", "prompt": [1], "echo": True}, "echo", 400),
        ({"model": "m", "prompt": [1], "stream": "yes"}, "stream", 400),
        ({"model": "m", "prompt": [1], "stop": ["a"] * 9}, "stop", 400),
    ],
)
def test_bad_requests_name_the_parameter(body: object, param: str | None, status: int) -> None:
    with pytest.raises(openai.BadRequest) as e:
        _parse(body)
    assert (e.value.param, e.value.status) == (param, status)


def test_bad_chat_messages_are_refused() -> None:
    for msgs in (
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ):
        with pytest.raises(openai.BadRequest, match="messages"):
            _parse({"model": "m", "messages": msgs}, chat=True)


def test_answers_carry_the_gateways_id_and_chat_shape() -> None:
    job = _parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}, chat=True)
    eng = {
        "id": "cmpl-engine",
        "model": "/path",
        "choices": [{"text": "hey", "finish_reason": "length", "token_ids": [7]}],
        "usage": {"prompt_tokens": 3},
    }
    a = openai.completion_answer(job, eng)
    assert (
        a["id"] == f"chatcmpl-{job.id}" and a["model"] == "m" and a["object"] == "chat.completion"
    )
    assert a["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    first = openai.stream_chunk(job, eng, first=True)
    assert first is not None and first["choices"][0]["delta"]["role"] == "assistant"
    assert openai.stream_chunk(job, {"choices": [], "usage": {"x": 1}}, first=False) is None
