"""The compiled accept-path of the request validator agrees with the message-producing walk on
every schema the router publishes, for valid bodies, mutated ones and random JSON."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.service import openapi
from xdc.scheduler.service.validation import accepts, check

SCHEMAS = {
    "route": openapi.ROUTE_REQUEST,
    "events": openapi.CACHE_EVENTS,
    "links": openapi.LINK_REPORT,
    "nodes": openapi.NODE_REPORTS,
}
VALID: dict[str, dict[str, Any]] = {
    "route": {"rid": "r", "prompt_len": 3000, "block_hashes": [1, 2, 3], "ttft_slo_s": 5.0},
    "events": {"events": [{"kind": "stored", "cluster": "pd", "node": "n", "seq": 3}]},
    "links": {
        "from_cluster": "prfaas",
        "to_cluster": "pd",
        "reporter": "s",
        "utilisation": 0.5,
        "goodput_bps": 1e9,
        "capacity_bps": 2e9,
        "state": "ok",
        "retrans_ratio": 0.0,
        "rtt_ms": 1.0,
        "updated_at": 5.0,
    },
    "nodes": {"nodes": [{"name": "n", "cluster": "pd", "role": "decode", "decode_load": 0.5}]},
}
_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=70)
)
_json = st.recursive(
    _leaf,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=12,
)


def test_valid_bodies_are_accepted() -> None:
    for name, schema in SCHEMAS.items():
        assert check(VALID[name], schema) == [] and accepts(VALID[name], schema), name


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(sorted(SCHEMAS)), key=st.text(max_size=14), value=_json)
def test_accepts_agrees_with_check_on_mutations(name: str, key: str, value: object) -> None:
    body = dict(VALID[name])
    keys = sorted(body)
    target = keys[len(key) % len(keys)] if key[:1] in ("a", "b", "c", "") else key
    body[target] = value
    assert accepts(body, SCHEMAS[name]) == (check(body, SCHEMAS[name]) == [])


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(SCHEMAS)), value=_json)
def test_accepts_agrees_with_check_on_random_json(name: str, value: object) -> None:
    assert accepts(value, SCHEMAS[name]) == (check(value, SCHEMAS[name]) == [])
