"""`xdc up` measures its engines before the router starts (issue 32): the router's profile is
the one `xdc profile measure` wrote from the real vLLM engines, not the shipped stand-in;
prefill grows with the prompt as the engines' really does; and the measurement is reused
from the workdir while nothing it depends on changed, and redone when something did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from xdc.scheduler.profile import load_profile

from tests.vllm_fixtures import need_vllm
from xdc.gateway.up import PROFILE, LocalSystem, UpOptions
from xdc.lab.netlab import unavailable_reason

pytestmark = pytest.mark.vllm


def test_xdc_up_routes_with_the_profile_it_measured_and_reuses_it(tmp_path: Path) -> None:
    need_vllm()
    why = unavailable_reason()
    if why:
        pytest.skip(f"netlab unavailable: {why}")
    said: list[str] = []
    system = LocalSystem(UpOptions(workdir=tmp_path, client_token="t"))
    with system:
        system.start(progress=said.append)
        measured = tmp_path / "profile-measured.toml"
        assert any(s.startswith(f"router profile: measured {measured}") for s in said), said
        assert system.router_state()["profile"] == str(measured)
        p = load_profile(measured)
        assert p.pd.lengths == (256, 1024, 2048, 3584)
        # 14x the tokens take the engine clearly longer (monotone by construction; the ratio
        # is the engine's own: 9-13x for the PD engine, measured straight from its endpoint).
        # The PrfaaS engine prefills through the connector, a daemon round trip per layer on
        # 2 cores the engines and both daemons share: its short prompts vary most (24-109 ms
        # at 256 tokens across runs, and in 2 of 7 runs a 0.142 s median against 0.364 s at
        # 3,584 tokens, 2.6x), so it is asked for 2x
        assert p.pd.prefill_s[-1] > 3 * p.pd.prefill_s[0], p.pd.prefill_s
        assert p.prfaas.prefill_s[-1] > 2 * p.prfaas.prefill_s[0], p.prfaas.prefill_s
        # KV sizes are what the transfers moved, byte for byte: the model's KV per token (4
        # layers x K and V x 2 heads x 64 x bf16) and the connector's digest layer (8 bytes
        # per 32-token block per layer, and 8 for the prompt's digest), for these
        # block-aligned prompts exactly
        cfg = json.loads((system.model_dir / "config.json").read_text())
        layers = cfg["num_hidden_layers"]
        kv = layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
        assert kv == 4 * 2 * 2 * 64 * 2
        moved = tuple(n * kv + (layers * (n // 32) + 1) * 8 for n in p.pd.lengths)
        assert p.pd.kv_bytes == p.prfaas.kv_bytes == moved
        assert "KV bytes: as moved through xdc by 12 PrfaaS prompts" in measured.read_text()
        assert p.egress_gbps == 1.0  # the shaped link's rate
        # the system's shape: one PrfaaS engine, one PD engine (the planner's smallest split,
        # 1 prefill + 1 decode), an all-PD baseline of the two engines there are
        assert (p.n_prfaas, p.n_pd, p.homogeneous_instances) == (1, 2, 2)
        declared = load_profile(PROFILE)
        assert p.workload.mean == declared.workload.mean  # the rest is the base profile's
        # a restart with the same workdir and engines: reused, not measured again
        said.clear()
        before = measured.stat().st_mtime_ns
        assert system._profile(said.append) == measured
        assert said == [f"router profile: {measured} (measured before, same engines)"]
        assert measured.stat().st_mtime_ns == before
        # the engines changed (another dtype): measured again
        system.opts.dtype = "float32"
        said.clear()
        assert system._profile(said.append) == measured
        assert said and said[0].startswith("router profile: measured"), said
        assert measured.stat().st_mtime_ns != before
        # new prompts, not the first run's again (the engine's prefix cache would answer
        # those in a fraction of the time): prefill still grows with the prompt
        again = load_profile(measured).pd.prefill_s
        assert again[-1] > 3 * again[0], again
