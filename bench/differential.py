"""The long differential end-to-end run (issue 26): more waves, more sequences, the same rig
as tests/gateway/test_differential_e2e.py. Prints the control, then the tally (sequences,
completions compared, mismatches, failures, paths) and writes it as JSON.

    python bench/differential.py --waves 30 --per-wave 4 --seed 7
    python bench/differential.py --waves 6 --plant wrong_block    # the test's teeth
    python bench/differential.py --model hybrid --waves 6 --plant zero_state

``--plant`` starts the PD engine with a planted connector fault (XDC_CONNECTOR_FAULT):
``wrong_block`` lands each load's first block in its second block's place (the block
digests catch it: recompute, reason integrity; the run then fails on that count),
``stale_write`` lands loads of requests vLLM already freed (only the token comparison can
catch it), ``zero_state`` zeroes the linear-attention state a hybrid model's decode loaded
(``--model hybrid``; only the token comparison can catch it). ``--model``: the test model
both engines serve (``xdc up --model``). Needs root (network namespaces) and the vLLM venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xdc.gateway.up import MODELS, PROFILE, LocalSystem, UpOptions
from xdc.lab.differential import compared, drive, judge, make_workload, model_run, reference

TOKEN = "bench-diff"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waves", type=int, default=30)
    ap.add_argument("--per-wave", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--t", type=int, default=2048, help="the router's threshold, tokens")
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--pd-blocks", type=int, default=384, help="PD engine KV blocks (0 = all)")
    ap.add_argument("--model", choices=list(MODELS), default="dense")
    ap.add_argument("--plant", choices=["", "wrong_block", "stale_write", "zero_state"], default="")
    ap.add_argument("--out", type=Path, default=Path("bench/results/differential.json"))
    a = ap.parse_args()
    if not 1 <= a.waves <= 1000 or not 1 <= a.per_wave <= 16:
        ap.error("--waves 1..1000, --per-wave 1..16")
    if not 1 <= a.max_tokens <= 64 or not 64 <= a.t <= 3800 or not 0 <= a.loss <= 0.2:
        ap.error("--max-tokens 1..64, --t 64..3800, --loss 0..0.2")
    if a.pd_blocks and a.pd_blocks < 128:
        ap.error("--pd-blocks: 0 (all) or at least 128 (one 4,096-token prompt)")
    if a.plant == "zero_state" and a.model != "hybrid":
        ap.error("--plant zero_state needs --model hybrid (a model with a state to zero)")
    t0 = time.monotonic()
    run = model_run(a.model)
    waves = make_workload(
        a.seed, a.waves, a.t, per_wave=a.per_wave, max_tokens=a.max_tokens, align=run.align
    )
    seqs = compared(waves)
    ref = reference(
        seqs, a.max_tokens, run.checkpoint(), dtype=run.dtype, chunk=run.chunk, bind=run.bind
    )
    stable = len(seqs) - len(ref.unstable)
    print(
        f"control ({a.model}, {run.dtype}): cold == cached == cached again for "
        f"{stable}/{len(seqs)} sequences"
    )
    if a.plant:
        os.environ["XDC_CONNECTOR_FAULT"] = a.plant  # inherited by both engines
    opts = UpOptions(
        loss=a.loss,
        client_token=TOKEN,
        dtype=run.dtype,
        pd_kv_blocks=a.pd_blocks,
        profile=PROFILE,
        model=a.model,
    )
    system = LocalSystem(opts)
    with system:
        system.start(progress=print)
        outcomes = asyncio.run(drive(system, waves, TOKEN, a.max_tokens))
        tally = judge(outcomes, ref)
        pd_log = system.log("vllm-pd")
        integrity = pd_log.count("does not hash to what the producer copied")
        drops = pd_log.count("finished before its transfer")
    print(tally.line())
    print(f"block digest mismatches caught: {integrity}; loads dropped on abort: {drops}")
    for m in tally.mismatches[:10]:
        print("MISMATCH", m)
    for f in tally.failures[:10]:
        print("FAILURE", f)
    result = {
        "model": a.model,
        "seed": a.seed,
        "waves": a.waves,
        "per_wave": a.per_wave,
        "plant": a.plant,
        "control_stable": stable,
        "sequences": tally.sequences,
        "completions": tally.completions,
        "mismatches": len(tally.mismatches),
        "failures": len(tally.failures),
        "integrity_caught": integrity,
        "loads_dropped_on_abort": drops,
        "paths": dict(tally.paths),
        "seconds": round(time.monotonic() - t0, 1),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    ok = not ref.unstable and not tally.mismatches and not tally.failures and not integrity
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
