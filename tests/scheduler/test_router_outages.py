"""The router's outage state (scheduler.outages), pure: which failure reasons blame the link,
which the decode node's intake, which nothing; dark links; holds and their release."""

from __future__ import annotations

import pytest
from xdc.scheduler.outages import MAX_KEYS, Failure, Outages, blame, failure_of


def _f(
    reason: str, stage: str = "decode", decode: str = "pd-d", cluster: str = "prfaas"
) -> Failure:
    return failure_of(cluster, decode, reason, stage)


@pytest.mark.parametrize(
    ("reason", "stage", "want"),
    [
        ("sender_down", "prefill", ("link", True)),
        ("draining", "prefill", ("link", True)),
        ("never_arrived", "decode", ("link", False)),
        ("timeout", "decode", ("link", False)),
        ("timeout", "prefill", ("none", False)),  # a slow prefill engine: not the link
        ("error", "prefill", ("none", False)),
        ("mismatch", "prefill", ("none", False)),
        ("receiver_gone", "decode", ("intake", True)),
        ("peer_unreachable", "prefill", ("intake", True)),
        ("token_count", "decode", ("none", False)),
        ("integrity", "decode", ("none", False)),
    ],
)
def test_each_reason_blames_what_it_proves(reason: str, stage: str, want: tuple[str, bool]) -> None:
    assert blame(reason, stage) == want


def test_a_link_that_went_silent_is_dark_and_one_never_heard_is_not() -> None:
    o = Outages(dark_after_s=2.0)
    assert o.links_down(100.0, {"a": None, "b": 99.0}) == {}
    down = o.links_down(101.5, {"a": None, "b": 99.0})
    assert list(down) == ["b"] and "dark: no report for 2.5s" in down["b"]


def test_sender_down_holds_until_the_sender_reports_again_or_the_hold_ends() -> None:
    o = Outages(hold_s=10.0)
    heard = {"prfaas": 100.0}
    assert o.record(_f("sender_down", "prefill"), 100.5) == "link"
    assert "sender_down" in o.links_down(100.6, heard)["prfaas"]
    o.heard("prfaas", 100.4)  # a report from before the failure says nothing
    assert "prfaas" in o.links_down(100.7, heard)
    o.heard("prfaas", 101.0)
    assert o.links_down(101.0, {"prfaas": 101.0}) == {}
    o.record(_f("sender_down", "prefill"), 200.0)
    assert o.links_down(209.9, {"prfaas": 209.0})
    assert o.links_down(210.1, {"prfaas": 210.0}) == {}


def test_ambiguous_failures_take_a_link_out_only_when_they_repeat_within_the_window() -> None:
    o = Outages(window_s=10.0, repeats=2, hold_s=5.0)
    heard = {"prfaas": None}
    o.record(_f("never_arrived"), 0.0)
    o.record(_f("never_arrived"), 11.0)  # too far apart
    assert o.links_down(11.0, heard) == {}
    o.record(_f("timeout"), 12.0)
    assert "prfaas" in o.links_down(12.0, heard)
    # a report does not lift it: the sender was never down
    o.heard("prfaas", 13.0)
    assert "prfaas" in o.links_down(13.0, {"prfaas": 13.0})
    assert o.links_down(17.5, {"prfaas": 17.0}) == {}
    assert o.counts[("prfaas", "pd-d", "never_arrived")] == 2


def test_an_intake_down_names_the_node_and_ends_with_its_hold() -> None:
    o = Outages(hold_s=3.0)
    assert o.record(_f("receiver_gone", decode="pd2-d"), 1.0) == "intake"
    assert list(o.intakes_down(2.0)) == ["pd2-d"] and "pd2-d" in o.intakes_down(2.0)["pd2-d"]
    assert o.links_down(2.0, {"prfaas": 2.0}) == {}
    assert o.intakes_down(4.5) == {}


def test_made_up_names_cannot_grow_the_state_without_bound() -> None:
    o = Outages()
    for i in range(MAX_KEYS + 500):
        o.record(_f("receiver_gone", decode=f"n{i}"), 1.0)
        o.record(_f("never_arrived", decode=f"n{i}"), 1.0)
    assert len(o.counts) <= MAX_KEYS and len(o.intakes_down(1.0)) <= MAX_KEYS


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        (("prfaas", "pd-d", "Sender down", "decode"), "reason"),
        (("prfaas", "pd-d", "x" * 33, "decode"), "reason"),
        (("prfaas", "", "timeout", "decode"), "decode_node"),
        (("pr faas", "pd-d", "timeout", "decode"), "cluster"),
        (("prfaas", "pd-d", "timeout", "later"), "stage"),
        (("prfaas", 7, "timeout", "decode"), "decode_node"),
    ],
)
def test_bad_failure_fields_are_named(fields: tuple[object, ...], what: str) -> None:
    with pytest.raises(ValueError, match=what):
        failure_of(*fields)
