"""`xdc replay` end to end through the real CLI entry point, and the inputs it parses."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from xdc.scheduler.profile import load_profile
from xdc.scheduler.sim.replay_cli import policy_params
from xdc.scheduler.sim.workload import (
    LinkSchedule,
    ReplayInputError,
    load_trace,
    parse_link_schedule,
    poisson_times,
    retime,
    synthetic,
)

from tests.paths import REPO
from xdc.cli import main

ROOT = REPO
CASE_PATH = ROOT / "deploy/profiles/prfaas-case-study.toml"
DEMO_PATH = ROOT / "deploy/profiles/small-demo.toml"


def write_trace(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


TRACE_LINES = [
    '{"timestamp": 1000, "input_length": 2048, "output_length": 8, "hash_ids": [1, 2, 3, 4]}',
    '{"timestamp": 3000, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 5]}',
    "",
    '{"timestamp": 9000, "input_length": 700, "output_length": 0}',
]


# --------------------------------------------------------------------------- inputs


def test_trace_is_read_relative_to_its_first_timestamp(tmp_path: Path) -> None:
    reqs = load_trace(write_trace(tmp_path, TRACE_LINES))
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 8.0]
    assert [r.input_tokens for r in reqs] == [2048, 1536, 700]
    assert reqs[1].hashes == (1, 2, 5) and reqs[2].hashes == ()
    fast = load_trace(write_trace(tmp_path, TRACE_LINES), rate_scale=2.0, limit=2)
    assert [r.arrival_s for r in fast] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "t.jsonl:2: not valid JSON"),
        ('{"timestamp": 5, "output_length": 1}', "t.jsonl:2: input_length"),
        ('{"timestamp": 5, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "earlier than the line"),
        ('{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    p = write_trace(tmp_path, [TRACE_LINES[0], line])
    with pytest.raises(ReplayInputError, match=message):
        load_trace(p)


def test_link_schedule_parsing() -> None:
    s = parse_link_schedule("0:100, 600:25", 50)
    assert s == LinkSchedule((0.0, 600.0), (100.0, 25.0))
    assert (s.at(0), s.at(599.9), s.at(600), s.at(1e9)) == (100, 100, 25, 25)
    # Not starting at 0: the profile's bandwidth until the first entry.
    assert parse_link_schedule("10:5", 50) == LinkSchedule((0.0, 10.0), (50.0, 5.0))
    assert parse_link_schedule("", 50) == LinkSchedule((0.0,), (50.0,))
    for bad, msg in [
        ("100", "SECONDS:GBPS"),
        ("a:b", "not numbers"),
        ("0:-1", "Gbps"),
        ("5:1,5:2", "increase"),
        ("0:1,0:2", "increase"),
        ("-1:5", "time"),
        ("0:nan", "Gbps"),
    ]:
        with pytest.raises(ReplayInputError, match=msg):
            parse_link_schedule(bad, 50)


def test_poisson_arrivals_have_the_requested_rate_and_are_seeded() -> None:
    t = poisson_times(20_000, 4.0, seed=1)
    assert t[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(t))
    assert (len(t) - 1) / t[-1] == pytest.approx(4.0, rel=0.03)
    assert poisson_times(50, 4.0, seed=1) == t[:50]
    assert poisson_times(50, 4.0, seed=2) != t[:50]
    with pytest.raises(ReplayInputError, match="rate"):
        poisson_times(5, 0.0, seed=1)


def test_synthetic_workload_samples_the_profile(tmp_path: Path) -> None:
    case = load_profile(CASE_PATH)
    reqs = synthetic(case.workload, 4000, 2.0, seed=3)
    lengths = [r.input_tokens for r in reqs]
    assert min(lengths) >= 128 and max(lengths) <= 131072
    assert sum(lengths) / len(lengths) == pytest.approx(case.workload.mean, rel=0.05)
    assert {r.output_tokens for r in reqs} == {1024}
    re = retime(load_trace(write_trace(tmp_path, TRACE_LINES)), 10.0, seed=1)
    assert [r.input_tokens for r in re] == [2048, 1536, 700]
    assert re[0].arrival_s == 0.0 and re[1].arrival_s != 2.0


def test_policy_param_overrides() -> None:
    p = policy_params(256, 30.0, ["max_raise=2", "queue_scarce_s=16", "block_size=128"])
    assert (p.block_size, p.ttft_slo_s, p.max_raise, p.queue_scarce_s) == (128, 30.0, 2.0, 16.0)
    for bad, msg in [
        (["nope=1"], "NAME=VALUE"),
        (["block_size=1.5"], "integer"),
        (["queue_scarce_s=x"], "number"),
    ]:
        with pytest.raises(ValueError, match=msg):
            policy_params(512, None, bad)
    with pytest.raises(ValueError, match="ttft-slo"):
        policy_params(512, 0.0, [])


def test_a_yes_no_policy_knob_is_set_by_word_not_by_number() -> None:
    """``keep_local_when_faster`` is the router's yes/no knob: a replay of a router that had
    it on must have it on (bench/gateway_trace.py passes the router's value)."""
    assert policy_params(512, None, ["keep_local_when_faster=True"]).keep_local_when_faster is True
    assert policy_params(512, None, ["keep_local_when_faster=off"]).keep_local_when_faster is False
    with pytest.raises(ValueError, match="expected true or false"):
        policy_params(512, None, ["keep_local_when_faster=2"])


# --------------------------------------------------------------------------- CLI


def test_cli_compare_json_on_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path, TRACE_LINES)
    rc = main(["replay", str(trace), "--profile", str(DEMO_PATH), "--compare", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3
    assert [r["policy"] for r in out["results"]] == [
        "prfaas",
        "homogeneous",
        "naive",
        "static-threshold",
    ]
    homo = out["results"][1]
    # The second prompt reuses the first one's two leading blocks (1024 of 4284 tokens).
    assert homo["cache_hit_rate"] == pytest.approx(1024 / (2048 + 1536 + 700), abs=1e-6)
    for r in out["results"]:
        assert r["completed"] + r["rejected"] + r["unfinished"] == 3


def test_cli_table_for_a_synthetic_run_with_a_link_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["replay", "--profile", str(CASE_PATH), "--synthetic", "300", "--rate", "1.5"]
    rc = main([*args, "--link-schedule", "0:20,100:5", "--policy", "static-threshold"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "static-threshold" in out
    assert "from 100s @ 5 Gbps: TTFT mean / P90 (s)" in out
    assert "throughput (req/s)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--synthetic", "10"], "--synthetic needs --rate"),
        ([], "give a TRACE file or --synthetic N"),
        (["missing.jsonl"], "cannot read"),
        (["--synthetic", "10", "--rate", "1", "--link-schedule", "x"], "link schedule"),
        (["--synthetic", "10", "--rate", "1", "--ttft-slo", "-3"], "ttft-slo"),
        (["--synthetic", "10", "--rate", "1", "--policy-param", "x=1"], "policy-param"),
        (["--synthetic", "10", "--rate", "1", "--monitor-interval", "0"], "monitor interval"),
        (["--synthetic", "0", "--rate", "1"], "at least 1 request"),
    ],
)
def test_cli_bad_inputs_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["replay", "--profile", str(DEMO_PATH), "--quiet", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_bad_profile_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("[cluster]\nn_prfaas = 1\n")
    rc = main(["replay", "--profile", str(bad), "--synthetic", "5", "--rate", "1"])
    assert rc == 2
    assert "invalid profile" in capsys.readouterr().err
